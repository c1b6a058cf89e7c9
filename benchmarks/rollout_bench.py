"""Rollout throughput: batched engine vs a sequential per-dialogue loop vs raw generate.

Runs N dialogues x T turns with the embedded policy (SmolLM2-135M) and either the
embedded LLM simulator (Qwen2.5-Coder-1.5B GGUF via llama.cpp) or the rule
simulator (isolates the policy side). Three phases in one process, same models:

1. batched: ``run_rollouts`` over all dialogues (one ``generate`` per turn);
2. sequential: ``run_rollouts`` once per dialogue, one after another;
3. raw: the policy's batched ``generate`` alone, replaying the exact batches the
   batched phase sent — orchestration overhead (%) = (policy-side time of phase 1
   - raw time) / raw time, where policy-side time = phase-1 wall time minus the
   time spent inside the simulator backend.

Usage: ``python benchmarks/rollout_bench.py [--simulator rule|llm] [--dialogues 16]
[--turns 3] [--json OUT]``. Prints a table; ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

from rlver_lib.config import PolicyConfig, SamplingParams, SimulatorConfig
from rlver_lib.files import atomic_write_json
from rlver_lib.models import load_policy, make_policy_backend, make_simulator_backend
from rlver_lib.rollout import run_rollouts
from rlver_lib.scenarios import load_scenarios
from rlver_lib.simulator import RuleSimulator, UserSimulator


@dataclass
class Timed:
    """Wraps a backend: wall time inside ``generate``, completion tokens, and the batches sent."""

    backend: object
    seconds: float = 0.0
    tokens: int = 0
    batches: list = field(default_factory=list)

    def __getattr__(self, name):  # prompt_ids, tokenizer, ... of the wrapped backend
        return getattr(self.backend, name)

    def generate(self, conversations, sampling, json_schema=None):
        start = time.perf_counter()
        out = self.backend.generate(conversations, sampling, json_schema=json_schema)
        self.seconds += time.perf_counter() - start
        self.tokens += sum(_n_tokens(g) for g in out)
        self.batches.append((list(conversations), sampling))
        return out

    def reset(self):
        self.seconds, self.tokens, self.batches = 0.0, 0, []


def _n_tokens(generation) -> int:
    if generation.completion_ids is not None:
        return len(generation.completion_ids)
    return int(generation.meta.get("usage", {}).get("completion_tokens", 0))


def _phase(policy: Timed, simulator_backend: Timed | None, fn) -> dict:
    policy.reset()
    if simulator_backend is not None:
        simulator_backend.reset()
    start = time.perf_counter()
    trajectories = fn()
    wall = time.perf_counter() - start
    sim_s = simulator_backend.seconds if simulator_backend else 0.0
    sim_tokens = simulator_backend.tokens if simulator_backend else 0
    figures = {
        "wall_s": wall, "policy_s": policy.seconds, "simulator_s": sim_s,
        "policy_tokens": policy.tokens, "simulator_tokens": sim_tokens,
        "dialogues": len(trajectories),
        "dialogues_per_min": 60 * len(trajectories) / wall,
        "tokens_per_s": (policy.tokens + sim_tokens) / wall,
        "terminations": sorted({t.termination for t in trajectories}),
    }
    print(f"  phase done: {json.dumps(figures)}", flush=True)
    return figures


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulator", choices=["rule", "llm"], default="rule")
    parser.add_argument("--dialogues", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--sim-max-new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    scenarios = load_scenarios("builtin:all")[: args.dialogues]
    if len(scenarios) < args.dialogues:
        parser.error(f"only {len(scenarios)} built-in scenarios")
    model, tokenizer = load_policy(PolicyConfig(dtype="float32"))
    policy = Timed(make_policy_backend(PolicyConfig(), model, tokenizer))
    sim_backend = None
    if args.simulator == "llm":
        sim_cfg = SimulatorConfig(max_new_tokens=args.sim_max_new_tokens)
        sim_backend = Timed(make_simulator_backend(sim_cfg, args.seed))
        simulator = UserSimulator(sim_backend, sim_cfg, seed=args.seed)
    else:
        simulator = RuleSimulator()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    common = dict(max_turns=args.turns, initial_emotion=40, think=False, sampling=sampling,
                  seed=args.seed, progress=False)

    batched = _phase(policy, sim_backend, lambda: run_rollouts(policy, simulator, scenarios, **common))
    replay = list(policy.batches)
    sequential = _phase(policy, sim_backend, lambda: [
        t for s in scenarios for t in run_rollouts(policy, simulator, [s], **common)])

    policy.reset()
    start = time.perf_counter()
    for conversations, turn_sampling in replay:
        policy.backend.generate(conversations, turn_sampling)
    raw_s = time.perf_counter() - start
    policy_side = batched["wall_s"] - batched["simulator_s"]
    figures = {
        "settings": vars(args),
        "batched": batched,
        "sequential": sequential,
        "raw_generate_s": raw_s,
        "speedup_vs_sequential": sequential["wall_s"] / batched["wall_s"],
        "policy_side_s": policy_side,
        "orchestration_overhead_pct": 100 * (policy_side - raw_s) / raw_s,
    }
    print(f"{args.dialogues} dialogues x {args.turns} turns, simulator={args.simulator}")
    for name in ("batched", "sequential"):
        p = figures[name]
        print(f"  {name:10s} {p['wall_s']:8.1f} s  {p['dialogues_per_min']:7.2f} dialogues/min  "
              f"{p['tokens_per_s']:7.1f} tok/s  (policy {p['policy_s']:.1f} s, simulator {p['simulator_s']:.1f} s)")
    print(f"  speedup vs sequential: {figures['speedup_vs_sequential']:.2f}x")
    print(f"  policy side {policy_side:.1f} s vs raw batched generate {raw_s:.1f} s: "
          f"overhead {figures['orchestration_overhead_pct']:+.1f} %")
    if args.json:
        atomic_write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
