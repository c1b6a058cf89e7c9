"""B2: two processes with vLLM-on-CPU rollouts whose dialogues end at different turns.

Each rank builds its own in-process engine (``distributed_executor_backend=
"external_launcher"``, tensor-parallel size 1) in the launch's process group. Rank 1's
simulated user fails every dialogue at turn 1 (``error_on_rank``, tests/mp_train.py), so
rank 1 stops calling ``generate`` after one turn while rank 0's dialogues run up to 3.
That is safe only if the engine runs no collective across ranks per ``generate`` call;
TRL instead calls ``generate`` on every rank in lockstep. The launch must finish (no
hang within the timeout) with rank 0's dialogues past turn 1 (docs/GPU.md section 2,
"Ranks that stop generating early").
"""

from __future__ import annotations

import json

import pytest
from test_multiprocess import _config, _launch
from vllm_support import KV_CACHE_GB, VLLM_TEST_TIMEOUT_S, require_vllm

from rlver_lib.files import iter_jsonl

require_vllm()

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)]


def test_a_rank_whose_dialogues_end_early_stops_generating_without_a_hang(tmp_path):
    config = _config(tmp_path, "uneven", "grpo", 2, group_size=2, mini_batch_size=4, max_new_tokens=4)
    config["policy"].update(backend="vllm", vllm_device="cpu", vllm_kv_cache_gb=KV_CACHE_GB,
                            max_context_tokens=384)
    config["rollout"] = {"max_turns": 3}
    config["simulator"]["initial_emotion"] = 50
    done, wall = _launch(tmp_path, [{"config": config, "scenarios": 2, "one_by_one": False, "error_on_rank": 1}])
    print(f"2 ranks, vLLM on CPU, uneven dialogues: {wall:.0f} s")
    assert done.returncode == 0, done.stdout[-4000:]
    ranks = [json.loads((tmp_path / "uneven" / "train" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["failed_scenarios"] == [] and len(ranks[1]["failed_scenarios"]) == 1
    dialogues = [d for _, d in iter_jsonl(tmp_path / "uneven" / "train" / "dialogues" / "step_000001.jsonl")]
    failed = [d["policy_turns"] for d in dialogues if d["termination"] == "error"]
    ran = [d["policy_turns"] for d in dialogues if d["termination"] != "error"]
    assert failed == [1, 1]  # rank 1: both dialogues of its scenario ended at turn 1
    assert len(ran) == 2 and max(ran) >= 2  # rank 0 went on generating alone
