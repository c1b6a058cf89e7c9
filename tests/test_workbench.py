"""Pipeline mechanics with stand-in notebooks: manifest, resume, failure, report, ablation.

The stand-in notebooks take the same papermill parameters as the real ones and write
the files that mark a stage complete, so these tests exercise papermill, the manifest
and nbconvert without loading any model (about 1 min on 2 cores: kernel start-ups).
"""

import json
import subprocess
import sys
import textwrap

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from rlver_lib import workbench
from rlver_lib.config import ConfigError, build_config

STAND_IN = {
    "01_scenarios.ipynb": "(run / 'scenarios').mkdir(parents=True, exist_ok=True)\n"
                          "(run / 'scenarios' / 'test.jsonl').write_text('{}\\n')",
    "04_evaluation.ipynb": "import os\n"
                           "if os.environ.get('FAIL_STAGE') == label: raise RuntimeError('boom in ' + label)\n"
                           "(run / 'eval' / label).mkdir(parents=True, exist_ok=True)\n"
                           "(run / 'eval' / label / 'summary.json').write_text('{}')",
    "06_analysis.ipynb": "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
                         "from IPython.display import display\n"
                         "fig, ax = plt.subplots(); ax.plot([0, 1], [40, 60]); ax.set_title('Stand-in curve')\n"
                         "display(fig)\nplt.close(fig)\nSECRET_SOURCE_MARKER = 1",
    "05_ablations.ipynb": "from pathlib import Path\nprint('compared', len(run_dirs), 'runs')\n"
                          "Path(grid_dir, 'compared.txt').write_text(str(len(run_dirs)))",
}


def _stand_in(body: str, parameters: str) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [new_markdown_cell("## Stand-in section"), params, new_code_cell(body)]
    return nb


@pytest.fixture
def notebooks(tmp_path, monkeypatch):
    folder = tmp_path / "templates"
    folder.mkdir()
    run_params = "params_file = None\nrun_dir = None\noverrides = {}\nlabel = 'baseline'\nadapter = None\n"
    for name, body in STAND_IN.items():
        if name == "05_ablations.ipynb":
            nb = _stand_in(body, "grid_dir = None\nrun_dirs = []\naxes = []\n")
        else:
            nb = _stand_in("from pathlib import Path\nrun = Path(run_dir)\n" + body, run_params)
        nbformat.write(nb, folder / name)
    monkeypatch.setattr(workbench, "NOTEBOOK_DIR", folder)
    return folder


def _cfg(tmp_path, **overrides):
    data = {"run_name": "r", "output_root": str(tmp_path / "out"), "simulator": {"backend": "rule"},
            "stages": ["scenarios", "baseline", "analysis"]}
    return build_config(data, overrides)


def test_pipeline_writes_manifest_report_and_resumes(tmp_path, notebooks):
    cfg = _cfg(tmp_path)
    report = workbench.run_pipeline(cfg, progress=False)
    run = cfg.run_dir.resolve()
    manifest = workbench.read_manifest(run)
    assert manifest["status"] == "complete" and manifest["seed"] == 0
    assert list(manifest["stages"]) == ["scenarios", "baseline", "analysis"]
    for record in manifest["stages"].values():
        assert record["status"] == "complete"
        assert record["wall_s"] > 0 and record["peak_rss_mb"] > 10
    assert manifest["versions"]["papermill"] and "commit" in manifest["git"]
    assert (run / "config.yaml").read_text() == workbench.dump_config(cfg)
    assert sorted(p.name for p in (run / "notebooks").iterdir()) == [
        "01_scenarios.ipynb", "04_evaluation_baseline.ipynb", "06_analysis.ipynb"]

    html = report.read_text()
    assert html.count('src="data:image/png;base64,') == 1  # the analysis figure, embedded
    assert "SECRET_SOURCE_MARKER" not in html  # code hidden
    assert "Models that ran" in html and "cannot" in html

    before = {k: v["started"] for k, v in manifest["stages"].items()}
    workbench.run_pipeline(cfg, progress=False)
    again = workbench.read_manifest(run)
    assert {k: v["started"] for k, v in again["stages"].items()} == before  # nothing re-ran
    assert all("skipped_at" in v for v in again["stages"].values())
    assert len(again["runs"]) == 2


def test_failing_stage_stops_keeps_partial_output_and_resumes(tmp_path, notebooks, monkeypatch):
    cfg = _cfg(tmp_path)
    monkeypatch.setenv("FAIL_STAGE", "baseline")
    with pytest.raises(workbench.PipelineError, match="boom in baseline") as info:
        workbench.run_pipeline(cfg, progress=False)
    assert "stage 'baseline' failed" in str(info.value)
    run = cfg.run_dir.resolve()
    manifest = workbench.read_manifest(run)
    assert manifest["status"] == "failed"
    assert manifest["stages"]["scenarios"]["status"] == "complete"
    assert manifest["stages"]["baseline"]["status"] == "failed"
    assert "boom in baseline" in manifest["stages"]["baseline"]["error"]
    assert "analysis" not in manifest["stages"]
    assert (run / "notebooks" / "04_evaluation_baseline.ipynb").exists()  # partial notebook kept
    assert not (run / "report.html").exists()

    scenarios_started = manifest["stages"]["scenarios"]["started"]
    monkeypatch.delenv("FAIL_STAGE")
    workbench.run_pipeline(cfg, progress=False)
    manifest = workbench.read_manifest(run)
    assert manifest["status"] == "complete"
    assert manifest["stages"]["scenarios"]["started"] == scenarios_started  # not re-run


