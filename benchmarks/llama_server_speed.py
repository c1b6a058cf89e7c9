"""Prefill and decoding speed of two or more ``llama-server`` binaries on the embedded
simulator model, side by side in one run: for comparing builds of the same source
(optimisation levels, unity batches; docs/MEASURED.md "The native build").

Each binary serves the simulator GGUF with one slot and ``--threads`` threads; it gets
one warm-up request and then ``--requests`` greedy completions of the same ~330-token
prompt (a number appended so no prompt cache is reused) with ``--tokens`` new tokens
each; the figures are the medians of the server's own ``timings`` (tokens/s). The
binaries are alternated ``--rounds`` times, so a drift of the machine hits each alike.

Usage: ``python benchmarks/llama_server_speed.py BINARY [BINARY ...] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rlver_lib.models import simulator_gguf_path  # noqa: E402

PROMPT = ("You are a person talking to a friend about a hard week at work. " * 24)[:1500]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"llama-server not ready after {timeout_s} s")


def measure(binary: str, args: argparse.Namespace) -> tuple[float, float]:
    """(prefill, decode) tokens/s of ``binary``: medians over the requests after a warm-up."""
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([binary, "-m", str(simulator_gguf_path()), "--port", str(args.port),
                             "-t", str(args.threads), "-np", "1", "-c", "2048", "--no-warmup"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_healthy(url, proc)
        rows = []
        for i in range(args.requests + 1):
            timings = _post(f"{url}/completion", {"prompt": f"{PROMPT} ({i})", "n_predict": args.tokens,
                                                  "temperature": 0, "cache_prompt": False,
                                                  "ignore_eos": True})["timings"]
            rows.append((timings["prompt_per_second"], timings["predicted_per_second"]))
        prefill, decode = zip(*rows[1:])
        return statistics.median(prefill), statistics.median(decode)
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binaries", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18080)
    args = parser.parse_args(argv)
    for round_index in range(args.rounds):
        for binary in args.binaries:
            prefill, decode = measure(binary, args)
            print(f"round {round_index} {binary}: prefill {prefill:.1f} tokens/s, decode {decode:.1f} tokens/s",
                  flush=True)


if __name__ == "__main__":
    main()
