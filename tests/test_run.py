"""``rlver run`` (rlver_lib.pipeline.run) with stand-in notebooks (tests/pipeline_support.py):
the manifest it keeps, resume, failure, stage order, a changed config, a non-main rank."""

import json

import nbformat
import pytest
from pipeline_support import run_config, stand_in

from rlver_lib.config import ConfigError
from rlver_lib.files import atomic_write_json
from rlver_lib.params import build_config, dump_config
from rlver_lib.pipeline.manifest import read_manifest
from rlver_lib.pipeline.run import (
    FOLLOW_POLL_S,
    PipelineError,
    pipeline_stages,
    prepare_run_dir,
    run_pipeline,
    stage_complete,
)


def test_pipeline_writes_manifest_report_and_resumes(tmp_path, notebooks):
    cfg = run_config(tmp_path)
    report = run_pipeline(cfg, progress=False)
    run = cfg.run_dir.resolve()
    manifest = read_manifest(run)
    assert manifest["status"] == "complete" and manifest["seed"] == 0
    assert list(manifest["stages"]) == ["scenarios", "baseline", "analysis"]
    for record in manifest["stages"].values():
        assert record["status"] == "complete"
        assert record["wall_s"] > 0 and record["peak_rss_mb"] > 10
    assert manifest["versions"]["papermill"] and "commit" in manifest["git"]
    assert (run / "config.yaml").read_text() == dump_config(cfg)
    assert sorted(p.name for p in (run / "notebooks").iterdir()) == [
        "01_scenarios.ipynb", "04_evaluation_baseline.ipynb", "06_analysis.ipynb"]

    html = report.read_text()
    assert html.count('src="data:image/png;base64,') == 1  # the analysis figure, embedded
    assert "SECRET_SOURCE_MARKER" not in html  # code hidden
    assert "Models that ran" in html and "cannot" in html

    before = {k: v["started"] for k, v in manifest["stages"].items()}
    run_pipeline(cfg, progress=False)
    again = read_manifest(run)
    assert {k: v["started"] for k, v in again["stages"].items()} == before  # nothing re-ran
    assert all("skipped_at" in v for v in again["stages"].values())
    assert len(again["runs"]) == 2


def test_progress_bar_counts_the_stages_a_resume_skips(tmp_path, monkeypatch, capsys):
    import rlver_lib.pipeline.run as run_module

    cfg = run_config(tmp_path)
    run, manifest = prepare_run_dir(cfg)
    for name, marker in (("scenarios", "scenarios/test.jsonl"), ("baseline", "eval/baseline/summary.json")):
        manifest["stages"][name] = {"status": "complete"}  # finished by an earlier invocation
        (run / marker).parent.mkdir(parents=True, exist_ok=True)
        (run / marker).write_text("{}")
    atomic_write_json(run / "manifest.json", manifest)
    bars, seen, real_tqdm = [], [], run_module.tqdm

    def recording_tqdm(*args, **kwargs):
        bars.append(real_tqdm(*args, **kwargs))
        return bars[-1]

    monkeypatch.setattr(run_module, "tqdm", recording_tqdm)

    def stage_runs(cfg, run_dir, stage, manifest, manifest_path):
        seen.append((stage.name, bars[0].n, bars[0].total))
        manifest["stages"][stage.name] = {"status": "complete"}

    monkeypatch.setattr(run_module, "_run_stage", stage_runs)
    run_pipeline(cfg, progress=True)
    assert seen == [("analysis", 2, 3)]  # the two skipped stages already counted while analysis runs
    assert bars[0].n == 3
    assert f"resuming {run}: skipping the finished stage(s) scenarios, baseline\n" in capsys.readouterr().err


def test_failing_stage_stops_keeps_partial_output_and_resumes(tmp_path, notebooks, monkeypatch):
    cfg = run_config(tmp_path)
    monkeypatch.setenv("FAIL_STAGE", "baseline")
    with pytest.raises(PipelineError, match="boom in baseline") as info:
        run_pipeline(cfg, progress=False)
    assert "stage 'baseline' failed" in str(info.value)
    run = cfg.run_dir.resolve()
    manifest = read_manifest(run)
    assert manifest["status"] == "failed"
    assert manifest["stages"]["scenarios"]["status"] == "complete"
    assert manifest["stages"]["baseline"]["status"] == "failed"
    assert "boom in baseline" in manifest["stages"]["baseline"]["error"]
    assert "analysis" not in manifest["stages"]
    assert (run / "notebooks" / "04_evaluation_baseline.ipynb").exists()  # partial notebook kept
    assert not (run / "report.html").exists()

    scenarios_started = manifest["stages"]["scenarios"]["started"]
    monkeypatch.delenv("FAIL_STAGE")
    run_pipeline(cfg, progress=False)
    manifest = read_manifest(run)
    assert manifest["status"] == "complete"
    assert manifest["stages"]["scenarios"]["started"] == scenarios_started  # not re-run


