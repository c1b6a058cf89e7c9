"""Files of a run (rlver_lib.files): atomic writes, JSON Lines, and the run folder's paths."""

from __future__ import annotations

import pytest

from rlver_lib.files import JsonlError, RunFolder, atomic_write_json, iter_jsonl, write_jsonl


def test_jsonl_round_trip_and_a_bad_line_names_its_number(tmp_path):
    path = write_jsonl(tmp_path / "a" / "x.jsonl", [{"a": 1}, {"b": 2}])
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (2, {"b": 2})]
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(JsonlError, match=":2"):
        list(iter_jsonl(path))


def test_run_folder_names_every_path(tmp_path):
    run = RunFolder(tmp_path)
    assert run.config == tmp_path / "config.yaml" and run.report == tmp_path / "report.html"
    assert run.eval_dialogues("trained") == tmp_path / "eval" / "trained" / "dialogues.jsonl"
    assert run.paired == tmp_path / "eval" / "paired.json"
    assert run.scenarios("test") == tmp_path / "scenarios" / "test.jsonl"
    assert run.analysis_table("distinct") == tmp_path / "analysis" / "distinct.csv"
    assert run.adapter == tmp_path / "train" / "adapter"
    for label in ("trained", "baseline"):
        atomic_write_json(run.eval_dir(label) / "summary.json", {"label": label})
    write_jsonl(run.train / "dialogues" / "step_000002.jsonl", [])
    write_jsonl(run.train / "dialogues" / "step_000001.jsonl", [])
    write_jsonl(run.step_dialogues_file(2, failed=True), [])  # a dead simulator's step, redone
    assert [p.parent.name for p in run.summaries()] == ["baseline", "trained"]
    assert [p.name for p in run.step_dialogues()] == ["step_000001.jsonl", "step_000002.jsonl"]
