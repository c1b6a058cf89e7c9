"""Pipeline mechanics with stand-in notebooks: manifest, resume, failure, report, ablation.

The stand-in notebooks take the same papermill parameters as the real ones and write
the files that mark a stage complete, so these tests exercise papermill, the manifest
and nbconvert without loading any model (about 1 min on 2 cores: kernel start-ups).
"""

import json
import re
import subprocess
import sys
import textwrap

import nbformat
import pytest
import yaml
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from rlver_lib.config import ConfigError
from rlver_lib.evaluation.stage import eval_command, evaluate
from rlver_lib.files import atomic_write_json
from rlver_lib.params import build_config, dump_config
from rlver_lib.pipeline.ablate import run_ablation
from rlver_lib.pipeline.execution import NOTEBOOK_DIR
from rlver_lib.pipeline.manifest import read_manifest, track_peak_memory
from rlver_lib.pipeline.notebook import (
    notebook_session,
    run_scenarios,
    scenario_table,
    transcript_table,
    validate_scenario_sources,
    write_run_scenarios,
)
from rlver_lib.pipeline.report import ablation_header, limits_statement, render_report, report_header
from rlver_lib.pipeline.run import (
    FOLLOW_POLL_S,
    PipelineError,
    pipeline_stages,
    prepare_run_dir,
    run_pipeline,
    stage_complete,
)

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
    monkeypatch.setattr("rlver_lib.pipeline.execution.NOTEBOOK_DIR", folder)
    return folder


def _cfg(tmp_path, **overrides):
    data = {"run_name": "r", "output_root": str(tmp_path / "out"), "simulator": {"backend": "rule"},
            "stages": ["scenarios", "baseline", "analysis"]}
    return build_config(data, overrides)


def test_pipeline_writes_manifest_report_and_resumes(tmp_path, notebooks):
    cfg = _cfg(tmp_path)
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

    cfg = _cfg(tmp_path)
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
    cfg = _cfg(tmp_path)
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


def test_report_titles_the_baseline_and_trained_evaluation_apart(tmp_path):
    template = nbformat.read(NOTEBOOK_DIR / "04_evaluation.ipynb", as_version=4)
    assert template.cells[0].source.startswith("# 04 · Evaluation: the Sentient benchmark\n")
    executed = []
    for label in ("baseline", "trained"):
        nb = nbformat.from_dict(json.loads(json.dumps(template)))
        nb.metadata["papermill"] = {"parameters": {"label": label, "run_dir": str(tmp_path)}}
        nb.cells = nb.cells[:1]
        executed.append(tmp_path / f"04_evaluation_{label}.ipynb")
        nbformat.write(nb, executed[-1])
    html = render_report(executed, tmp_path / "report.html", "# header").read_text()
    titles = re.findall(r"<h1[^>]*>(04 · Evaluation[^<:]*)", html)
    assert titles == ["04 · Evaluation (baseline)", "04 · Evaluation (trained)"]


def test_stage_without_its_output_is_not_complete(tmp_path):
    cfg = _cfg(tmp_path)
    run = cfg.run_dir
    stage = pipeline_stages(cfg, run)[0]
    manifest = {"stages": {"scenarios": {"status": "complete"}}}
    assert not stage_complete(run, manifest, stage)  # marker file missing
    (run / "scenarios").mkdir(parents=True)
    (run / "scenarios" / "test.jsonl").write_text("{}\n")
    assert stage_complete(run, manifest, stage)


def test_an_older_runs_evaluate_stage_counts_as_its_trained_stage(tmp_path):
    cfg = _cfg(tmp_path, stages=["trained"])
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
    assert by_name["baseline"].params == {"label": "baseline", "adapter": None}
    assert by_name["trained"].params == {"label": "trained", "adapter": str(run / "train" / "adapter")}
    no_train = build_config({"stages": ["trained"], "policy": {"adapter": "some/adapter"}})
    (trained,) = pipeline_stages(no_train, run)
    assert trained.params["adapter"] == "some/adapter"


