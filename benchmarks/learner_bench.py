"""One GRPO update on an identical batch: our learner vs TRL's GRPOTrainer, side by side.

Both run on the same LoRA policy (embedded SmolLM2 by default), the same token ids,
masks, old log-probs and advantages: forward, clipped GRPO loss (token mean), backward,
AdamW step. Reports tokens/s (batch tokens / update time, best of ``--repeats``) and
the process's peak resident memory after each side (RSS is a running maximum, so
the second figure includes the first; ours runs first).

    OMP_NUM_THREADS=2 python benchmarks/learner_bench.py --batch 8 --prompt 64 --completion 32
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

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
    from rlver_lib.trainer import PolicyWithValueHead

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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
