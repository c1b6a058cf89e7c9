"""``benchmarks/gpu_check.py`` without a GPU: it fails fast without CUDA and completes its
``--dry-run`` (two child processes: a 2 x 4-token batch and one tiny GRPO step; about 145 s
on 2 shared CPU cores). The vLLM CPU run is tests/test_vllm_gpu_check.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------- benchmarks/gpu_check.py


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_fails_fast_without_cuda(tmp_path, capsys):
    assert _gpu_check().main(["--out", str(tmp_path / "out")]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_figures(tmp_path):
    out = tmp_path / "out"
    assert _gpu_check().main(["--out", str(out), "--dry-run"]) == 0
    figures = json.loads((out / "figures.json").read_text(encoding="utf-8"))
    assert figures["environment"]["dry_run"] is True
    tf = figures["throughput"]["transformers"]
    assert 2 <= tf["completion_tokens"] <= 2 * 4  # batch 2, at most 4 new tokens each
    assert tf["tokens_per_s"] == pytest.approx(tf["completion_tokens"] / tf["seconds"])
    assert figures["throughput"]["vllm"] == "skipped (dry run)"
    train = figures["train"]
    assert train["steps"] == 1
    row = train["metrics"][0]
    # 1 scenario x a group of 4, mini-batches of 2 dialogues: 2 optimizer steps of 2 samples
    # (one turn each); the hashed rule reward gives the group signal, so the update ran
    assert (row["step"], row["dialogues"], row["samples"]) == (1, 4, 4)
    assert (row["optimizer_steps"], row["samples_per_update"], row["dialogues_per_update"]) == (2, 2.0, 2.0)
    assert row["zero_variance_group_share"] == 0.0
    assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    # float32 transformers rollouts: the learner's old log-probs are the sampling ones, the
    # first optimizer step runs at ratio 1 (a wrong temperature, context or chunking shows here)
    assert row["logprob_gap_max"] < 1e-4 and abs(row["is_weight_mean"] - 1.0) < 1e-4
    records = [json.loads(line) for line in (out / "runs" / "grpo" / "train" / "dialogues"
                                              / "step_000001.jsonl").read_text(encoding="utf-8").splitlines()]
    assert row["reward_mean"] == pytest.approx(sum(r["final_emotion"] for r in records) / 100 / len(records))
    assert len({r["reward"] for r in records}) > 1
    text = (out / "table.txt").read_text(encoding="utf-8")
    assert "rollout tokens/s, transformers" in text and "GRPO step 1" in text
