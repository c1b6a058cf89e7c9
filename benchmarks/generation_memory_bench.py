"""Peak memory of policy generation with sampled-token log-probs (TransformersBackend).

Two ways to get the log-prob of each sampled token, each run in a fresh child
process on the same batch (embedded SmolLM2 policy by default):

- ``output_logits``: ``generate(output_logits=True)`` keeps the ``[B, V]`` logits of
  every decoding step, then a full-vocabulary ``log_softmax`` per step on the CPU
  (how the backend worked before; about ``B x steps x V x 4`` bytes held at once);
- ``backend``: ``TransformersBackend.generate`` as it is now.

Prints, per variant, the peak resident memory of the child above its level after
loading the model (MiB), the wall time, and the size of the retained logits that
``output_logits`` implies. Every row runs until ``--new-tokens`` (end-of-turn ids are
disabled), so both variants decode the same number of steps.

    OMP_NUM_THREADS=2 python benchmarks/generation_memory_bench.py --batch 16 --new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(variant: str, args: argparse.Namespace) -> dict:
    import torch

    from rlver_lib.backends import TransformersBackend
    from rlver_lib.config import PolicyConfig, SamplingParams
    from rlver_lib.models import load_policy

    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(PolicyConfig(model=args.model, dtype=args.dtype))
    backend = TransformersBackend(model, tokenizer)
    backend.eos_ids = (int(model.config.vocab_size) - 1,)  # decode every row to the budget
    conversations = [[{"role": "user", "content": f"Tell me about day {i} of your week."}]
                     for i in range(args.batch)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    base = _rss_mb()
    start = time.perf_counter()
    if variant == "backend":
        generations = backend.generate(conversations, sampling)
        steps = max(len(g.completion_ids) for g in generations)
    else:
        prompts = [backend.prompt_ids(c) for c in conversations]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), backend.pad_id)
        attention = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            attention[row, width - len(p):] = 1
        with torch.inference_mode(), torch.random.fork_rng():
            torch.manual_seed(0)
            out = model.generate(input_ids=ids, attention_mask=attention, do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=args.new_tokens,
                                 pad_token_id=backend.pad_id, eos_token_id=list(backend.eos_ids),
                                 return_dict_in_generate=True, output_logits=True)
        new = out.sequences[:, width:]
        logprobs = torch.stack([torch.log_softmax(step.float().cpu(), -1).gather(-1, new[:, k:k + 1]).squeeze(-1)
                                for k, step in enumerate(out.logits)], 1)
        steps = logprobs.shape[1]
    return {"variant": variant, "peak_above_load_mb": _rss_mb() - base, "seconds": time.perf_counter() - start,
            "steps": steps, "vocab": int(model.config.vocab_size),
            "bytes_per_logit": torch.finfo(next(model.parameters()).dtype).bits // 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=["backend", "output_logits"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(_child(args.variant, args)))
        return
    rows = []
    for variant in ("output_logits", "backend"):
        command = [sys.executable, __file__, "--variant", variant, "--model", args.model, "--dtype", args.dtype,
                   "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    retained = args.batch * rows[0]["steps"] * rows[0]["vocab"] * rows[0]["bytes_per_logit"] / 2**20
    print(f"generation of {args.batch} x {rows[0]['steps']} tokens, vocab {rows[0]['vocab']}, {args.dtype}; "
          f"output_logits retains {retained:.0f} MiB of logits")
    print(f"{'variant':<16}{'peak above load MiB':>22}{'seconds':>10}")
    for row in rows:
        print(f"{row['variant']:<16}{row['peak_above_load_mb']:>22.0f}{row['seconds']:>10.1f}")


if __name__ == "__main__":
    main()
