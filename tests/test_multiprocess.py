"""Two real processes: ``ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2`` (accelerate's
MULTI_CPU over gloo) training PPO and GRPO on the embedded policy with the rule simulator,
with fewer scenarios per step than processes (one process has nothing to roll out) and
with one each. Every launch runs under a timeout, so a hang fails the test.

Each step-1 metric that depends on the update (losses, gradient norm, explained
variance) must equal a one-process run of the same dialogues: the losses are normalised
by the token count of the whole optimizer step over both processes, advantages are
whitened over both, and the process without samples takes part with zero-weight work.
Plain ``torchrun`` (every process would train alone) is refused. Measured on a loaded
2-core machine: about 1-3 min per algorithm.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlver_lib.io import iter_jsonl

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "mp_train.py"
LAUNCH_TIMEOUT_S = 900
COMPARED = ("dialogues", "samples", "reward_mean", "policy_loss", "grad_norm", "entropy", "approx_kl_old",
            "value_loss", "explained_variance")


def _config(tmp_path: Path, name: str, algorithm: str, scenarios_per_step: int, steps: int, accumulation: int) -> dict:
    return {
        "run_name": name, "output_root": str(tmp_path), "seed": 7, "stages": ["train"],
        "policy": {"dtype": "float32", "max_new_tokens": 3, "lora": {"r": 2, "alpha": 4}},
        "simulator": {"backend": "rule", "initial_emotion": 50},
        "rollout": {"max_turns": 1},
        "training": {"algorithm": algorithm, "steps": steps, "scenarios_per_step": scenarios_per_step,
                     "group_size": 2, "mini_batch_size": 2, "grad_accum_steps": accumulation,
                     "learning_rate": 1e-3, "value_learning_rate": 1e-3, "checkpoint_every": 1,
                     "keep_checkpoints": 1},
    }


def _launch(tmp_path: Path, runs: list[dict], *, cpu: bool = True) -> tuple[subprocess.CompletedProcess, float]:
    """torchrun with 2 processes over ``runs``; the whole process group is killed on timeout."""
    spec = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*.json')))}.json"
    spec.write_text(json.dumps(runs), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(DRIVER), str(spec)]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"two-process run did not finish within {LAUNCH_TIMEOUT_S} s (hang?):\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, ""), time.perf_counter() - start


def _rows(run_dir: Path) -> list[dict]:
    return [row for _, row in iter_jsonl(run_dir / "train" / "metrics.jsonl")]


def _same(a: float, b: float, rel: float) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == pytest.approx(b, rel=rel, abs=1e-5)  # GRPO losses at ratio 1 are ~0: float noise


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_processes_train_like_one(tmp_path, algorithm):
    from mp_train import train

    runs = [{"config": _config(tmp_path, f"{algorithm}-1", algorithm, 1, 2, 1), "scenarios": 3},
            {"config": _config(tmp_path, f"{algorithm}-2", algorithm, 2, 1, 1), "scenarios": 3}]
    done, wall = _launch(tmp_path, runs)
    print(f"{algorithm}: two-process launch (scenarios_per_step 1 then 2) took {wall:.0f} s")
    assert done.returncode == 0, done.stdout[-4000:]

    for run, per_step in zip(runs, (1, 2)):
        run_dir = tmp_path / run["config"]["run_name"]
        ranks = [json.loads((run_dir / "train" / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [(r["process_index"], r["num_processes"]) for r in ranks] == [(0, 2), (1, 2)]
        assert all(r["distributed_type"].endswith("MULTI_CPU") for r in ranks)
        assert ranks[0]["lora_checksum"] == ranks[1]["lora_checksum"]  # replicas stayed identical
        rows = _rows(run_dir)
        assert [r["step"] for r in rows] == ranks[0]["steps"] and all(r["num_processes"] == 2 for r in rows)
        assert all(r["dialogues"] == 2 * per_step for r in rows)  # both processes' dialogues counted
        dialogues = [d for _, d in iter_jsonl(run_dir / "train" / "dialogues" / "step_000001.jsonl")]
        assert len(dialogues) == 2 * per_step
        checkpoint = sorted((run_dir / "train" / "checkpoints").iterdir())[-1]
        assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= {p.name for p in checkpoint.iterdir()}

        # the same dialogues on one process, one optimizer step over all of them
        reference = dict(run["config"], run_name=run["config"]["run_name"] + "-one")
        reference["training"] = dict(reference["training"], steps=1, grad_accum_steps=per_step)
        (one,) = train(reference, 3)
        two = rows[0]
        mismatched = {k: (two[k], one[k]) for k in COMPARED if not _same(two[k], one[k], rel=2e-3)}
        assert not mismatched, mismatched


@pytest.mark.slow
def test_plain_torchrun_where_every_process_would_train_alone_is_refused(tmp_path):
    done, wall = _launch(tmp_path, [{"config": _config(tmp_path, "alone", "grpo", 1, 1, 1), "scenarios": 2}],
                         cpu=False)
    assert done.returncode != 0
    assert "WORLD_SIZE=2 in the environment, but accelerate runs this process alone" in done.stdout
    assert "ACCELERATE_USE_CPU=true torchrun" in done.stdout
    assert not (tmp_path / "alone" / "train" / "metrics.jsonl").exists()