def test_changed_config_in_existing_run_folder_is_refused(tmp_path):
    prepare_run_dir(_cfg(tmp_path))
    with pytest.raises(ConfigError, match=r"training\.steps"):
        prepare_run_dir(_cfg(tmp_path, **{"training.steps": 3}))


def test_peak_memory_includes_child_processes():
    code = "b = bytearray(300 * 2**20); import time; time.sleep(1.5)"
    with track_peak_memory(interval_s=0.05) as baseline:
        pass
    with track_peak_memory(interval_s=0.05) as peak:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert peak["peak_rss_mb"] - baseline["peak_rss_mb"] > 250


def scenarios_grid(tmp_path, axis: str, values: list[str]):
    """A grid file of rule-simulator cells that run the scenarios stage only, over one axis."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""
        name: g
        output_root: {tmp_path / 'out'}
        base:
          simulator: {{backend: rule}}
          stages: [scenarios]
        axes:
          {axis}: [{', '.join(values)}]
    """))
    return grid


def test_ablation_over_the_judge_is_refused_before_anything_runs(tmp_path):
    grid = scenarios_grid(tmp_path, "evaluation.judge.difficulty", ["moderate", "hard"])
    with pytest.raises(ConfigError, match=r"judged differently.*evaluation\.judge"):
        run_ablation(grid, progress=False)
    assert not (tmp_path / "out").exists()


def test_ablation_skips_finished_cells(tmp_path, notebooks):
    grid = scenarios_grid(tmp_path, "training.algorithm", ["grpo", "ppo"])
    report = run_ablation(grid, progress=False)
    grid_dir = tmp_path / "out" / "g"
    cells = ["algorithm-grpo", "algorithm-ppo"]
    assert report == grid_dir / "report.html" and report.exists()
    assert (grid_dir / "compared.txt").read_text() == "2"
    first = {c: read_manifest(grid_dir / c)["stages"]["scenarios"]["started"] for c in cells}

    # leave the second cell half-finished: its stage record says running
    manifest_path = grid_dir / cells[1] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["status"], manifest["stages"]["scenarios"]["status"] = "running", "running"
    manifest_path.write_text(json.dumps(manifest))

    run_ablation(grid, progress=False)
    done, resumed = (read_manifest(grid_dir / c) for c in cells)
    assert done["stages"]["scenarios"]["started"] == first[cells[0]]  # finished cell not re-run
    assert len(done["runs"]) == 1 and "skipped_at" not in done["stages"]["scenarios"]
    assert len(resumed["runs"]) == 2 and resumed["status"] == "complete"
    assert resumed["stages"]["scenarios"]["started"] >= resumed["runs"][1]["started"]  # re-ran


def test_ablation_header_lists_what_varies_per_cell(tmp_path):
    from rlver_lib.pipeline.ablate import load_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "output_root": str(tmp_path / "out"),
                                    "base": {"simulator": {"backend": "rule"}, "training": {"steps": 3}},
                                    "axes": {"training.algorithm": ["grpo", "ppo"], "policy.think": [False, True]}},
                                   sort_keys=False))
    _, cells = load_grid(grid)
    header = ablation_header("g", ["training.algorithm", "policy.think"], cells)
    rows = [line for line in header.splitlines() if line.startswith("| `")]
    assert rows == ["| `algorithm-grpo_think-false` | grpo | False | GRPO, 3 step(s) | off | moderate |",
                    "| `algorithm-grpo_think-true` | grpo | True | GRPO, 3 step(s) | on | moderate |",
                    "| `algorithm-ppo_think-false` | ppo | False | PPO, 3 step(s) | off | moderate |",
                    "| `algorithm-ppo_think-true` | ppo | True | PPO, 3 step(s) | on | moderate |"]
    shared = header.split("**Models that ran (every cell).**", 1)[1]
    assert "GRPO" not in shared and "think mode" not in shared  # the base config is not passed off as every cell's


