"""Do the policy's sampled benchmark replies survive a change of numerics?

A recorded benchmark (``<run>/eval/<label>/dialogues.jsonl``) holds each dialogue's first
user message, the seed of its repeat and the policy's first reply. This script plays the
first policy turn again, one batch per repeat as the benchmark did (same conversations,
same order, same seed), under one numerics variant, and counts the replies that come out
identical to the recorded ones:

    python benchmarks/reply_numerics.py outputs/laptop-ppo/eval/baseline
    python benchmarks/reply_numerics.py outputs/laptop-ppo/eval/baseline --dtype bfloat16
    ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 \\
        python benchmarks/reply_numerics.py outputs/laptop-ppo/eval/baseline

The first line checks that the benchmark reproduces on this machine; the second plays the
policy in the precision that ``policy.dtype: auto`` picks on a CPU with native bf16 (an
Intel Xeon with AMX); the third runs PyTorch's and MKL's plainer kernels, the kind of
change a CPU of another family brings. Prints the variant, the replies identical to the
recorded ones, and where the others part from them (the shared prefix in tokens).
Why it matters: docs/MEASURED.md "Why the laptop GRPO run did not reproduce".
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from rlver_lib.backends import derive_seed
from rlver_lib.files import EvalFolder, RunFolder, iter_jsonl
from rlver_lib.models import load_policy, make_policy_backend
from rlver_lib.params import load_run_config
from rlver_lib.rollout import policy_messages


def first_turns(dialogues: Path) -> dict[int, list[dict]]:
    """The recorded dialogues with an opening and a first reply, by repeat, in file order."""
    by_repeat: dict[int, list[dict]] = {}
    for _, rec in iter_jsonl(dialogues):
        turns = rec["transcript"]
        if len(turns) > 1 and turns[0].get("content") is not None and turns[1]["role"] == "assistant":
            by_repeat.setdefault(rec["repeat"], []).append(rec)
    return by_repeat


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("eval_dir", type=Path, help="a benchmark folder, e.g. outputs/<run>/eval/baseline")
    ap.add_argument("--dtype", default=None, help="the policy's dtype (default: the run's policy.dtype)")
    ap.add_argument("--adapter", default=None,
                    help="the LoRA adapter the benchmark played (needed for any label but baseline)")
    args = ap.parse_args()
    run_dir = args.eval_dir.resolve().parents[1]
    cfg = load_run_config(RunFolder(run_dir).config)
    turns = first_turns(EvalFolder(args.eval_dir).dialogues)
    labels = {r["label"] for records in turns.values() for r in records}
    if labels != {"baseline"} and args.adapter is None:
        raise SystemExit(f"{args.eval_dir}: the {', '.join(sorted(labels))} benchmark played an adapter; "
                         "pass it with --adapter")
    update = {"dtype": args.dtype or cfg.policy.dtype, "adapter": args.adapter or cfg.policy.adapter}
    policy_cfg = cfg.policy.model_copy(update=update)
    model, tokenizer = load_policy(policy_cfg)
    backend = make_policy_backend(policy_cfg, model, tokenizer)
    same = total = 0
    prefixes: list[int] = []
    start = time.perf_counter()
    for _, records in sorted(turns.items()):
        conversations = [policy_messages(SimpleNamespace(language=r["language"], id=r["scenario_id"]),
                                         [{"role": "user", "content": r["transcript"][0]["content"]}],
                                         cfg.policy.think) for r in records]
        sampling = replace(cfg.policy.sampling(cfg.seed), seed=derive_seed(records[0]["seed"], "policy", 0))
        for rec, gen in zip(records, backend.generate(conversations, sampling)):
            recorded = rec["transcript"][1]["raw"]
            total += 1
            if gen.text == recorded:
                same += 1
            else:
                prefixes.append(shared_prefix(tokenizer.encode(gen.text), tokenizer.encode(recorded)))
    variant = ", ".join(f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
                        if k in os.environ) or "default kernels"
    print(f"dtype {policy_cfg.compute_dtype()}, {variant} (torch {torch.backends.cpu.get_cpu_capability()}): "
          f"{same} of {total} first replies identical to the recorded ones"
          + (f"; the other {len(prefixes)} part after {sorted(prefixes)} shared tokens" if prefixes else "")
          + f" ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
