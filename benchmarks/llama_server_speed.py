"""Prefill and decoding speed of two or more ``llama-server`` binaries on the embedded
simulator model, side by side in one run: for comparing builds of the same source
(optimisation levels, unity batches; docs/MEASURED.md "The native build").

Each binary serves the simulator GGUF as the workbench starts it (one slot, ``--threads``
threads); it gets one warm-up request and then ``--requests`` greedy completions of the
same ~330-token prompt (a number appended so no prompt cache is reused) with ``--tokens``
new tokens each; the figures are the medians of the server's own ``timings`` (tokens/s). The
binaries are alternated ``--rounds`` times, so a drift of the machine hits each alike.

Usage: ``python benchmarks/llama_server_speed.py BINARY [BINARY ...] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rlver_lib.models import simulator_gguf_path  # noqa: E402
from rlver_lib.servers import LlamaServerBackend  # noqa: E402

PROMPT = ("You are a person talking to a friend about a hard week at work. " * 24)[:1500]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def measure(binary: str, args: argparse.Namespace) -> tuple[float, float]:
    """(prefill, decode) tokens/s of ``binary``, started as the simulator's server is
    (:class:`rlver_lib.servers.LlamaServerBackend`, one slot): medians over the requests
    after a warm-up."""
    with LlamaServerBackend(simulator_gguf_path(), binary=binary, parallel=1, n_ctx=2048,
                            threads=args.threads) as server:
        rows = []
        for i in range(args.requests + 1):
            timings = _post(f"http://127.0.0.1:{server.port}/completion",
                            {"prompt": f"{PROMPT} ({i})", "n_predict": args.tokens, "temperature": 0,
                             "cache_prompt": False, "ignore_eos": True})["timings"]
            rows.append((timings["prompt_per_second"], timings["predicted_per_second"]))
    prefill, decode = zip(*rows[1:])
    return statistics.median(prefill), statistics.median(decode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binaries", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    for round_index in range(args.rounds):
        for binary in args.binaries:
            prefill, decode = measure(binary, args)
            print(f"round {round_index} {binary}: prefill {prefill:.1f} tokens/s, decode {decode:.1f} tokens/s",
                  flush=True)


if __name__ == "__main__":
    main()
