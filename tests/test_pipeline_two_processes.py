"""The real pipeline on two processes, launched as a user launches it (docs/GPU.md section 4):
``ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node 2 -m rlver_lib.cli run
tests/params_tiny.yaml`` (embedded SmolLM2 policy, rule simulator) executes the real
notebooks 01 -> 04 baseline -> 03 on both ranks -> 04 trained -> 06 on rank 0.

Rank 0's stages other than training run as one process, outside the launch: their
kernels get none of the launcher's variables (``pipeline.run.kernel_environment``), so a
``PartialState()`` in them (the vLLM backend, lm-eval) cannot wait for a rank that never
joins. ``tests/test_vllm_pipeline_two_processes.py`` runs the same with vLLM on CPU.
The analysis runs with its judge-heavy parts off (``TRIM``): this test is about the
launch, tests/test_notebooks.py covers the notebooks' content.

On the code before that fix (commit 03c0572) this variant passes too: checked by
running this file against a ``git archive`` of that commit (complete, 333 s on a
loaded 2-core machine). The embedded policy's transformers backend opens no process
group outside training, so nothing here waits for rank 1; the hang of issue B1 needs a
``PartialState()`` in rank 0's benchmark, which the vLLM variant has. What fails on
that code without vLLM is tests/test_stage_environment.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multiprocess import kill_launch

from rlver_lib.files import iter_jsonl

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "params_tiny.yaml"
TWO_RANKS = ["training.scenarios_per_step=2", "training.mini_batch_size=4"]  # 2 whole GRPO groups, 1 per rank
TRIM = ["analysis.n_annotated_replies=0", "analysis.n_consistency_turns=0", "analysis.n_sycophancy_replies=0",
        "analysis.n_probe_scenarios=0", "capability.n_humaneval_problems=0", "capability.n_math_items=0",
        "evaluation.n_boot=20"]
STAGES = ["scenarios", "baseline", "train", "trained", "analysis"]


def launch_pipeline(tmp_path: Path, settings: list[str], *, timeout_s: float) -> tuple[Path, str, float]:
    """``rlver run`` of the tiny recipe under torchrun with 2 CPU processes (gloo); the run
    folder, the launch's output and its wall time. A launch past ``timeout_s`` (a hang) is
    killed with its workers and fails the test."""
    sets = [arg for s in [f"output_root={tmp_path}", *TWO_RANKS, *settings] for arg in ("--set", s)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "rlver_lib.cli", "run", str(TINY), "--no-progress", *sets]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_launch(process)
        output, _ = process.communicate()
        run_dir = tmp_path / "tiny"
        manifest = (run_dir / "manifest.json").read_text() if (run_dir / "manifest.json").exists() else "none"
        pytest.fail(f"the 2-process pipeline did not finish within {timeout_s:.0f} s (hang?); "
                    f"manifest: {manifest}\n{output[-3000:]}")
    assert process.returncode == 0, output[-4000:]
    return tmp_path / "tiny", output, time.perf_counter() - start


def check_complete_two_process_run(run_dir: Path) -> None:
    """Every stage complete, training on both ranks, one global training step."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert {name: manifest["stages"][name]["status"] for name in STAGES} == dict.fromkeys(STAGES, "complete")
    assert manifest["runs"][-1]["num_processes"] == 2
    assert (run_dir / "notebooks" / "rank1" / "03_training.ipynb").exists()
    assert not (run_dir / "notebooks" / "rank1" / "04_evaluation_baseline.ipynb").exists()
    for label in ("baseline", "trained"):
        assert json.loads((run_dir / "eval" / label / "summary.json").read_text())["n"] == 2
    rows = [row for _, row in iter_jsonl(run_dir / "train" / "metrics.jsonl")]
    assert [(r["step"], r["dialogues"]) for r in rows] == [(1, 4)]  # 2 scenarios x 2 over both ranks
    assert (run_dir / "train" / "adapter" / "adapter_config.json").exists()
    assert (run_dir / "report.html").stat().st_size > 0


def test_the_tiny_pipeline_runs_end_to_end_on_two_processes(tmp_path):
    run_dir, output, wall_s = launch_pipeline(tmp_path, TRIM, timeout_s=480)
    check_complete_two_process_run(run_dir)
    print(f"2-process tiny pipeline: {wall_s:.0f} s")
