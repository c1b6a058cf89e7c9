"""``benchmarks/gpu_check.py --device cpu``: the one-shot check of the vLLM path, run through
vLLM's CPU build at its smallest sizes, prints and writes its figures.

Runtime: two child processes (a 2 x 4-token throughput batch with the hand-over check,
one GRPO step of 2 x 2 dialogues), each starting its own engine; about 2-3 min of CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_support import VLLM_TEST_TIMEOUT_S, child_processes, require_vllm

require_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)]

ROOT = Path(__file__).resolve().parents[1]


def standalone_env() -> dict[str, str]:
    """This process's environment without the torch.distributed rendezvous variables an
    earlier in-process vLLM engine left here (its process group holds that port): the
    benchmark runs as from a shell and picks a free port of its own."""
    dist = {"MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
    return {k: v for k, v in os.environ.items() if k not in dist}


def test_gpu_check_on_cpu_prints_its_figures(tmp_path):
    before = child_processes()
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--device", "cpu", "--batch", "2", "--max-new-tokens", "4", "--steps", "1"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env=standalone_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads((out / "figures.json").read_text(encoding="utf-8"))
    assert figures["environment"]["vllm_device"] == "cpu" and figures["environment"]["vllm"]
    tp = figures["throughput"]
    for key in ("transformers", "vllm_base", "vllm_lora"):
        assert 2 <= tp[key]["completion_tokens"] <= 2 * 4, tp[key]  # batch 2, at most 4 new tokens
        assert tp[key]["tokens_per_s"] == pytest.approx(tp[key]["completion_tokens"] / tp[key]["seconds"])
    handover = tp["handover"]
    assert handover["adapter"] == "policy-step000000"
    # bfloat16 engine with the perturbed adapter vs the bfloat16 peft model, teacher-forced on
    # vLLM's greedy tokens: nearly every one the model's own top-1 and a gap of bf16 rounding
    # size (docs/GPU.md), against the same model with its adapter off in the same run (what
    # a stale hand-over serves), whose gap is several times larger. A free greedy race is
    # not asserted: one bf16 near-tie early in a reply makes every later token differ.
    assert handover["top1_agreement"] >= 0.9
    assert handover["logprob_abs_diff_mean"] < 0.1 and handover["logprob_abs_diff_max"] < 0.6
    assert handover["logprob_abs_diff_mean"] < handover["stale_logprob_abs_diff_mean"] / 3
    assert 0.0 <= handover["greedy_prefix_agreement"] <= 1.0
    train = figures["train"]
    assert train["steps"] == 1 and train["vllm_adapter"] == "policy-step000001"
    row = train["metrics"][0]
    # 2 scenarios x 2 rollouts, one optimizer step (a global mini-batch of 4 dialogues);
    # the hashed rule reward gives the groups signal, so the update ran
    assert (row["dialogues"], row["optimizer_steps"]) == (4, 1)
    assert row["samples"] > 0 and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    # vLLM's sampling log-probs against the learner's, bf16 both: small, and recorded
    assert 0.0 < row["logprob_gap_mean"] < 0.1 and row["logprob_gap_max"] < 1.0
    for text in (proc.stdout, (out / "table.txt").read_text(encoding="utf-8")):
        assert "rollout tokens/s, vllm_lora" in text and "hand-over logprob_abs_diff_max" in text
        assert "training-inference gap" in text and "vLLM engine start-up s" in text
    assert child_processes() <= before
