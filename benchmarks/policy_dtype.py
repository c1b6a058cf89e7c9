"""bfloat16 against float32 for the embedded policy on this CPU: one LoRA forward and
backward, and a short greedy generation, each dtype loaded afresh and the two interleaved
(``--repeats`` rounds), so that both see the same machine load.

    OMP_NUM_THREADS=1 python benchmarks/policy_dtype.py --threads 1 --batch 2 --tokens 120

Prints one line per round and dtype: the seconds of the forward + backward (LoRA r = 4 on
q/v, the mean logit as the loss) and of an 8-token greedy generation from the first 50
tokens, and the CPU's bf16 flags. On a CPU without native bf16 (no ``avx512_bf16``, no
AMX) PyTorch's bf16 matrix products are emulated and far slower (docs/MEASURED.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def _bf16_flags() -> list[str]:
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    return sorted({f for f in flags if f in ("avx512_bf16", "amx_bf16", "avx2", "avx512f")})


def one_round(dtype: str, batch: int, tokens: int) -> tuple[float, float]:
    """Seconds of one LoRA forward + backward and of an 8-token greedy generation."""
    from peft import LoraConfig, get_peft_model

    from rlver_lib.config import PolicyConfig
    from rlver_lib.models import load_policy

    model, _ = load_policy(PolicyConfig(dtype=dtype))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.train()
    ids = torch.randint(0, 1000, (batch, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model(ids).logits.float().mean().backward()
    train_s = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids[:, :50], max_new_tokens=8, do_sample=False)
        generate_s = time.perf_counter() - start
    return train_s, generate_s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU flags: {' '.join(_bf16_flags())}; torch {torch.__version__}, {args.threads} thread(s)")
    for r in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            train_s, generate_s = one_round(dtype, args.batch, args.tokens)
            print(f"round {r + 1} {dtype:>8}: forward+backward {train_s:6.2f} s, generate {generate_s:5.2f} s",
                  flush=True)


if __name__ == "__main__":
    main()
