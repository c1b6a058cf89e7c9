"""One GRPO update on an identical batch: our learner vs TRL's GRPOTrainer, side by side.

Both run on the same LoRA policy (embedded SmolLM2 by default), the same token ids,
masks, old log-probs and advantages: forward, clipped GRPO loss (token mean), backward,
AdamW step. Reports tokens/s (batch tokens / update time, best of ``--repeats``) and
the process's peak resident memory after each side (RSS is a running maximum, so
the second figure includes the first; ours runs first).

    OMP_NUM_THREADS=2 python benchmarks/learner_bench.py --batch 8 --prompt 64 --completion 32

``--learner-memory RECIPE`` measures instead the peak memory of the trainer's own learner
step at the longest sequence a recipe allows (``policy.max_context_tokens +
policy.max_new_tokens`` tokens, the last ``max_new_tokens`` of them policy tokens), with
the recipe's LoRA, dtype, gradient checkpointing and loss coefficients on the embedded
policy: scoring the old log-probs (no gradient), then one micro-batch's forward,
backward and optimizer step (``learner.micro_batch_loss``). Each phase's peak is the
process's resident memory sampled every millisecond, minus its level before the phase.
It uses only functions the trainer had before the chunked log-probs, so the same script
measures an older checkout (``PYTHONPATH=<old checkout>``):

    OMP_NUM_THREADS=2 python benchmarks/learner_bench.py --learner-memory params/paper-ppo-think-moderate.yaml
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import torch


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch(vocab: int, batch: int, prompt: int, completion: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(batch, completion, dtype=torch.long)
    for i in range(batch):  # uneven completion lengths
        completion_mask[i, completion - i % 4:] = 0
    return {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (batch, completion), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(batch, generator=g),
        "old_per_token_logps": -torch.rand(batch, completion, generator=g) * 5,
    }


def _lora_model(args):
    from peft import LoraConfig, get_peft_model

    from rlver_lib.models import load_causal_lm

    torch.manual_seed(args.seed)
    model, tokenizer = load_causal_lm(args.model, args.dtype)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"], task_type="CAUSAL_LM"))
    return model, tokenizer


def _timed(update, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        update()
        best = min(best, time.perf_counter() - t)
    return best


def bench_ours(args, inputs) -> tuple[float, float]:
    from rlver_lib import algorithms as alg
    from rlver_lib.learner import PolicyWithValueHead

    model, _ = _lora_model(args)
    module = PolicyWithValueHead(model, None, temperature=1.0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    mask[:, args.prompt - 1:] = inputs["completion_mask"].float()
    old = torch.zeros_like(mask)
    old[:, args.prompt - 1:] = inputs["old_per_token_logps"]

    def update():
        out = module(ids, attn, mask)
        loss = alg.clipped_policy_loss(out["logprobs"], old, inputs["advantages"], mask,
                                       aggregation="token_mean").loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    return _timed(update, args.repeats), _peak_rss_mb()


def bench_trl(args, inputs) -> tuple[float, float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _lora_model(args)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, loss_type="bnpo", beta=0.0, num_generations=2, report_to=[],
                         per_device_train_batch_size=2, max_completion_length=args.completion,
                         use_cpu=True, bf16=False, learning_rate=1e-5, gradient_checkpointing=False)
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=cfg, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 2),
                              processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    trainer.model.train()
    inputs = dict(inputs, num_items_in_batch=inputs["completion_mask"].sum())

    def update():
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    return _timed(update, args.repeats), _peak_rss_mb()


class _PeakRSS:
    """Resident memory of this process sampled every ``interval_s`` in a thread while in
    the ``with`` block; ``peak_mb`` is the largest level above the level at entry."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s

    @staticmethod
    def _rss_mb() -> float:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    def __enter__(self):
        import threading

        self.base = self._rss_mb()
        self.peak = self.base
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, self._rss_mb())
                self._stop.wait(self.interval_s)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss_mb())
        self.peak_mb = self.peak - self.base


