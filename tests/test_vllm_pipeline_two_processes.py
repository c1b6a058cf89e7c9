"""The real tiny pipeline on two processes with the vLLM-on-CPU policy backend
(``policy.backend: vllm``), launched as ``ACCELERATE_USE_CPU=true torchrun --standalone
--nproc_per_node 2 -m rlver_lib.cli run tests/params_tiny.yaml`` (see
tests/test_pipeline_two_processes.py for the launch and the checks).

Rank 0's baseline and trained benchmarks build a vLLM engine, whose set-up calls
``accelerate.PartialState()``. Under the launch's variables that opened the launch's
process group and waited for rank 1, which was itself waiting for training: the
baseline hung (issue B1). Now only training runs inside the launch
(``pipeline.run.kernel_environment``); there both ranks build their engine with
``distributed_executor_backend="external_launcher"`` in the launch's group.

On the code before that fix (commit 4f4d9b9) this launch hangs: run against a
``git worktree`` of that commit (this file and its helpers copied in, the same
``.venv-vllm``), it had not finished after 600 s, and ``py-spy dump`` of rank 0's
baseline kernel showed it blocked in ``init_process_group`` under
``PartialState.__init__`` <- ``vllm_backend._colocate_distributed_env`` <-
``evaluation.stage.evaluate``. With the fix the same launch completes (280 s on a
loaded 2-core machine).
"""

from __future__ import annotations

import pytest
from test_pipeline_two_processes import TRIM, check_complete_two_process_run, launch_pipeline
from vllm_support import KV_CACHE_GB, VLLM_TEST_TIMEOUT_S, require_vllm

require_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)]
VLLM = ["policy.backend=vllm", "policy.vllm_device=cpu", f"policy.vllm_kv_cache_gb={KV_CACHE_GB}",
        "policy.dtype=float32", "policy.max_context_tokens=384"]


def test_the_tiny_pipeline_with_vllm_runs_end_to_end_on_two_processes(tmp_path):
    run_dir, output, wall_s = launch_pipeline(tmp_path, [*TRIM, *VLLM], timeout_s=VLLM_TEST_TIMEOUT_S - 60)
    check_complete_two_process_run(run_dir)
    print(f"2-process tiny pipeline with vLLM: {wall_s:.0f} s")
