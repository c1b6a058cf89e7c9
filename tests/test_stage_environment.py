"""The environment each stage's kernel gets under a multi-process launch.

Under ``torchrun`` / ``accelerate launch`` only training is distributed: every other
stage (scenarios, baseline, trained, analysis) and ``rlver eval`` run on rank 0 alone,
so they must run without the launcher's variables. With them, ``accelerate.PartialState()``
(the vLLM policy backend, lm-eval's ``Accelerator()``) opens the launch's process group
and waits for ranks that never join (docs/GPU.md "Multi-process runs"). The variable
names below are the ones torchrun's elastic agent and accelerate's launcher set, written
out here independently of ``rlver_lib.pipeline.run``'s own lists.
"""

from __future__ import annotations

import os

import pytest
import yaml

import rlver_lib.cli as cli
import rlver_lib.pipeline.run as run_module
from rlver_lib.files import RunFolder
from rlver_lib.params import build_config
from rlver_lib.pipeline.run import pipeline_stages, run_pipeline

LAUNCH = {  # what `accelerate launch --num_processes 2 --cpu` (torchrun underneath) sets on rank 0
    "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_MIXED_PRECISION": "no",
}
KEPT = {"ACCELERATE_USE_CPU": "true", "HF_HOME": "/tmp/hf-cache-of-the-user"}  # not a process group's


@pytest.fixture
def launched(monkeypatch):
    for var, value in {**LAUNCH, **KEPT}.items():
        monkeypatch.setenv(var, value)


def _cfg(tmp_path):
    return build_config({"run_name": "r", "output_root": str(tmp_path), "simulator": {"backend": "rule"},
                         "stages": ["scenarios", "baseline", "train", "trained", "analysis"]})


def _recording_kernels(monkeypatch, cfg):
    """Replace papermill with a recorder of the environment each stage's kernel would
    inherit (papermill starts the kernel with ``os.environ``); it writes the stage's marker."""
    seen: dict[str, dict[str, str]] = {}
    stages = {s.output: s for s in pipeline_stages(cfg, cfg.run_dir.resolve())}

    def execute(notebook, output, parameters):
        stage = stages[output.name]
        seen[stage.name] = dict(os.environ)
        if stage.marker:
            marker = cfg.run_dir.resolve() / stage.marker
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("{}")

    monkeypatch.setattr(run_module, "execute_notebook", execute)
    monkeypatch.setattr(run_module, "render_report", lambda notebooks, path, header: path)
    return seen


def test_rank_0_runs_only_training_inside_the_launch(tmp_path, monkeypatch, launched):
    cfg = _cfg(tmp_path)
    seen = _recording_kernels(monkeypatch, cfg)
    before = dict(os.environ)
    run_pipeline(cfg, progress=False)
    assert list(seen) == ["scenarios", "baseline", "train", "trained", "analysis"]
    for name, env in seen.items():
        assert {k: env[k] for k in KEPT} == KEPT, name
        assert str(run_module.PROJECT_ROOT) in env["PYTHONPATH"].split(os.pathsep), name
        if name == "train":  # the distributed stage: every launcher variable as the launcher set it
            assert {k: env.get(k) for k in LAUNCH} == LAUNCH
        else:
            assert [k for k in env if k in LAUNCH or k.startswith(("TORCHELASTIC_", "MASTER_"))] == [], name
    assert dict(os.environ) == before  # the launcher's variables are back for whatever follows
    manifest = RunFolder(cfg.run_dir.resolve()).manifest.read_text()
    assert '"num_processes": 2' in manifest  # the launch is still recorded as one of 2 processes


def test_a_following_rank_trains_inside_the_launch(tmp_path, monkeypatch, launched):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = _cfg(tmp_path)
    seen = _recording_kernels(monkeypatch, cfg)
    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True)
    RunFolder(run_dir).manifest.write_text('{"stages": {"train": {"status": "running"}}}')
    run_pipeline(cfg, progress=False)
    assert list(seen) == ["train"]
    assert {k: seen["train"].get(k) for k in LAUNCH} == {**LAUNCH, "RANK": "1", "LOCAL_RANK": "1"}


