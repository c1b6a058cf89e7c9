"""SAGE transcript scoring (rlver_lib.evaluation.sage, ``rlver sage-score``) against SAGE's
published figures and stored results."""

from __future__ import annotations

import json

import pytest
from evaluation_support import FIXTURE
from reference_data import reference_file

from rlver_lib.evaluation.benchmark import BREAKDOWN_FACTORS, summarize
from rlver_lib.evaluation.sage import sage_score, sage_score_command
from rlver_lib.files import iter_jsonl
from rlver_lib.records import RecordError


@pytest.mark.parametrize("name, score, success, failure", [
    ("gpt-4.1_result.jsonl", 68.2, 35, 13),
    ("claude3.7_result.jsonl", 54.8, 19, 24),
    ("qwen2.5-72b_result.jsonl", 19.1, 4, 70),
])
def test_sage_published_figures(name, score, success, failure):
    row = sage_score([reference_file("sage_results", name)]).iloc[0]
    assert row["n"] == 100
    assert round(row["sentient_score"], 1) == pytest.approx(score)
    assert (row["success"], row["failure"]) == (success, failure)


def test_sage_breakdowns_sum_to_whole():
    records = [r for _, r in iter_jsonl(reference_file("sage_results", "claude3.7_result.jsonl"))]
    s = summarize(records, n_boot=50)
    assert s.sentient_score.value == pytest.approx(54.8)
    for factor in BREAKDOWN_FACTORS:
        assert s.breakdown[s.breakdown["factor"] == factor]["n"].sum() == 100
    intentions = set(s.breakdown[s.breakdown["factor"] == "hidden_intention"]["level"])
    assert intentions <= {"analyse_problem", "practical_advice", "understand_others", "reflect_grow",
                          "specific_praise", "be_heard", "deep_empathy", "not_at_fault"}


def test_sage_score_reads_line_separators_as_data_and_our_records(tmp_path, capsys):
    sage = tmp_path / "odd_result.jsonl"
    sage.write_text(json.dumps({"emo_point": 100, "history": [], "task": "a\u2028b"}, ensure_ascii=False)
                    + "\n\n" + json.dumps({"emo_point": 4, "history": []}) + "\n", encoding="utf-8")
    ours = tmp_path / "mymodel" / "dialogues.jsonl"
    ours.parent.mkdir()
    ours.write_text("".join(json.dumps(r) + "\n" for r in FIXTURE), encoding="utf-8")
    table = sage_score([sage, ours])
    assert table[["model", "n", "success", "failure"]].values.tolist() == [["odd", 2, 1, 1], ["mymodel", 3, 1, 1]]
    assert table["sentient_score"].tolist() == pytest.approx([52.0, 55.0])
    assert sage_score_command([sage], as_json=True) == 0
    assert json.loads(capsys.readouterr().out)[0]["sentient_score"] == pytest.approx(52.0)
    assert sage_score_command([tmp_path / "missing.jsonl"]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"emo_point": 1}\n{"x": 2}\n', encoding="utf-8")
    with pytest.raises(RecordError, match="bad.jsonl:2"):
        sage_score([bad])


@pytest.mark.parametrize("name", ["gpt-4.1_result.jsonl", "claude3.7_result.jsonl", "qwen2.5-72b_result.jsonl"])
def test_stored_sage_files_are_detected_as_sage_protocol(name, capsys):
    path = reference_file("sage_results", name)
    records = [r for _, r in iter_jsonl(path)]
    replies = sum(m["role"] == "assistant" for r in records for m in r["history"])
    appraised = sum(m["role"] == "user" and "planning" in m for r in records for m in r["history"])
    row = sage_score([reference_file("sage_results", name)]).iloc[0]
    assert row["protocol"] == "sage"
    assert (row["policy_replies"], row["appraised_replies"]) == (replies, appraised)
    assert sage_score_command([path]) == 0
    assert "protocol sage" in capsys.readouterr().out
