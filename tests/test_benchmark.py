"""The Sentient benchmark (rlver_lib.evaluation.benchmark): summaries, error bounds, protocols,
repeats and character breaks, on scripted policies and the rule simulator."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from evaluation_support import FIXTURE, ScriptedPolicy, our_record, three_scenarios
from reference_data import rlver_test_profiles

from rlver_lib.config import EvaluationConfig, SamplingParams
from rlver_lib.evaluation.benchmark import BREAKDOWN_FACTORS, run_benchmark, summarize
from rlver_lib.evaluation.sage import sage_score
from rlver_lib.pipeline.report import error_statement
from rlver_lib.records import RecordError


def test_summarize_figures_trajectory_and_breakdown():
    s = summarize(FIXTURE, n_boot=100, seed=0)
    assert s.n == 3 and s.n_success == 1 and s.n_failure == 1
    assert s.sentient_score.value == pytest.approx(55.0)
    assert s.success_rate.value == pytest.approx(1 / 3)
    assert s.failure_rate.value == pytest.approx(1 / 3)
    assert s.mean_turns.value == pytest.approx(2.0)
    assert s.sentient_score.low <= 55.0 <= s.sentient_score.high
    traj = s.trajectory
    assert list(traj["turn"]) == [0, 1, 2, 3]
    assert list(traj["n_alive"]) == [3, 3, 2, 1]
    assert traj["mean_emotion"].tolist() == pytest.approx([40, (70 + 5 + 50) / 3, (100 + 5 + 55) / 3, 55])
    assert traj["mean_emotion_alive"].tolist() == pytest.approx([40, (70 + 5 + 50) / 3, 77.5, 60])
    b = s.breakdown
    for factor in BREAKDOWN_FACTORS:
        assert b[b["factor"] == factor]["n"].sum() == 3
    heard = b[(b["factor"] == "hidden_intention") & (b["level"] == "be_heard")].iloc[0]
    assert heard["n"] == 2 and heard["sentient_score"] == pytest.approx(52.5)
    assert json.loads(json.dumps(s.to_dict()))["sentient_score"]["value"] == pytest.approx(55.0)


def test_errored_dialogues_are_excluded_and_counted():
    # a dialogue whose simulator failed keeps its last emotion (40) but was never scored
    errored = our_record(40, [], termination="error", hidden_intention="be_heard", personality="negative",
                      language="en")
    s = summarize([*FIXTURE, errored], n_boot=100, seed=0)
    assert (s.n, s.n_error) == (3, 1)
    assert s.sentient_score.value == pytest.approx((100 + 5 + 60) / 3)
    assert s.to_dict()["n_error"] == 1
    with pytest.raises(ValueError, match="all ended in error"):
        summarize([errored])


def test_summarize_rejects_bad_input():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(RecordError):
        summarize([{"id": 1}])


def test_run_benchmark_with_rule_simulator(tmp_path):
    from rlver_lib.simulator import RuleSimulator

    scenarios = rlver_test_profiles(3)
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    result = run_benchmark(ScriptedPolicy(modes), RuleSimulator(), scenarios,
                           EvaluationConfig(n_boot=50), sampling=SamplingParams(),
                           think=False, seed=0, out_dir=tmp_path, label="scripted")
    # rule: +10 for a question, -5 otherwise, from 40, at most 10 turns
    finals = [r["final_emotion"] for r in result.records]
    assert finals == [100, 5, 65]
    s = result.summary
    assert s.sentient_score.value == pytest.approx(170 / 3)
    assert s.mean_turns.value == pytest.approx((6 + 7 + 10) / 3)
    assert (s.n_success, s.n_failure) == (1, 1)
    assert s.trajectory["mean_emotion"].iloc[-1] == pytest.approx(170 / 3)
    for name in ("dialogues.jsonl", "summary.json", "breakdown.csv", "trajectory.csv"):
        assert (tmp_path / name).is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["label"] == "scripted" and summary["n_success"] == 1
    assert pd.read_csv(tmp_path / "breakdown.csv").groupby("factor")["n"].sum().tolist() == [3, 3, 3]
    assert sage_score([tmp_path / "dialogues.jsonl"])["sentient_score"].iloc[0] == pytest.approx(170 / 3)
    assert {r["language"] for r in result.records} == {"zh"}


def test_sage_protocol_appraises_nine_of_ten_replies(tmp_path):
    from rlver_lib.simulator import RuleSimulator

    scenarios = three_scenarios()
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    cfg = EvaluationConfig(n_boot=50, protocol="sage")
    result = run_benchmark(ScriptedPolicy(modes), RuleSimulator(), scenarios, cfg, sampling=SamplingParams(),
                           think=False, seed=0, out_dir=tmp_path, label="sage", progress=False)
    # alternate: +10, -5, +10, ... over 9 appraised replies from 40 -> 70 (full protocol: 65);
    # ask reaches 100 after 6 replies and tell drops below 10 after 7, as under full
    assert [r["final_emotion"] for r in result.records] == [100, 5, 70]
    capped = result.records[2]
    assistants = [t for t in capped["transcript"] if t["role"] == "assistant"]
    updates = [t for t in capped["transcript"] if t["role"] == "user" and t.get("change") is not None]
    assert (len(assistants), len(updates)) == (10, 9)
    assert capped["transcript"][-1]["role"] == "assistant" and capped["transcript"][-1]["appraised"] is False
    assert all(t["cut"] is False for t in assistants)  # the scripted policy always stops
    assert capped["transcript"][-1]["content"] == "I see."  # the 10th reply (an even turn: no question)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["protocol"] == {"name": "sage", "initial_emotion": 40, "max_policy_turns": 10,
                                   "appraised_turns": 9, "repeats": 1}
    assert summary["sentient_score"]["value"] == pytest.approx(175 / 3)
    row = sage_score([tmp_path / "dialogues.jsonl"]).iloc[0]
    assert row["protocol"] == "sage" and (row["policy_replies"], row["appraised_replies"]) == (6 + 7 + 10, 6 + 7 + 9)
    with pytest.raises(ValueError, match="sage"):
        EvaluationConfig(protocol="sage", max_turns=4)


def test_repeats_have_their_own_ids_and_seeds_and_intervals_resample_scenarios(tmp_path):
    from rlver_lib.simulator import RuleSimulator
    from rlver_lib.stats import cluster_bootstrap_ci

    scenarios = three_scenarios()
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    cfg = EvaluationConfig(n_boot=200, repeats=2, max_turns=3)
    result = run_benchmark(ScriptedPolicy(modes), RuleSimulator(), scenarios, cfg, sampling=SamplingParams(),
                           think=False, seed=5, out_dir=tmp_path, label="r", progress=False)
    ids = [r["dialogue_id"] for r in result.records]
    assert ids == [f"{s.id}#{k}" for k in (0, 1) for s in scenarios]
    assert {r["seed"] for r in result.records if r["repeat"] == 0} == {5}
    assert len({r["seed"] for r in result.records}) == 2
    s = result.summary
    assert (s.n, s.n_scenarios) == (6, 3)
    finals = [r["final_emotion"] for r in result.records]  # 3 turns: 70, 25, 55 per repeat
    assert finals == [70, 25, 55, 70, 25, 55]
    expected = cluster_bootstrap_ci(finals, [r["scenario_id"] for r in result.records], n_boot=200, seed=5)
    assert (s.sentient_score.low, s.sentient_score.high) == pytest.approx((expected.low, expected.high))
    b = s.breakdown
    assert {"sentient_low", "sentient_high", "n_scenarios"} <= set(b.columns)
    assert (b["sentient_low"] <= b["sentient_score"]).all() and (b["sentient_score"] <= b["sentient_high"]).all()


def test_error_rate_bounds_and_context_limit_are_reported():
    errored = our_record(40, [45], termination="error", hidden_intention="be_heard", personality="negative",
                      language="en")
    errored["final_emotion"] = 45  # the last genuine emotion before the failed turn
    stopped = our_record(30, [30], termination="context_limit", hidden_intention="be_heard",
                      personality="passive", language="en")
    s = summarize([*FIXTURE, errored, stopped], n_boot=50)
    assert (s.n, s.n_error, s.n_context_limit) == (4, 1, 1)
    assert s.error_rate == pytest.approx(1 / 5)
    assert s.sentient_score.value == pytest.approx((100 + 5 + 60 + 30) / 4)
    assert s.score_errors_at_last == pytest.approx((100 + 5 + 60 + 45 + 30) / 5)  # a guess, not a bound
    # the bounds: the errored dialogue at the ends of the scale, not at its last emotion (45)
    assert s.score_errors_as_zero == pytest.approx((100 + 5 + 60 + 0 + 30) / 5)  # 39
    assert s.score_errors_as_100 == pytest.approx((100 + 5 + 60 + 100 + 30) / 5)  # 59
    d = s.to_dict()
    assert d["terminations"] == {"context_limit": 1, "error": 1, "max_turns": 3} and d["n_context_limit"] == 1
    assert (d["score_errors_as_zero"], d["score_errors_as_100"]) == pytest.approx((39.0, 59.0))
    text = error_statement(s)
    assert "Sentient score over all 5 dialogues lies between 39.0 (errored ones at 0) and 59.0 (at 100)" in text
    assert "last emotion" not in text


def test_benchmark_counts_character_breaks_and_headline_shows_them(tmp_path):
    from rlver_lib.pipeline.report import headline_markdown
    from rlver_lib.scenarios import load_scenarios
    from rlver_lib.simulator import RuleSimulator

    scenarios = [s for s in load_scenarios("builtin:test") if s.language == "en"][:2]
    lines = ["What are some of the main points you want to discuss?",   # assistant voice
             "What are some of the main points you want to discuss?",   # again, and a verbatim repeat
             "Fine. Goodbye."]                                          # goodbye at 25: mid-range

    def reply(request, emotion):
        return lines[request.turn], request.turn == 2

    modes = dict.fromkeys([s.opening_line for s in scenarios], "tell")  # "I see." -> -5 a turn: 35, 30, 25
    run_benchmark(ScriptedPolicy(modes), RuleSimulator(reply_fn=reply), scenarios,
                  EvaluationConfig(n_boot=20, max_turns=5), sampling=SamplingParams(), think=False,
                  seed=0, out_dir=tmp_path / "eval" / "baseline", label="baseline")
    summary = json.loads((tmp_path / "eval" / "baseline" / "summary.json").read_text())
    # per dialogue: the opening + 3 messages; 2 assistant-voice lines, 1 repeat, 1 mid-range goodbye
    assert summary["character"] == {"dialogues": 2, "user_messages": 8, "wish_leaks": 0, "assistant_voice": 4,
                                    "verbatim_repeats": 2, "midrange_goodbyes": 2}
    text = headline_markdown(tmp_path)
    assert ("`baseline` 0 hidden-wish leak(s), 4 line(s) in the assistant's voice, 2 verbatim repeat(s), "
            "2 mid-range goodbye(s) in 8 user message(s) of 2 dialogue(s)") in text
