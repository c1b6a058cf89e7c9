"""Every notebook executes under papermill with tiny parameters (tests/params_tiny.yaml:
embedded SmolLM2 policy, rule simulator, one turn, a few tokens, one GRPO step).

One pipeline run (01 -> 04 baseline -> 03 -> 04 trained -> 06) is shared by the tests;
02 and 05 run on its folder. Runtime: about 3-5 min on 2 cores.
"""

import json
import re
from pathlib import Path

import nbformat
import pytest

from rlver_lib.params import load_config
from rlver_lib.pipeline.execution import execute_notebook
from rlver_lib.pipeline.manifest import read_manifest
from rlver_lib.pipeline.run import run_pipeline

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "params_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    cfg = load_config(TINY, {"output_root": str(tmp_path_factory.mktemp("outputs"))})
    report = run_pipeline(cfg, params_file=str(TINY), progress=False)
    return cfg, cfg.run_dir.resolve(), report


def _outputs_text(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def test_pipeline_stages_complete_with_their_outputs(tiny_run):
    cfg, run, _ = tiny_run
    manifest = read_manifest(run)
    assert manifest["status"] == "complete"
    assert [k for k, v in manifest["stages"].items() if v["status"] == "complete"] == cfg.stages
    for rel in ("scenarios/train.jsonl", "scenarios/test.jsonl", "eval/baseline/summary.json",
                "eval/trained/summary.json", "eval/trained/math.json", "train/adapter/adapter_config.json",
                "train/metrics.jsonl"):
        assert (run / rel).is_file(), rel
    tested = [json.loads(line)["id"] for line in (run / "scenarios" / "test.jsonl").read_text().splitlines()]
    assert len(tested) == 2
    dialogues = [json.loads(line) for line in (run / "eval" / "trained" / "dialogues.jsonl").read_text().splitlines()]
    assert sorted(d["scenario_id"] for d in dialogues) == sorted(tested)
    # the trained evaluation was given this run's adapter
    trained_nb = nbformat.read(run / "notebooks" / "04_evaluation_trained.ipynb", as_version=4)
    injected = next(c for c in trained_nb.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert str(run / "train" / "adapter") in injected.source


def test_report_embeds_the_expected_figures(tiny_run):
    _, _, report = tiny_run
    html = report.read_text(encoding="utf-8")
    # 01: coverage; 04 (x2): trajectory + breakdown; 03: reward curve;
    # 06: trajectories, the per-scenario paired plot, reward curve, success/failure, length
    # vs reward, strategy mix and strategy/dimension panels (baseline vs trained; one
    # training step: no over-steps plot)
    assert html.count('src="data:image/png;base64,') == 1 + 2 * 2 + 1 + 5 + 2
    for heading in ("01 · Scenario design", "04 · Evaluation", "03 · Training", "06 · Analysis",
                    "Models that ran", "What this run can and cannot show"):
        assert heading in html
    assert "notebook.notebook_session(" not in html  # code hidden
    assert "Traceback" not in html


def test_analysis_notebook_compares_baseline_and_trained(tiny_run):
    _, run, _ = tiny_run
    text = _outputs_text(run / "notebooks" / "06_analysis.ipynb")
    summaries = {label: json.loads((run / "eval" / label / "summary.json").read_text())
                 for label in ("baseline", "trained")}
    for summary in summaries.values():
        score = summary["sentient_score"]
        assert f"{score['value']:.2f} [{score['low']:.2f}, {score['high']:.2f}]" in text
    assert "probe - control" in text  # hacking probes ran on the rule simulator


def test_simulator_playground_shows_each_appraisal(tiny_run, tmp_path):
    cfg, run, _ = tiny_run
    out = tmp_path / "02.ipynb"
    execute_notebook("02_simulator.ipynb", out, {
        "params_file": str(TINY), "run_dir": str(run), "max_turns": 2})
    text = _outputs_text(out)
    assert "appraisal.rule" in text and "default_change_fn" in text
    final = re.search(r"final emotion (\d+)", text)
    assert final and 0 <= int(final.group(1)) <= 100


def test_scenarios_notebook_splits_by_persona(tiny_run, tmp_path):
    cfg, run, _ = tiny_run
    train = [json.loads(line) for line in (run / "scenarios" / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (run / "scenarios" / "test.jsonl").read_text().splitlines()]
    norm = lambda s: " ".join(s["persona"].split()).casefold()  # noqa: E731
    assert not {norm(s) for s in train} & {norm(s) for s in test}
    assert len(train) == cfg.scenarios.n_train_scenarios and len(test) == cfg.scenarios.n_test_scenarios


def test_ablation_notebook_compares_runs(tiny_run, tmp_path):
    _, run, _ = tiny_run
    out = tmp_path / "05.ipynb"
    execute_notebook("05_ablations.ipynb", out, {
        "grid_dir": str(run.parent), "run_dirs": [str(run)], "axes": ["training.algorithm"]})
    text = _outputs_text(out)
    trained = json.loads((run / "eval" / "trained" / "summary.json").read_text())
    assert "1 runs in" in text
    assert f"{trained['sentient_score']['value']:.1f}" in text