def test_stage_without_its_output_is_not_complete(tmp_path):
    cfg = run_config(tmp_path)
    run = cfg.run_dir
    stage = pipeline_stages(cfg, run)[0]
    manifest = {"stages": {"scenarios": {"status": "complete"}}}
    assert not stage_complete(run, manifest, stage)  # marker file missing
    (run / "scenarios").mkdir(parents=True)
    (run / "scenarios" / "test.jsonl").write_text("{}\n")
    assert stage_complete(run, manifest, stage)


def test_an_older_runs_evaluate_stage_counts_as_its_trained_stage(tmp_path):
    cfg = run_config(tmp_path, stages=["trained"])
    run = cfg.run_dir
    (trained,) = pipeline_stages(cfg, run)
    (run / "eval" / "trained").mkdir(parents=True)
    (run / "eval" / "trained" / "summary.json").write_text("{}")
    (run / "manifest.json").write_text(json.dumps({"stages": {"evaluate": {"status": "complete", "wall_s": 9.0}}}))
    manifest = read_manifest(run)
    assert manifest["stages"] == {"trained": {"status": "complete", "wall_s": 9.0}}
    assert stage_complete(run, manifest, trained)  # resuming it does not run the benchmark again


def test_pipeline_stage_order_and_adapters(tmp_path):
    cfg = build_config({"stages": ["trained", "train", "scenarios", "baseline", "analysis"]})
    run = tmp_path / "run"
    stages = pipeline_stages(cfg, run)
    assert [s.name for s in stages] == ["scenarios", "baseline", "train", "trained", "analysis"]
    by_name = {s.name: s for s in stages}
    assert by_name["baseline"].params == {"label": "baseline"}  # policy.adapter as configured
    assert by_name["trained"].params == {"label": "trained",
                                         "overrides": {"policy.adapter": str(run / "train" / "adapter")}}
    no_train = build_config({"stages": ["trained"], "policy": {"adapter": "some/adapter"}})
    (trained,) = pipeline_stages(no_train, run)
    assert trained.params["overrides"] == {"policy.adapter": "some/adapter"}


def test_changed_config_in_existing_run_folder_is_refused(tmp_path):
    prepare_run_dir(run_config(tmp_path))
    with pytest.raises(ConfigError, match=r"training\.steps"):
        prepare_run_dir(run_config(tmp_path, **{"training.steps": 3}))


def test_non_main_rank_waits_for_rank_0_then_runs_only_training(tmp_path, notebooks, monkeypatch):
    """Rank 1 of a launch: no scenarios, benchmarks or analysis (rank 0 runs them once), and
    training only once rank 0's manifest says it started training. tests/test_multiprocess.py
    runs the same with two real processes."""
    body = "import os\nfrom pathlib import Path\n(Path(run_dir) / f'train_rank{os.environ[\"RANK\"]}').write_text('1')"
    nbformat.write(stand_in(body, "params_file = None\nrun_dir = None\noverrides = {}\n"),
                   notebooks / "03_training.ipynb")
    monkeypatch.setenv("RANK", "1")
    cfg = run_config(tmp_path, stages=["scenarios", "baseline", "analysis"])  # nothing for rank 1
    assert run_pipeline(cfg, progress=False) == cfg.run_dir.resolve() / "report.html"
    assert not cfg.run_dir.exists()

    cfg = run_config(tmp_path, stages=["scenarios", "baseline", "train", "trained", "analysis"])
    run = cfg.run_dir.resolve()
    polls = []

    def rank_0_progresses(seconds):  # rank 0's manifest: baseline running, then training started
        polls.append(seconds)
        status = {1: {"baseline": "running"}, 2: {"baseline": "complete", "train": "running"}}[len(polls)]
        atomic_write_json(run / "manifest.json", {"stages": {k: {"status": v} for k, v in status.items()}})

    monkeypatch.setattr("rlver_lib.pipeline.run._follower_sleep", rank_0_progresses)
    run_pipeline(cfg, progress=False)
    assert polls == [FOLLOW_POLL_S] * 2
    assert sorted(p.name for p in (run / "notebooks" / "rank1").iterdir()) == ["03_training.ipynb", "config.yaml"]
    assert (run / "train_rank1").exists() and not (run / "eval").exists() and not (run / "scenarios").exists()
    assert read_manifest(run)["stages"]["train"] == {"status": "running"}  # rank 0's, untouched