def test_non_main_rank_waits_for_rank_0_then_runs_only_training(tmp_path, notebooks, monkeypatch):
    """Rank 1 of a launch: no scenarios, benchmarks or analysis (rank 0 runs them once), and
    training only once rank 0's manifest says it started training. tests/test_multiprocess.py
    runs the same with two real processes."""
    body = "import os\nfrom pathlib import Path\n(Path(run_dir) / f'train_rank{os.environ[\"RANK\"]}').write_text('1')"
    nbformat.write(_stand_in(body, "params_file = None\nrun_dir = None\noverrides = {}\n"),
                   notebooks / "03_training.ipynb")
    monkeypatch.setenv("RANK", "1")
    cfg = _cfg(tmp_path, stages=["scenarios", "baseline", "analysis"])  # nothing for rank 1
    assert run_pipeline(cfg, progress=False) == cfg.run_dir.resolve() / "report.html"
    assert not cfg.run_dir.exists()

    cfg = _cfg(tmp_path, stages=["scenarios", "baseline", "train", "trained", "analysis"])
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


def test_evaluate_on_a_non_main_rank_loads_nothing_and_calls_no_judge(tmp_path, monkeypatch):

    calls = []
    monkeypatch.setattr("rlver_lib.evaluation.stage.Judge.from_config", lambda *a, **k: calls.append("judge"))
    monkeypatch.setattr("rlver_lib.evaluation.stage.load_policy", lambda *a, **k: calls.append("policy"))
    monkeypatch.setenv("RANK", "1")
    cfg = _cfg(tmp_path)
    assert evaluate(cfg, label="baseline") is None
    assert eval_command(cfg) == 0
    assert calls == [] and not cfg.run_dir.exists()


def test_the_report_names_the_judge_once_as_its_benchmark_recorded_it(tmp_path):
    """Issue 33: the header named the judge twice (the headline from ``summary.json``, a
    judge statement rebuilt from the config without what its server serves) and notebook
    04 once per evaluation; now the headline alone names it, with the served model."""
    from evaluation_support import scored

    from rlver_lib.evaluation.benchmark import protocol_description, summarize, write_summary
    from rlver_lib.evaluation.judge import Judge

    cfg = _cfg(tmp_path)
    judge = Judge.from_config(cfg.evaluation, cfg.seed)
    judge.served = {"models": [{"id": "judge", "root": "org/judge-weights"}], "model_listed": True}
    for label in ("baseline", "trained"):
        write_summary(summarize([scored("s0", 0, 50)], n_boot=10), cfg.run_dir / "eval" / label, label,
                      {"judge": judge.description, "protocol": protocol_description(cfg.evaluation)})
    header = report_header(cfg, {"git": {"commit": "abc"}})
    assert header.count(judge.name) == 1 and "(serving `org/judge-weights`)" in judge.name
    assert header.count("Judge:") == 1 and "Benchmark judge" not in header
    # nor a second time as the config alone would name it (backend on, without the served model)
    assert header.count(Judge.from_config(cfg.evaluation, cfg.seed).name.split(" through ")[1]) == 1
    # notebook 04 states its judge only outside the report
    template = nbformat.read(NOTEBOOK_DIR / "04_evaluation.ipynb", as_version=4)
    naming = [c for c in template.cells if "judge_statement" in c.source]
    assert len(naming) == 1 and "report-skip" in naming[0].metadata.get("tags", [])


def test_limits_statement_names_models_and_limits_only_for_small_models():
    small = build_config({"stages": ["baseline"]})
    text = limits_statement(small)
    assert "embedded:smollm2-135m-instruct" in text and "135M" in text and "1.5B" in text
    assert "Training:" not in text  # no train stage
    big = build_config({"policy": {"model": "Qwen/Qwen2.5-7B-Instruct"},
                        "simulator": {"backend": "openai", "base_url": "http://h/v1", "model": "sim"}})
    text = limits_statement(big)
    assert "Qwen/Qwen2.5-7B-Instruct" in text and "cannot" not in text and "Training: GRPO" in text


# ------------------------------------------------------------------ notebook helpers


