"""DeepSpeed ZeRO-2 run for real on CPU, and a two-process run killed with SIGKILL and resumed.

Both launch ``tests/mp_train.py`` on 2 real processes (the embedded policy, 2 one-turn
dialogues a step of 3 tokens, LoRA r = 2, a linear LR schedule, a checkpoint every step):

- **DDP references, kill -9 and resume** (``ACCELERATE_USE_CPU=true torchrun``, gloo):
  the first launch trains GRPO for 2 steps, then starts PPO and is killed with SIGKILL
  (torchrun and both workers) while step 2's checkpoint is being written: all of it is
  in ``.step_000002.partial``, ``trainer_state.json`` included, and rank 0 hangs just
  before renaming it into place (the driver's hook), so the kill lands at the same
  point every time; a second launch resumes that run from the complete step-1
  checkpoint (accelerate's ``load_state``: optimizer, LR scheduler, every rank's RNG
  states, the trainable weights), ignoring the partial folder, and then trains the same
  PPO run uninterrupted. Both use the trainer's own rollout backend and seeds (one
  stream per process), not the driver's per-conversation seeds: the resumed run's
  step-2 metrics and final adapter equal the uninterrupted run's only if every rank's
  seeds and RNG states come back.
- **ZeRO-2** (``accelerate launch --config_file params/accelerate/zero2.yaml
  --num_processes 2``; DeepSpeed's CPU accelerator over gloo): in float32
  (``--mixed_precision no``) GRPO (accumulated over 2 micro-batches, DeepSpeed's
  ``gradient_accumulation_steps: 2``, against DDP's 1) and PPO for 2 steps give the DDP runs' metrics
  (relative 1e-4, absolute 1e-5 for the ~0 policy losses at ratio 1) and an adapter
  whose ``lora_B`` weights (which start at 0) move as the DDP run's, all but a few
  (``test_multiprocess._lora_b_moved_apart``), with the schedule's learning rates (the LR scheduler is built on the
  raw AdamW before ``prepare`` and must reach ZeRO's optimizer); as
  ``zero2.yaml`` stands (bf16) the engine casts the LoRA weights and the value head
  to bfloat16 and keeps float32 master weights in ZeRO's partitions, and a run
  interrupted after step 1 and resumed from its ZeRO checkpoint (every rank's
  optimizer partition, ``exclude_frozen_parameters``) ends bit-identical to the
  uninterrupted run. Each launch trains several runs in the same processes with
  different batch settings, as ``rlver ablate`` does (the DeepSpeed config is the
  launch's again for each run).

Durations on a 2-core machine shared with other jobs (test cost, not a performance
figure): 92-146 s for the DDP launches with the kill, 59-98 s and 57-84 s for the
float32 and bf16 ZeRO-2 launches. Measured differences: docs/GPU.md section 4.
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
import torch
from test_multiprocess import (
    DRIVER,
    LAUNCH_TIMEOUT_S,
    REPO,
    TIMEOUT_S,
    _adapter,
    _config,
    _lora_b_gap,
    _lora_b_moved_apart,
    _ranks,
    _rows,
    kill_launch,
    wait_for_launch,
)

ZERO2 = REPO / "params" / "accelerate" / "zero2.yaml"
LEARNING_RATE = 1e-3
# linear decay over 2 steps (to 0 one step after the last): steps 1 and 2 run at 2/3 and 1/3
SCHEDULE = [LEARNING_RATE * 2 / 3, LEARNING_RATE / 3]
COMPARED = ("dialogues", "samples", "reward_mean", "policy_loss", "grad_norm", "entropy", "approx_kl_old",
            "learning_rate", "optimizer_steps", "samples_per_update")
PPO_COMPARED = ("value_loss", "explained_variance", "explained_variance_after")


def _run(tmp_path: Path, name: str, algorithm: str, **extra) -> dict:
    """A 2-step run of 2 one-turn dialogues a step (GRPO: one scenario x 2 on each process)."""
    sizes = {"group_size": 2, "mini_batch_size": 4} if algorithm == "grpo" else {"mini_batch_size": 2}
    config = _config(tmp_path, name, algorithm, 2, steps=2, **sizes)
    config["training"]["lr_schedule"] = "linear"
    config["training"].update(extra.pop("training", {}))
    return {"config": config, "scenarios": 4, "one_by_one": False, **extra}


def _start(tmp_path: Path, runs: list[dict], launcher: list[str], *, cpu: bool) -> subprocess.Popen:
    spec = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*.json')))}.json"
    spec.write_text(json.dumps(runs), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    return subprocess.Popen([sys.executable, "-m", *launcher, str(DRIVER), str(spec)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen) -> str:
    """Wait for the launch; its output. Fails (after killing the whole group) on a hang or an error."""
    output = wait_for_launch(process)
    assert process.returncode == 0, output[-5000:]
    return output


TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _zero2(*extra: str) -> list[str]:
    return ["accelerate.commands.launch", "--config_file", str(ZERO2), "--num_processes", "2",
            "--main_process_port", "0", *extra]


def _mismatched(row: dict, reference: dict, keys, *, rel: float, abs_: float) -> dict:
    return {k: (row[k], reference[k]) for k in keys
            if not (isinstance(row[k], (int, float)) and math.isfinite(row[k]) and math.isfinite(reference[k])
                    and row[k] == pytest.approx(reference[k], rel=rel, abs=abs_))}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The DDP launches: GRPO, PPO killed with SIGKILL while its step-2 checkpoint is
    being written, then (a new launch) that PPO run resumed and the same PPO run
    uninterrupted."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    start = time.perf_counter()
    killed = tmp_path / "ppo-killed"
    process = _start(tmp_path, [_run(tmp_path, "grpo", "grpo"),
                                _run(tmp_path, "ppo-killed", "ppo", hang_in_checkpoint=2)], TORCHRUN, cpu=True)
    hanging = killed / "train" / "hanging_in_checkpoint"
    while not hanging.is_file() and process.poll() is None:
        assert time.perf_counter() - start < LAUNCH_TIMEOUT_S, "the run never reached step 2's checkpoint"
        time.sleep(0.1)
    kill_launch(process)  # kill -9 mid-write: torchrun and both workers
    output, _ = process.communicate()
    assert hanging.is_file() and process.returncode == -signal.SIGKILL, output[-5000:]
    at_kill = {"steps": [r["step"] for r in _rows(killed)],
               "checkpoints": sorted(p.name for p in (killed / "train" / "checkpoints").iterdir()),
               "partial": sorted(p.name for p in Path(hanging.read_text()).iterdir())}
    _finish(_start(tmp_path, [_run(tmp_path, "ppo-killed", "ppo"), _run(tmp_path, "ppo", "ppo")], TORCHRUN,
                   cpu=True))
    print(f"DDP launches with the kill took {time.perf_counter() - start:.0f} s")
    return {"root": tmp_path, "at_kill": at_kill}


@pytest.mark.slow
def test_two_processes_killed_with_sigkill_resume_to_the_uninterrupted_result(ddp):
    root = ddp["root"]
    at_kill = ddp["at_kill"]
    # killed after step 2 trained, mid-way through writing its checkpoint: the partial
    # folder holds everything, its state file included, but only step 1 is in place
    assert at_kill["steps"] == [1, 2]
    assert at_kill["checkpoints"] == [".step_000002.partial", "step_000001"]
    assert {"trainer_state.json", "random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= set(
        at_kill["partial"])
    assert sorted(p.name for p in (root / "ppo-killed" / "train" / "checkpoints").iterdir()) == ["step_000002"]
    resumed, uninterrupted = _ranks(root / "ppo-killed"), _ranks(root / "ppo")
    assert [r["resumed_from"] for r in resumed] == [1, 1] and [r["resumed_from"] for r in uninterrupted] == [0, 0]
    assert all(r["distributed_type"].endswith("MULTI_CPU") and r["num_processes"] == 2 for r in resumed)
    rows, reference = _rows(root / "ppo-killed"), _rows(root / "ppo")
    assert [r["step"] for r in rows] == [1, 2] and [r["learning_rate"] for r in reference] == pytest.approx(SCHEDULE)
    assert reference[1]["samples"] > 0 and reference[1]["grad_norm"] > 0
    for row, ref in zip(rows, reference):
        assert not _mismatched(row, ref, COMPARED + PPO_COMPARED, rel=1e-6, abs_=1e-9), (row, ref)
    adapter, expected = _adapter(root / "ppo-killed"), _adapter(root / "ppo")
    assert adapter.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(adapter[key], expected[key], rtol=1e-6, atol=1e-8)


@pytest.mark.slow
def test_zero2_trains_like_ddp_and_resumes_bit_identically(tmp_path, request):
    start = time.perf_counter()
    _finish(_start(tmp_path, [_run(tmp_path, "grpo", "grpo", training={"grad_accum_steps": 2}),
                               _run(tmp_path, "ppo", "ppo")], _zero2("--mixed_precision", "no"), cpu=False))
    fp32_s = time.perf_counter() - start
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    _finish(_start(bf16, [_run(bf16, "ppo", "ppo"), _run(bf16, "ppo-resumed", "ppo", interrupt_after=1)],
                   _zero2(), cpu=False))
    print(f"ZeRO-2 launches took {fp32_s:.0f} s (float32) and {time.perf_counter() - start - fp32_s:.0f} s (bf16)")
    ddp = request.getfixturevalue("ddp")  # after the ZeRO-2 launches: a broken launch fails first

    # float32 ZeRO-2 against DDP: the same metrics and (nearly) the same adapter
    for name, keys in (("grpo", COMPARED), ("ppo", COMPARED + PPO_COMPARED)):
        ranks = _ranks(tmp_path / name)
        assert all(r["distributed_type"].endswith("DEEPSPEED") and r["num_processes"] == 2 for r in ranks)
        assert all(r["timeout_s"] == TIMEOUT_S for r in ranks)  # distributed.timeout_s reached DeepSpeed's group
        assert {r["optimizer"] for r in ranks} == {"DeepSpeedZeroOptimizer"}
        assert ranks[0]["lora_checksum"] == ranks[1]["lora_checksum"]
        rows, reference = _rows(tmp_path / name), _rows(ddp["root"] / name)
        assert [r["learning_rate"] for r in rows] == pytest.approx(SCHEDULE)
        assert all(r["samples"] > 0 and r["grad_norm"] > 0 for r in rows)
        for row, ref in zip(rows, reference, strict=True):
            mismatched = _mismatched(row, ref, keys, rel=1e-4, abs_=1e-5)
            assert not mismatched, (name, row["step"], mismatched)
        run, reference = _adapter(tmp_path / name), _adapter(ddp["root"] / name)
        apart = _lora_b_moved_apart(run, reference, LEARNING_RATE)
        print(f"{name}: ZeRO-2 adapter vs DDP: {_lora_b_gap(run, reference):.2e} of the trained lora_B weights, "
              f"{apart:.1e} of them off by more than lr / 10")
        # measured: GRPO (ZeRO accumulating 2 micro-batches, DDP 1) 4.5e-3 and 4.3e-5 (AdamW's
        # sign-like steps on gradients of about 0, summed in another order); PPO 9.9e-5 and 0
        assert apart < 2e-3, apart

    # zero2.yaml as it stands: bf16 weights in the engine, float32 masters, exact resume
    for name in ("ppo", "ppo-resumed"):
        ranks = _ranks(bf16 / name)
        assert {d for r in ranks for d in r["trainable_dtypes"].values()} == {"torch.bfloat16"}
        assert any("value_head" in k for k in ranks[0]["trainable_dtypes"])
        assert [r["master_dtypes"] for r in ranks] == [["torch.float32"]] * 2
    assert [r["resumed_from"] for r in _ranks(bf16 / "ppo-resumed")] == [1, 1]
    checkpoint = next((bf16 / "ppo-resumed" / "train" / "checkpoints").iterdir())
    partitions = {p.name for p in (checkpoint / "pytorch_model").iterdir() if p.name.endswith("_optim_states.pt")}
    assert partitions == {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                          "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}  # one per rank
    rows, reference = _rows(bf16 / "ppo-resumed"), _rows(bf16 / "ppo")
    for row, ref in zip(rows, reference, strict=True):
        assert not _mismatched(row, ref, COMPARED + PPO_COMPARED, rel=0, abs_=0), (row, ref)
    adapter, expected = _adapter(bf16 / "ppo-resumed"), _adapter(bf16 / "ppo")
    assert all(torch.equal(adapter[k], expected[k]) for k in expected)
    # bf16 against float32 at step 1 (the same dialogues): the update within bf16's precision
    row, ref = reference[0], _rows(tmp_path / "ppo")[0]
    assert row["reward_mean"] == ref["reward_mean"]
    assert not _mismatched(row, ref, ("grad_norm", "value_loss", "entropy"), rel=3e-2, abs_=1e-3), (row, ref)
