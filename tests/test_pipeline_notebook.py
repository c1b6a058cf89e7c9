"""What the pipeline notebooks call (rlver_lib.pipeline.notebook): the session and the table helpers."""

import pytest
from pipeline_support import run_config

from rlver_lib.pipeline.notebook import (
    notebook_session,
    run_scenarios,
    scenario_table,
    transcript_table,
    validate_scenario_sources,
    write_run_scenarios,
)


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

    cfg = run_config(tmp_path, **{"scenarios.n_train_scenarios": 3})
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