def test_notebook_session_opens_the_run_and_sets_up_display(tmp_path, capsys):
    import pandas as pd

    params = tmp_path / "p.yaml"
    params.write_text("run_name: nb\nsimulator:\n  backend: rule\n", encoding="utf-8")
    before = pd.get_option("display.max_colwidth")
    try:
        cfg, run_dir = notebook_session(params, tmp_path / "runs" / "x", {"training.steps": 3})
        assert pd.get_option("display.max_colwidth") == 120
    finally:
        pd.set_option("display.max_colwidth", before)
    assert run_dir == (tmp_path / "runs" / "x").resolve() and cfg.run_dir == run_dir
    assert (cfg.run_name, cfg.training.steps) == ("x", 3)
    assert capsys.readouterr().out == f"run folder: {run_dir}\n"


def test_run_scenarios_prefers_the_runs_written_split(tmp_path):
    from rlver_lib.scenarios import RunSplit, load_scenarios

    cfg = _cfg(tmp_path, **{"scenarios.limit_train": 3})
    builtin_train = load_scenarios("builtin:train")
    # nothing written yet: the config's source, cut to its limit (test has no limit)
    assert [s.id for s in run_scenarios(cfg, tmp_path, "train")] == [s.id for s in builtin_train[:3]]
    assert len(run_scenarios(cfg, tmp_path, "test")) == len(load_scenarios("builtin:test"))
    split = RunSplit(train=builtin_train[5:7], test=load_scenarios("builtin:test")[:1], dropped=[])
    folder = write_run_scenarios(tmp_path, split)
    assert folder == tmp_path / "scenarios"
    assert sorted(p.name for p in folder.iterdir()) == ["test.jsonl", "train.jsonl"]
    assert run_scenarios(cfg, tmp_path, "train") == split.train  # round trip, limit not re-applied
    assert run_scenarios(cfg, tmp_path, "test") == split.test
    with pytest.raises(ValueError, match="'train' or 'test'"):
        run_scenarios(cfg, tmp_path, "valid")


def test_scenario_table_rows_and_truncation():
    from rlver_lib.scenarios import load_scenarios

    first, second = load_scenarios("builtin:test")[:2]
    second = second.model_copy(update={"opening_line": None})
    table = scenario_table([first, second], width=10)
    assert list(table.columns) == ["id", "language", "personality", "hidden_intention", "persona", "opening_line"]
    assert table["id"].tolist() == [first.id, second.id]
    assert table["persona"].tolist() == [first.persona[:10], second.persona[:10]]
    assert table.loc[1, "opening_line"] == "" and table.loc[0, "hidden_intention"] == first.hidden_intention
    assert scenario_table([]).shape == (0, 6)


def test_validate_scenario_sources_checks_each_file_once(tmp_path):
    from rlver_lib.config import ScenarioConfig
    from rlver_lib.scenarios import BUILTIN_FILE

    files, issues = validate_scenario_sources(ScenarioConfig())  # builtin:train + builtin:test
    assert files == [str(BUILTIN_FILE)] and issues == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n', encoding="utf-8")
    files, issues = validate_scenario_sources(ScenarioConfig(train=str(bad)))
    assert files == [str(bad), str(BUILTIN_FILE)]
    assert issues and {i.file for i in issues} == {str(bad)} and all(i.line == 1 for i in issues)


def test_transcript_table_shows_the_appraisal_of_user_turns():
    from rlver_lib.rollout import Trajectory

    turns = [
        {"role": "user", "content": "I failed again."},
        {"role": "assistant", "content": "That sounds hard."},
        {"role": "user", "content": "It is.", "change": 6, "emotion": 46, "label": "B",
         "appraisal": {"meaning": "heard", "reaction": "calmer"}},
    ]
    traj = Trajectory("d0", "s0", "g0", turns, final_emotion=46, reward=0.46, termination="max_turns",
                      initial_emotion=40)
    table = transcript_table(traj)
    assert table["speaker"].tolist() == ["user", "assistant", "user"]
    assert table["text"].tolist() == ["I failed again.", "That sounds hard.", "It is."]
    assert table.loc[2, ["change", "emotion", "mood", "appraisal.meaning", "appraisal.reaction"]].tolist() == \
        [6, 46, "B", "heard", "calmer"]
    assert table.iloc[:2]["emotion"].isna().all()