def test_only_the_train_stage_is_distributed(tmp_path):
    assert {s.name: s.distributed for s in pipeline_stages(_cfg(tmp_path), tmp_path)} == {
        "scenarios": False, "baseline": False, "train": True, "trained": False, "analysis": False}


def test_rlver_eval_on_rank_0_of_a_launch_runs_as_one_process(tmp_path, monkeypatch, launched):
    params = tmp_path / "p.yaml"
    params.write_text(yaml.safe_dump({"run_name": "r", "output_root": str(tmp_path),
                                      "simulator": {"backend": "rule"}}))
    seen = []
    monkeypatch.setattr(cli, "configure_threads", lambda threads: None)  # it would set os.environ for good
    monkeypatch.setattr("rlver_lib.evaluation.stage.eval_command", lambda cfg: seen.append(dict(os.environ)) or 0)
    assert cli.main(["eval", str(params)]) == 0
    assert [k for k in seen[0] if k in LAUNCH or k.startswith("TORCHELASTIC_")] == []
    assert {k: seen[0][k] for k in KEPT} == KEPT
    assert os.environ["RANK"] == "0" and os.environ["MASTER_PORT"] == "29511"  # restored


def test_a_following_rank_that_never_sees_the_manifest_stops_with_a_clear_error(tmp_path, monkeypatch):
    """Rank 1 on a node that does not share the run folder: rank 0's manifest never appears."""
    cfg = _cfg(tmp_path)
    polls = []
    monkeypatch.setattr(run_module, "_follower_sleep", polls.append)
    with pytest.raises(run_module.FollowerTimeout, match="did not appear within 0 s.*shares"):
        run_module._follow_pipeline(cfg, 1, poll_s=0.01, manifest_deadline_s=0.0)
    assert len(polls) <= 1  # it gives up at the deadline, not after polling on

    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True)  # once the manifest is there the wait has no deadline
    RunFolder(run_dir).manifest.write_text('{"stages": {"baseline": {"status": "running"}}}')

    def rank_0_starts_training(seconds):
        polls.append(seconds)
        RunFolder(run_dir).manifest.write_text('{"stages": {"train": {"status": "complete"}}}')
        (run_dir / "train" / "adapter").mkdir(parents=True)
        (run_dir / "train" / "adapter" / "adapter_config.json").write_text("{}")

    monkeypatch.setattr(run_module, "_follower_sleep", rank_0_starts_training)
    assert run_module._follow_pipeline(cfg, 1, poll_s=0.01, manifest_deadline_s=0.0) == RunFolder(run_dir).report


def test_the_runs_threads_are_shared_among_the_processes_of_the_launch(tmp_path, monkeypatch, launched):
    """``threads: 2`` is the cores of the whole run: under a launch of 2 processes on the
    machine each training kernel gets 1 (2 each put 4 spin-waiting threads on 2 cores; a
    one-step tiny GRPO run took 23.4 s a step that way against 2.7 s), while rank 0's
    stages outside the launch run alone and get both."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cfg = _cfg(tmp_path).model_copy(update={"threads": 2})
    seen = _recording_kernels(monkeypatch, cfg)
    run_pipeline(cfg, progress=False)
    threads = {name: (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]) for name, env in seen.items()}
    assert threads == {"scenarios": ("2", "2"), "baseline": ("2", "2"), "train": ("1", "1"),
                       "trained": ("2", "2"), "analysis": ("2", "2")}


@pytest.mark.parametrize(("threads", "local_world_size", "expected"),
                         [(2, None, "2"), (2, "2", "1"), (3, "2", "1"), (8, "4", "2"), (16, "8", "2"), (1, "8", "1")])
def test_the_cli_gives_each_local_process_its_share_of_the_threads(monkeypatch, threads, local_world_size, expected):
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setenv("OMP_NUM_THREADS", "99")
    monkeypatch.setenv("MKL_NUM_THREADS", "99")
    cli.configure_threads(threads)
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == expected