def learner_memory(args) -> dict:
    """Peak memory of the learner step at the recipe's longest sequence (see the module docstring)."""
    import gc

    import rlver_lib
    from rlver_lib import learner
    from rlver_lib.config import EMBEDDED_POLICY
    from rlver_lib.params import load_config

    cfg = load_config(args.learner_memory, {"policy.model": EMBEDDED_POLICY, "policy.backend": "transformers",
                                            "policy.dtype": args.dtype_memory})
    torch.manual_seed(args.seed)
    model, tokenizer = learner.build_model(cfg)
    context = cfg.policy.max_context_tokens if args.memory_context is None else args.memory_context
    length = context + cfg.policy.max_new_tokens
    policy_tokens = cfg.policy.max_new_tokens
    g = torch.Generator().manual_seed(args.seed)
    samples = []
    for i in range(args.batch):
        ids = torch.randint(0, model.policy.config.vocab_size, (length,), generator=g)
        mask = torch.zeros(length - 1)
        mask[length - 1 - policy_tokens:] = 1.0
        samples.append(learner.Sample(f"d{i}", "g", 0, ids, mask))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gc.collect()
    with _PeakRSS() as scoring:
        start = time.perf_counter()
        learner.score_old(model, samples, batch_size=args.batch, pad_id=pad, device=torch.device("cpu"),
                          reference=cfg.training.kl_coef > 0)
        scoring_s = time.perf_counter() - start
    for s in samples:
        s.advantages = s.mask * torch.randn(s.mask.shape, generator=g)
        s.returns = s.mask * torch.rand(s.mask.shape, generator=g)
        if s.old_values is None:
            s.old_values = torch.zeros_like(s.mask)
    optimizer = torch.optim.AdamW(learner.optimizer_groups(model, cfg.training))
    batch = learner.collate(samples, pad, torch.device("cpu"))
    tokens, rows = float(batch["mask"].sum()), float(len(samples))
    model.train()
    gc.collect()
    with _PeakRSS() as update:
        start = time.perf_counter()
        loss, _ = learner.micro_batch_loss(model, batch, cfg.training, max_new_tokens=cfg.policy.max_new_tokens,
                                           tokens=tokens, rows=rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_s = time.perf_counter() - start
    return {"recipe": str(args.learner_memory), "rlver_lib": str(Path(rlver_lib.__file__).parent),
            "algorithm": cfg.training.algorithm, "dtype": cfg.policy.dtype,
            "gradient_checkpointing": cfg.training.gradient_checkpointing,
            "entropy_coef": cfg.training.entropy_coef, "lora_r": cfg.policy.lora.r,
            "vocab": model.policy.config.vocab_size, "samples": len(samples), "sequence_tokens": length,
            "policy_tokens_per_sample": policy_tokens, "threads": torch.get_num_threads(),
            "score_old_peak_mb": round(scoring.peak_mb, 1), "score_old_s": round(scoring_s, 1),
            "update_peak_mb": round(update.peak_mb, 1), "update_s": round(update_s, 1),
            "process_peak_rss_mb": round(_peak_rss_mb(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=None, help="samples (8; --learner-memory: 1)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learner-memory", type=Path, default=None, metavar="RECIPE",
                        help="measure the learner step's peak memory at RECIPE's longest sequence instead")
    parser.add_argument("--dtype-memory", default="bfloat16", choices=["float32", "bfloat16"],
                        help="policy dtype of --learner-memory (the recipes': bfloat16)")
    parser.add_argument("--memory-context", type=int, default=None,
                        help="context tokens before the policy tokens (default: the recipe's max_context_tokens)")
    args = parser.parse_args()
    args.batch = args.batch or (1 if args.learner_memory is not None else 8)
    if args.learner_memory is not None:
        import json

        print(json.dumps(learner_memory(args), indent=1))
        return
    from rlver_lib.models import load_causal_lm

    vocab = load_causal_lm(args.model, args.dtype)[0].config.vocab_size
    inputs = _batch(vocab, args.batch, args.prompt, args.completion, args.seed)
    tokens = args.batch * (args.prompt + args.completion)
    results = {"rlver": bench_ours(args, inputs), "trl GRPOTrainer": bench_trl(args, inputs)}
    print(f"one GRPO update, batch {args.batch} x ({args.prompt} prompt + {args.completion} completion) tokens, "
          f"{args.dtype}, threads {torch.get_num_threads()}")
    print(f"{'learner':<18}{'seconds':>10}{'tokens/s':>12}{'peak RSS MB':>14}")
    for name, (seconds, rss) in results.items():
        print(f"{name:<18}{seconds:>10.2f}{tokens / seconds:>12.1f}{rss:>14.0f}")


if __name__ == "__main__":
    main()
