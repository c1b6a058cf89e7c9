"""Simulated-user throughput: the served, batched, prefix-reusing path vs the old one.

Both paths run the same model (default: the embedded Qwen2.5-Coder-1.5B GGUF), the
same prompts, schemas and sampling, through ``UserSimulator.step`` on the same
dialogues; the policy side is scripted (a fixed cycle of replies), so only the
simulator is timed. One simulator turn = one appraise call + one reply call.

- ``old``: how the simulator ran before: one conversation at a time (one server
  slot, requests sent one after another, no host-memory prompt cache) and the old
  prompt layout, in which the score and mood sat in the system prompt, so every
  turn changed the prompt after the persona and nothing after it could be reused.
  (The old in-process llama.cpp binding ran the same kernels one call at a time and
  reused only the common prefix with the previous call, as one slot does here.)
- ``new``: ``--dialogues`` slots decoded together (continuous batching), the new
  layout (static scenario, transcript, then the per-call instruction), so each
  dialogue's slot re-reads only what the last turn appended.

Prints turns/min of each path, the ratio, the share of valid structured outputs
and the peak resident memory of each server process; ``--json FILE`` writes
``old_turns_per_min``, ``new_turns_per_min``, ``ratio``, ``valid_share`` and more.
``--old-dialogues M`` times the old path on the first M dialogues only (its rate
per turn does not depend on how many dialogues wait in line), for quicker runs.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from tqdm.auto import tqdm

from rlver_lib.backends import LlamaServerBackend
from rlver_lib.config import SimulatorConfig
from rlver_lib.io import atomic_write_json
from rlver_lib.models import simulator_gguf_path
from rlver_lib.scenarios import load_scenarios
from rlver_lib.simulator import SimulatorRequest, UserSimulator

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


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_path(name: str, scenarios, *, turns: int, parallel: int, threads: int, seed: int,
             old_layout: bool) -> dict:
    """Play ``len(scenarios)`` dialogues x ``turns`` simulator turns; returns the figures."""
    cfg = SimulatorConfig(temperature=0.7, max_new_tokens=192, max_retries=0, n_ctx=4096)
    extra = ("--cache-ram", "0") if old_layout else ()
    with LlamaServerBackend(simulator_gguf_path(), n_ctx=cfg.n_ctx, parallel=parallel, threads=threads,
                            seed=seed, timeout_s=3600, max_retries=0, extra_args=extra) as server:
        simulator = UserSimulator(OldLayout(server) if old_layout else server, cfg, seed=seed)
        histories = {s.id: [{"role": "user", "content": s.opening_line}] for s in scenarios}
        emotions = {s.id: 50 for s in scenarios}
        done = valid = 0
        start = time.perf_counter()
        bar = tqdm(total=len(scenarios) * turns, desc=f"{name} path", unit="turn")
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
                # an unusable turn keeps the dialogue going with a neutral line, so both
                # paths always process the same number of turns
                histories[s.id].append({"role": "user", "content": result.reply or "Hm."})
            bar.update(len(scenarios))
        bar.close()
        seconds = time.perf_counter() - start
        peak = _peak_rss_mb(server.process.pid)
    return {"turns": done, "valid": valid, "seconds": round(seconds, 1),
            "turns_per_min": round(done / seconds * 60, 3), "peak_rss_mb": round(peak)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dialogues", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--old-dialogues", type=int, help="time the old path on this many dialogues")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    scenarios = [s for s in load_scenarios("builtin:train") if s.opening_line][: args.dialogues]
    if len(scenarios) < args.dialogues:
        raise SystemExit(f"only {len(scenarios)} shipped scenarios have an opening line")
    old_n = min(args.old_dialogues or args.dialogues, args.dialogues)
    new = run_path("new", scenarios, turns=args.turns, parallel=args.dialogues, threads=args.threads,
                   seed=args.seed, old_layout=False)
    print(f"new: {new}", flush=True)
    old = run_path("old", scenarios[:old_n], turns=args.turns, parallel=1, threads=args.threads,
                   seed=args.seed, old_layout=True)
    print(f"old: {old}", flush=True)
    ratio = new["turns_per_min"] / old["turns_per_min"]
    result = {
        "dialogues": args.dialogues, "turns": args.turns, "old_dialogues": old_n, "threads": args.threads,
        "old_turns_per_min": old["turns_per_min"], "new_turns_per_min": new["turns_per_min"],
        "ratio": round(ratio, 2),
        "valid_share": round((old["valid"] + new["valid"]) / (old["turns"] + new["turns"]), 4),
        "old_valid_share": round(old["valid"] / old["turns"], 4),
        "new_valid_share": round(new["valid"] / new["turns"], 4),
        "old_peak_rss_mb": old["peak_rss_mb"], "new_peak_rss_mb": new["peak_rss_mb"],
        "old": old, "new": new,
    }
    print(f"{'path':<5} {'turns/min':>10} {'valid':>7} {'peak RSS MB':>12}")
    for name, row in (("old", old), ("new", new)):
        print(f"{name:<5} {row['turns_per_min']:>10.2f} {row['valid'] / row['turns']:>7.0%} {row['peak_rss_mb']:>12}")
    print(f"ratio new/old: {ratio:.2f}x")
    if args.json:
        atomic_write_json(args.json, result)


if __name__ == "__main__":
    main()