def test_stage_without_its_output_is_not_complete(tmp_path):
    cfg = _cfg(tmp_path)
    run = cfg.run_dir
    stage = workbench.pipeline_stages(cfg, run)[0]
    manifest = {"stages": {"scenarios": {"status": "complete"}}}
    assert not workbench.stage_complete(run, manifest, stage)  # marker file missing
    (run / "scenarios").mkdir(parents=True)
    (run / "scenarios" / "test.jsonl").write_text("{}\n")
    assert workbench.stage_complete(run, manifest, stage)


def test_pipeline_stage_order_and_adapters(tmp_path):
    cfg = build_config({"stages": ["evaluate", "train", "scenarios", "baseline", "analysis"]})
    run = tmp_path / "run"
    stages = workbench.pipeline_stages(cfg, run)
    assert [s.name for s in stages] == ["scenarios", "baseline", "train", "evaluate", "analysis"]
    by_name = {s.name: s for s in stages}
    assert by_name["baseline"].params == {"label": "baseline", "adapter": None}
    assert by_name["evaluate"].params == {"label": "trained", "adapter": str(run / "train" / "adapter")}
    no_train = build_config({"stages": ["evaluate"], "policy": {"adapter": "some/adapter"}})
    (evaluate,) = workbench.pipeline_stages(no_train, run)
    assert evaluate.params["adapter"] == "some/adapter"


def test_changed_config_in_existing_run_folder_is_refused(tmp_path):
    workbench.prepare_run_dir(_cfg(tmp_path))
    with pytest.raises(ConfigError, match=r"training\.steps"):
        workbench.prepare_run_dir(_cfg(tmp_path, **{"training.steps": 3}))


def test_peak_memory_includes_child_processes():
    code = "b = bytearray(300 * 2**20); import time; time.sleep(1.5)"
    with workbench.track_peak_memory(interval_s=0.05) as baseline:
        pass
    with workbench.track_peak_memory(interval_s=0.05) as peak:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert peak["peak_rss_mb"] - baseline["peak_rss_mb"] > 250


def test_ablation_skips_finished_cells(tmp_path, notebooks):
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""
        name: g
        output_root: {tmp_path / 'out'}
        base:
          simulator: {{backend: rule}}
          stages: [scenarios]
        axes:
          training.algorithm: [grpo, ppo]
    """))
    report = workbench.run_ablation(grid, progress=False)
    grid_dir = tmp_path / "out" / "g"
    cells = ["algorithm-grpo", "algorithm-ppo"]
    assert report == grid_dir / "report.html" and report.exists()
    assert (grid_dir / "compared.txt").read_text() == "2"
    first = {c: workbench.read_manifest(grid_dir / c)["stages"]["scenarios"]["started"] for c in cells}

    # leave the second cell half-finished: its stage record says running
    manifest_path = grid_dir / cells[1] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["status"], manifest["stages"]["scenarios"]["status"] = "running", "running"
    manifest_path.write_text(json.dumps(manifest))

    workbench.run_ablation(grid, progress=False)
    done, resumed = (workbench.read_manifest(grid_dir / c) for c in cells)
    assert done["stages"]["scenarios"]["started"] == first[cells[0]]  # finished cell not re-run
    assert len(done["runs"]) == 1 and "skipped_at" not in done["stages"]["scenarios"]
    assert len(resumed["runs"]) == 2 and resumed["status"] == "complete"
    assert resumed["stages"]["scenarios"]["started"] >= resumed["runs"][1]["started"]  # re-ran


def test_non_main_rank_runs_stages_without_writing_the_manifest(tmp_path, notebooks, monkeypatch):
    cfg = _cfg(tmp_path, stages=["scenarios", "baseline"])
    monkeypatch.setenv("RANK", "1")
    workbench.run_pipeline(cfg, progress=False)
    run = cfg.run_dir.resolve()
    assert not (run / "manifest.json").exists() and not (run / "report.html").exists()
    assert sorted(p.name for p in (run / "notebooks" / "rank1").iterdir()) == [
        "01_scenarios.ipynb", "04_evaluation_baseline.ipynb", "config.yaml"]
    assert (run / "eval" / "baseline" / "summary.json").exists()


def test_limits_statement_names_models_and_limits_only_for_small_models():
    small = build_config({"stages": ["baseline"]})
    text = workbench.limits_statement(small)
    assert "embedded:smollm2-135m-instruct" in text and "135M" in text and "1.5B" in text
    assert "Training:" not in text  # no train stage
    big = build_config({"policy": {"model": "Qwen/Qwen2.5-7B-Instruct"},
                        "simulator": {"backend": "openai", "base_url": "http://h/v1", "model": "sim"}})
    text = workbench.limits_statement(big)
    assert "Qwen/Qwen2.5-7B-Instruct" in text and "cannot" not in text and "Training: GRPO" in text
