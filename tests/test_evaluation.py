"""Sentient benchmark figures, bootstrap intervals, SAGE scoring and maths retention."""

from __future__ import annotations

import hashlib as _hashlib
import http.server as _http_server
import json
import threading as _threading
from contextlib import contextmanager as _contextmanager
from pathlib import Path as _Path
from types import SimpleNamespace as _NS

import numpy as np
import pandas as pd
import pytest
from reference_data import reference_file, rlver_test_profiles

from rlver_lib.backends import Generation, close_backend
from rlver_lib.config import EvaluationConfig, SamplingParams
from rlver_lib.evaluation.benchmark import BREAKDOWN_FACTORS, run_benchmark, summarize
from rlver_lib.evaluation.sage import sage_score, sage_score_command
from rlver_lib.evaluation.stage import error_statement
from rlver_lib.files import iter_jsonl
from rlver_lib.records import RecordError
from rlver_lib.stats import bootstrap_ci

# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_matches_hand_computed_percentiles():
    values = np.array([3.0, 7.0, 1.0, 9.0, 5.0])
    est = bootstrap_ci(values, n_boot=7, confidence=0.9, seed=3)
    idx = np.random.default_rng(3).integers(0, 5, size=(7, 5))
    means = sorted(values[row].mean() for row in idx)
    # 5th / 95th percentile of 7 sorted means, linear interpolation: positions 0.3 and 5.7
    low = means[0] + 0.3 * (means[1] - means[0])
    high = means[5] + 0.7 * (means[6] - means[5])
    assert est.value == pytest.approx(5.0)
    assert (est.low, est.high) == pytest.approx((low, high))
    assert bootstrap_ci(values, n_boot=7, confidence=0.9, seed=3) == est


def test_bootstrap_degenerate_and_errors():
    est = bootstrap_ci([42.0] * 6, n_boot=50, seed=1)
    assert (est.value, est.low, est.high) == (42.0, 42.0, 42.0)
    with pytest.raises(ValueError):
        bootstrap_ci([], n_boot=10)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, np.nan], n_boot=10)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, 2.0], confidence=1.5)


def test_bootstrap_covers_known_mean_about_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    trials = 200
    for t in range(trials):
        sample = rng.normal(10.0, 2.0, size=60)
        est = bootstrap_ci(sample, n_boot=400, seed=t)
        hits += est.low <= 10.0 <= est.high
    assert 0.88 <= hits / trials <= 0.99


# --------------------------------------------------------------------------- summaries


def _record(final, emotions, **extra):
    """One of our records: opening, then per emotion an assistant and a user entry."""
    turns = [{"role": "user", "content": "hello"}]
    before = 40
    for e in emotions:
        turns += [{"role": "assistant", "content": "reply"},
                  {"role": "user", "content": "ok", "change": e - before, "emotion_before": before, "emotion": e}]
        before = e
    return {"dialogue_id": f"d{final}", "scenario_id": "s", "initial_emotion": 40, "turns": turns,
            "final_emotion": final, "reward": final / 100, "termination": "max_turns", **extra}


FIXTURE = [
    _record(100, [70, 100], hidden_intention="be_heard", personality="negative", language="en"),
    _record(5, [5], hidden_intention="be_heard", personality="passive", language="zh"),
    _record(60, [50, 55, 60], hidden_intention="deep_empathy", personality="negative", language="en"),
]


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
    errored = _record(40, [], termination="error", hidden_intention="be_heard", personality="negative",
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


# --------------------------------------------------------------------------- SAGE


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


# --------------------------------------------------------------------------- benchmark run


class ScriptedPolicy:
    """Replies by scenario (keyed on the opening line): ``ask`` always ends with a
    question, ``tell`` never does, ``alternate`` asks on odd policy turns."""

    def __init__(self, mode_by_opening):
        self.mode_by_opening = mode_by_opening

    def generate(self, conversations, sampling, json_schema=None):
        out = []
        for conv in conversations:
            opening = next(m["content"] for m in conv if m["role"] == "user")
            mode = self.mode_by_opening[opening]
            n_prev = sum(m["role"] == "assistant" for m in conv)
            ask = mode == "ask" or (mode == "alternate" and n_prev % 2 == 0)
            out.append(Generation(text="How do you feel about it?" if ask else "I see."))
        return out


def test_run_benchmark_with_rule_simulator(tmp_path):
    from rlver_lib.simulator import RuleSimulator

    scenarios = rlver_test_profiles(3)
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    result = run_benchmark(ScriptedPolicy(modes), RuleSimulator(), scenarios,
                           EvaluationConfig(bootstrap_samples=50), sampling=SamplingParams(),
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


# --------------------------------------------------------------------------- judge, protocols, errors, pairing


def _three_scenarios():
    return rlver_test_profiles(3)


def test_sage_protocol_appraises_nine_of_ten_replies(tmp_path):
    from rlver_lib.simulator import RuleSimulator

    scenarios = _three_scenarios()
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    cfg = EvaluationConfig(bootstrap_samples=50, protocol="sage")
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
    assert capped["transcript"][-1]["content"] == "I see."  # the 10th reply (an even turn: no question)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["protocol"] == {"name": "sage", "initial_emotion": 40, "max_policy_turns": 10,
                                   "appraised_turns": 9, "repeats": 1}
    assert summary["sentient_score"]["value"] == pytest.approx(175 / 3)
    row = sage_score([tmp_path / "dialogues.jsonl"]).iloc[0]
    assert row["protocol"] == "sage" and (row["policy_replies"], row["appraised_replies"]) == (6 + 7 + 10, 6 + 7 + 9)
    with pytest.raises(ValueError, match="sage"):
        EvaluationConfig(protocol="sage", max_turns=4)


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


def test_repeats_have_their_own_ids_and_seeds_and_intervals_resample_scenarios(tmp_path):
    from rlver_lib.simulator import RuleSimulator
    from rlver_lib.stats import cluster_bootstrap_ci

    scenarios = _three_scenarios()
    modes = dict(zip([s.opening_line for s in scenarios], ["ask", "tell", "alternate"]))
    cfg = EvaluationConfig(bootstrap_samples=200, repeats=2, max_turns=3)
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
    errored = _record(40, [45], termination="error", hidden_intention="be_heard", personality="negative",
                      language="en")
    errored["final_emotion"] = 45  # the last genuine emotion before the failed turn
    stopped = _record(30, [30], termination="context_limit", hidden_intention="be_heard",
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


def _scored(sid, repeat, final, termination="max_turns"):
    return {"dialogue_id": f"{sid}#{repeat}", "scenario_id": sid, "repeat": repeat, "initial_emotion": 40,
            "turns": [], "final_emotion": final, "termination": termination}


def test_paired_comparison_by_scenario_and_repeat():
    from rlver_lib.evaluation.paired import describe_paired, paired_comparison

    baseline = [_scored("a", 0, 40), _scored("a", 1, 50), _scored("b", 0, 30), _scored("b", 1, 20),
                _scored("c", 0, 60), _scored("c", 1, 10, "error"), _scored("d", 0, 45), _scored("e", 0, 50)]
    trained = [_scored("a", 0, 60), _scored("a", 1, 55), _scored("b", 0, 25), _scored("b", 1, 35),
               _scored("c", 0, 80), _scored("c", 1, 90), _scored("d", 0, 45, "error")]
    pc = paired_comparison(baseline, trained, n_boot=9, confidence=0.8, seed=2)
    # per scenario: a: (20 + 5) / 2 = 12.5; b: (-5 + 15) / 2 = 5; c: one pair left, 20; d: errored; e: missing
    table = pc.table.set_index("scenario_id")
    assert table["diff"].to_dict() == pytest.approx({"a": 12.5, "b": 5.0, "c": 20.0})
    assert table["n_pairs"].to_dict() == {"a": 2, "b": 2, "c": 1}
    assert (pc.n_pairs, pc.n_dropped, pc.n_dropped_error, pc.n_dropped_missing) == (5, 3, 2, 1)
    d = np.array([12.5, 5.0, 20.0])
    assert pc.difference.mean_diff == pytest.approx(d.mean())
    idx = np.random.default_rng(2).integers(0, 3, size=(9, 3))
    assert (pc.difference.ci_low, pc.difference.ci_high) == pytest.approx(
        tuple(np.percentile(d[idx].mean(axis=1), [10, 90])))
    assert pc.difference.p_value == pytest.approx(2 / 8)  # all 3 positive: 2 of 8 sign patterns as extreme
    assert pc.difference.p_method == "exact, all 2^3 = 8 sign patterns"
    # weighted like mean_diff: means of the per-scenario means a 45 / 57.5, b 25 / 30, c 60 / 80
    assert pc.baseline_score == pytest.approx((45 + 25 + 60) / 3)
    assert pc.trained_score == pytest.approx((57.5 + 30 + 80) / 3)
    # errored pairs back at the bounds. low: c#1 baseline 100 vs trained 90, d#0 baseline 45 vs trained 0;
    # per scenario a 12.5, b 5, c (80 + 90) / 2 - (60 + 100) / 2 = 5, d -45 -> mean -22.5 / 4
    assert pc.errors_low.mean_diff == pytest.approx(-5.625) and pc.errors_low.n_scenarios == 4
    # high: c#1 baseline 0 vs 90 (c: 85 - 30 = 55), d#0 45 vs 100 (d: 55) -> (12.5 + 5 + 55 + 55) / 4
    assert pc.errors_high.mean_diff == pytest.approx(31.875)
    # low [12.5, 5, 5, -45]: 45 > 12.5 + 5 + 5, every one of the 16 patterns reaches |sum| >= 22.5
    # high [12.5, 5, 55, 55]: only the all-plus and all-minus patterns reach 127.5
    assert (pc.errors_low.p_value, pc.errors_high.p_value) == (1.0, 2 / 16)
    out = pc.to_dict()
    assert {"mean_diff", "ci_low", "ci_high", "n_scenarios", "p_value", "p_method"} <= set(out)
    assert out["n_scenarios"] == 3 and (out["n_dropped_error"], out["n_dropped_missing"]) == (2, 1)
    assert out["errors_low"]["mean_diff"] == pytest.approx(-5.625) and "at 0 and at 100" in out["error_bound_rule"]
    assert "exact, all 2^3 = 8 sign patterns" in out["test"]
    text = describe_paired(pc)
    assert "+12.5 emotion points over 3 scenario(s)" in text
    assert "5 pairs; 2 dropped as errored on either side, 1 as missing on one side" in text
    assert "sign-flip p = 0.25 (exact, all 2^3 = 8 sign patterns)" in text
    assert "it lies between -5.6" in text and "and +31.9" in text
    # nothing errored: no bounds to show
    clean = paired_comparison(baseline[:4], trained[:4], n_boot=9)
    assert clean.errors_low is None and clean.n_dropped == 0 and "lies between" not in describe_paired(clean)


def test_headline_scores_subtract_to_the_paired_difference(tmp_path):
    from rlver_lib.evaluation.benchmark import write_summary
    from rlver_lib.evaluation.paired import write_paired
    from rlver_lib.evaluation.stage import headline_markdown
    from rlver_lib.files import write_jsonl

    # a has two pairs, b and c one each (c's second pair errored on the trained side, last emotion 45)
    records = {"baseline": [_scored("a", 0, 40), _scored("a", 1, 60), _scored("b", 0, 20), _scored("c", 0, 10),
                            _scored("c", 1, 50)],
               "trained": [_scored("a", 0, 70), _scored("a", 1, 90), _scored("b", 0, 30), _scored("c", 0, 0),
                           _scored("c", 1, 45, "error")]}
    for label, recs in records.items():
        write_jsonl(tmp_path / "eval" / label / "dialogues.jsonl", recs)
        write_summary(summarize(recs, n_boot=20), tmp_path / "eval" / label, label,
                      {"judge": {"backend": "rule"}, "protocol": {"name": "full", "initial_emotion": 40}})
    pc = write_paired(tmp_path, n_boot=50)
    paired = json.loads((tmp_path / "eval" / "paired.json").read_text())
    # per scenario a 50 -> 80, b 20 -> 30, c 10 -> 0: diffs +30, +10, -10, mean +10
    # (weighting by dialogue instead would give 47.5 - 32.5 = 15)
    assert paired["mean_diff"] == pytest.approx(10.0)
    assert (paired["baseline_score"], paired["trained_score"]) == pytest.approx((80 / 3, 110 / 3))
    assert paired["trained_score"] - paired["baseline_score"] == pytest.approx(paired["mean_diff"], abs=1e-12)
    assert pc.trained_score - pc.baseline_score == pytest.approx(pc.difference.mean_diff, abs=1e-12)
    text = headline_markdown(tmp_path)
    assert "**+10.0 emotion points**" in text and "4 dialogue pair(s); 1 dropped as errored" in text
    assert "Baseline 26.67 → trained 36.67" in text and "(trained minus baseline = +10.00)" in text
    # diffs [30, 10, -10]: signed sums +-50, +-30, +-30, +-10; six of the 8 reach |30|
    assert "permutation p = 0.75 (exact, all 2^3 = 8 sign patterns)" in text
    # c#1 back at the bounds: low c 30 -> 0 (-30), high c 30 -> 50 (+20): (30 + 10 - 30) / 3 and (30 + 10 + 20) / 3
    assert "change between +3.3" in text and "and +20.0" in text
    # the trained summary: 4 scored of 5, the errored one at 0 / 100: (70 + 90 + 30 + 0 + 0) / 5, (... + 100) / 5
    assert "lies in [38.0, 58.0] (errored ones at 0 / at 100)" in text


def test_mixed_judges_are_refused():
    from rlver_lib.evaluation.judge import JudgeMismatchError, check_same_judge

    proto = {"name": "full", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 10, "repeats": 1}
    moderate = {"backend": "llamacpp", "model": "m", "difficulty": "moderate", "seed": 0}
    check_same_judge({"x": {"judge": moderate, "protocol": proto}, "y": {"judge": dict(moderate), "protocol": proto}})
    with pytest.raises(JudgeMismatchError, match=r"judge\.difficulty: x='moderate' vs y='hard'"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto},
                          "y": {"judge": {**moderate, "difficulty": "hard"}, "protocol": proto}})
    with pytest.raises(JudgeMismatchError, match="protocol.name"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto},
                          "y": {"judge": moderate, "protocol": {**proto, "name": "sage"}}})
    with pytest.raises(JudgeMismatchError, match="no judge and protocol recorded for old"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto}, "old": {"sentient_score": {}}})


def test_evaluate_uses_the_judge_not_the_training_simulator(tmp_path, monkeypatch):
    from rlver_lib.config import build_config
    from rlver_lib.evaluation.stage import evaluate, headline_markdown

    scenarios = _three_scenarios()
    openings = [s.opening_line for s in scenarios]
    policies = {"baseline": ScriptedPolicy(dict(zip(openings, ["tell", "tell", "alternate"]))),
                "trained": ScriptedPolicy(dict(zip(openings, ["ask", "alternate", "ask"])))}
    current = {}
    monkeypatch.setattr("rlver_lib.evaluation.stage.load_policy", lambda cfg: (None, None))
    monkeypatch.setattr("rlver_lib.evaluation.stage.make_policy_backend", lambda cfg, m, t: policies[current["label"]])
    cfg = build_config({
        "output_root": str(tmp_path), "run_name": "r",
        # a hard LLM training simulator that must not be built: its model file does not exist
        "simulator": {"backend": "llamacpp", "model": str(tmp_path / "none.gguf"), "difficulty": "hard"},
        "scenarios": {"test": str(reference_file("rlver_profiles", "test_profile.jsonl")), "limit_test": 3},
        "evaluation": {"judge": {"backend": "rule"}, "max_turns": 4, "bootstrap_samples": 50},
        "capability": {"enabled": False},
    })
    for label in ("baseline", "trained"):
        current["label"] = label
        ev = evaluate(cfg, label=label)
    summary = json.loads((tmp_path / "r" / "eval" / "trained" / "summary.json").read_text())
    assert summary["judge"] == {"backend": "rule", "change_function": "default_change_fn"}
    assert summary["protocol"]["name"] == "full"
    paired = json.loads((tmp_path / "r" / "eval" / "paired.json").read_text())
    # 4 turns from 40: tell -> 20, alternate -> 50, ask -> 80
    base = {"tell": 20, "alternate": 50, "ask": 80}
    expected = [base[b] - base[a] for a, b in zip(["tell", "tell", "alternate"], ["ask", "alternate", "ask"])]
    assert paired["mean_diff"] == pytest.approx(np.mean(expected)) and paired["n_scenarios"] == 3
    assert ev.paired is not None and ev.paired.difference.mean_diff == pytest.approx(paired["mean_diff"])
    text = headline_markdown(tmp_path / "r", wall_s=125.0)
    assert text.startswith("## Headline") and f"{np.mean(expected):+.1f} emotion points" in text
    assert "n = 3 scenarios &lt; 10" in text or "n = 3 scenarios < 10" in text
    assert "rule simulator" in text and "Protocol: `full`" in text and "2.1 min" in text


def test_headline_shows_intervals_from_ten_scenarios_on(tmp_path):
    from rlver_lib.evaluation.benchmark import write_summary
    from rlver_lib.evaluation.paired import write_paired
    from rlver_lib.evaluation.stage import headline_markdown
    from rlver_lib.files import write_jsonl

    proto = {"name": "sage", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 9, "repeats": 1}
    judge = {"backend": "openai", "model": "judge-7b", "base_url": "http://h/v1", "difficulty": "moderate",
             "temperature": 0.7, "seed": 3}
    for label in ("baseline", "trained"):
        records = [_scored(f"s{i}", 0, 30 + 2 * i + ((6 if i % 4 else -2) if label == "trained" else 0))
                   for i in range(12)]
        write_jsonl(tmp_path / "eval" / label / "dialogues.jsonl", records)
        write_summary(summarize(records, n_boot=100), tmp_path / "eval" / label, label,
                      {"judge": judge, "protocol": proto})
    pc = write_paired(tmp_path, n_boot=200)
    # 9 scenarios +6, 3 scenarios -2: mean (54 - 6) / 12 = 4
    assert pc.difference.mean_diff == pytest.approx(4.0) and pc.difference.n_scenarios == 12
    text = headline_markdown(tmp_path)
    assert "+4.0 emotion points" in text and "not evidence" not in text and "color:#888" not in text
    assert f"[{pc.difference.ci_low:+.1f}, {pc.difference.ci_high:+.1f}]" in text
    assert "`judge-7b` through `openai` at http://h/v1, moderate difficulty" in text
    assert "Protocol: `sage`" in text and "SAGE's 100 test profiles" in text


def test_benchmark_counts_character_breaks_and_headline_shows_them(tmp_path):
    from rlver_lib.evaluation.stage import headline_markdown
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
                  EvaluationConfig(bootstrap_samples=20, max_turns=5), sampling=SamplingParams(), think=False,
                  seed=0, out_dir=tmp_path / "eval" / "baseline", label="baseline")
    summary = json.loads((tmp_path / "eval" / "baseline" / "summary.json").read_text())
    # per dialogue: the opening + 3 messages; 2 assistant-voice lines, 1 repeat, 1 mid-range goodbye
    assert summary["character"] == {"dialogues": 2, "user_messages": 8, "wish_leaks": 0, "assistant_voice": 4,
                                    "verbatim_repeats": 2, "midrange_goodbyes": 2}
    text = headline_markdown(tmp_path)
    assert ("`baseline` 0 hidden-wish leak(s), 4 line(s) in the assistant's voice, 2 verbatim repeat(s), "
            "2 mid-range goodbye(s) in 8 user message(s) of 2 dialogue(s)") in text


# =========================================================================== judge identity
# (issue 21, point 2: every sampling setting, the field caps, n_ctx, the prompt files and
# schemas actually used, and the model behind a served alias are part of a judge's identity)


_PROMPTS = _Path(__file__).resolve().parents[1] / "rlver_lib" / "prompts"


def _judge_ns(**overrides):
    """A judge config as a plain namespace: works whatever fields the pydantic config has today."""
    fields = {"backend": "openai", "model": "judge-alias", "base_url": "http://judge.invalid/v1",
              "api_key_env": "OPENAI_API_KEY", "difficulty": "moderate", "initial_emotion": 40,
              "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.1,
              "presence_penalty": 0.3, "frequency_penalty": -0.2, "max_new_tokens": 512, "max_retries": 3,
              "timeout_s": 180.0, "concurrency": 64, "n_threads": None, "n_ctx": 8192, "appraisal_chars": 1200,
              "message_chars": 900, "appraisal": "sage", "seed": None}
    fields.update(overrides)
    return _NS(**fields)


def _sha_of_files(names):
    digest = _hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode() + b"\0" + (_PROMPTS / name).read_bytes() + b"\0")
    return digest.hexdigest()


def test_judge_description_records_every_sampling_setting_cap_and_n_ctx(monkeypatch):
    from rlver_lib.evaluation.judge import judge_description

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    d = judge_description(_judge_ns(), seed=11)
    assert {k: d[k] for k in ("backend", "model", "base_url", "difficulty", "appraisal", "temperature", "top_p",
                              "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                              "max_new_tokens", "n_ctx", "appraisal_chars", "message_chars", "seed")} == {
        "backend": "openai", "model": "judge-alias", "base_url": "http://judge.invalid/v1", "difficulty": "moderate",
        "appraisal": "sage", "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.1,
        "presence_penalty": 0.3, "frequency_penalty": -0.2, "max_new_tokens": 512, "n_ctx": 8192,
        "appraisal_chars": 1200, "message_chars": 900, "seed": 11}
    # settings that do not change an answer are not identity; nothing was asked of a server
    assert not {"max_retries", "timeout_s", "concurrency", "n_threads", "api_key_env", "initial_emotion",
                "served"} & set(d)
    assert d == judge_description(_judge_ns(concurrency=2, timeout_s=5.0, max_retries=0), seed=11)
    for key, value in {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "top_p": 1.0, "n_ctx": 4096, "message_chars": 400}.items():
        assert judge_description(_judge_ns(**{key: value}), seed=11)[key] == value
        assert judge_description(_judge_ns(**{key: value}), seed=11) != d, key


def test_judge_description_reads_missing_fields_with_defaults(monkeypatch):
    """A config written before the sampling fields and the appraisal mode existed (or one
    spelling llama.cpp's ``repeat_penalty``) is still described."""
    from rlver_lib.evaluation.judge import judge_description

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    old = _judge_ns()
    for name in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "appraisal"):
        delattr(old, name)
    d = judge_description(old, seed=0)
    assert (d["top_p"], d["top_k"], d["min_p"], d["repetition_penalty"], d["presence_penalty"],
            d["frequency_penalty"], d["appraisal"]) == (1.0, 0, 0.0, 1.0, 0.0, 0.0, "first_person")
    spelled = _judge_ns(repeat_penalty=1.3)
    delattr(spelled, "repetition_penalty")
    assert judge_description(spelled, seed=0)["repetition_penalty"] == 1.3
    # the real config, before or after its sampling fields were added
    from rlver_lib.config import JudgeConfig

    cfg = JudgeConfig(backend="openai", base_url="http://h/v1", model="m")
    d = judge_description(cfg, seed=0)
    assert d["top_k"] == getattr(cfg, "top_k", 0) and d["min_p"] == getattr(cfg, "min_p", 0.0)
    assert d["n_ctx"] == cfg.n_ctx and d["appraisal_chars"] == cfg.appraisal_chars


def test_judge_description_expected_settings_only_for_the_expected_appraisal(monkeypatch):
    from rlver_lib.evaluation.judge import judge_description

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    extra = {"expected_center": 0.6, "expected_scale": 30.0, "expected_answer_order": "no_yes"}
    sage = judge_description(_judge_ns(appraisal="sage", **extra), seed=0)
    assert not any(k.startswith("expected_") for k in sage)
    expected = judge_description(_judge_ns(appraisal="expected", **extra), seed=0)
    assert {k: expected[k] for k in extra} == extra
    from rlver_lib.simulator import UserSimulator

    assert expected["expected_top_logprobs"] == UserSimulator.TOP_N
    assert expected["expected_difficulty_shift"] == 0.0  # moderate
    hard = judge_description(_judge_ns(appraisal="expected", difficulty="hard", **extra), seed=0)
    assert hard["expected_difficulty_shift"] > 0  # a harsh user needs a clearer "yes"


def test_judge_prompt_fingerprint_covers_the_files_of_its_mode_and_difficulty(monkeypatch):
    from rlver_lib import simulator
    from rlver_lib.evaluation.judge import judge_description

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    sage = judge_description(_judge_ns(appraisal="sage"), seed=0)
    files = set(sage["prompt_files"])
    assert {"sim_appraise_sage_en.txt", "sim_appraise_sage_zh.txt", "sim_difficulty_moderate_sage_en.txt",
            "sim_difficulty_moderate_sage_zh.txt", "sim_system_en.txt", "sim_system_zh.txt", "sim_vocab_en.json",
            "sim_vocab_zh.json", "sim_reply_en.txt", "sim_reply_zh.txt", "sim_opening_en.txt",
            "sim_opening_zh.txt"} <= files
    assert not files & {"sim_appraise_en.txt", "sim_appraise_zh.txt", "sim_difficulty_moderate_en.txt",
                        "sim_difficulty_hard_sage_en.txt", "sim_difficulty_easy_sage_zh.txt",
                        "sim_checklist_en.json"}
    assert sage["prompts_sha256"] == _sha_of_files(sage["prompt_files"])
    first = judge_description(_judge_ns(appraisal="first_person"), seed=0)
    assert {"sim_appraise_en.txt", "sim_difficulty_moderate_en.txt"} <= set(first["prompt_files"])
    assert not {n for n in first["prompt_files"] if "_sage_" in n or n.startswith("sim_checklist_")}
    assert first["prompts_sha256"] == _sha_of_files(first["prompt_files"]) != sage["prompts_sha256"]
    expected = judge_description(_judge_ns(appraisal="expected"), seed=0)
    assert {"sim_checklist_en.json", "sim_checklist_zh.json", "sim_system_en.txt"} <= set(expected["prompt_files"])
    assert not {n for n in expected["prompt_files"] if n.startswith(("sim_appraise_", "sim_difficulty_"))}
    hard = judge_description(_judge_ns(appraisal="sage", difficulty="hard"), seed=0)
    assert "sim_difficulty_hard_sage_en.txt" in hard["prompt_files"]
    assert hard["prompts_sha256"] != sage["prompts_sha256"]
    # the simulator's own list is what is recorded
    assert sage["prompt_files"] == simulator.prompt_files(_judge_ns(appraisal="sage"))


def test_judge_schema_fingerprint_is_the_schemas_built_in_code(monkeypatch):
    from rlver_lib import simulator
    from rlver_lib.evaluation.judge import judge_description

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    # the reply schema follows the field caps, so a cap is part of the fingerprint
    assert (judge_description(_judge_ns(message_chars=300), seed=0)["schemas_sha256"]
            != judge_description(_judge_ns(message_chars=301), seed=0)["schemas_sha256"])
    first = judge_description(_judge_ns(appraisal="first_person", appraisal_chars=50), seed=0)
    built = {"appraise": simulator.appraisal_schema(50), "reply": simulator.reply_schema(50, 900),
             "opening": simulator.OPENING_SCHEMA}
    text = json.dumps(built, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert first["schemas_sha256"] == _hashlib.sha256(text.encode("utf-8")).hexdigest()
    sage = judge_description(_judge_ns(appraisal="sage", appraisal_chars=50), seed=0)
    assert sage["schemas_sha256"] != first["schemas_sha256"]  # the same caps, SAGE's five-value scale
    expected = judge_description(_judge_ns(appraisal="expected", appraisal_chars=50), seed=0)
    built = {"reply": simulator.reply_schema(50, 900, reasoning=False), "opening": simulator.OPENING_SCHEMA}
    text = json.dumps(built, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert expected["schemas_sha256"] == _hashlib.sha256(text.encode("utf-8")).hexdigest()


@_contextmanager
def _stub_server(routes):
    """A loopback HTTP server answering GET ``path`` with ``routes[path]`` as JSON, else 404."""

    class Handler(_http_server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = routes.get(self.path)
            payload = json.dumps(body).encode() if body is not None else b'{"error": "not found"}'
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = _http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = _threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_judge_server_identity_tolerates_404_and_keeps_what_names_the_weights():
    from conftest import free_port

    from rlver_lib.evaluation.judge import served_model_identity

    vllm_like = {"object": "list", "data": [
        {"id": "simulator", "object": "model", "created": 1712345678, "owned_by": "vllm",
         "root": "deepseek-ai/DeepSeek-V3", "parent": None, "max_model_len": 16384,
         "permission": [{"id": "modelperm-abc", "created": 1712345678}]},
        {"id": "judge", "object": "model", "created": 1712345678, "owned_by": "vllm",
         "root": "deepseek-ai/DeepSeek-V3", "parent": None, "max_model_len": 16384}]}
    with _stub_server({"/v1/models": vllm_like}) as url:
        got = served_model_identity(url + "/v1", 5, model="simulator")
        assert got == {"models": [{"id": "simulator", "owned_by": "vllm", "root": "deepseek-ai/DeepSeek-V3",
                                   "parent": None, "max_model_len": 16384}],
                       "model_listed": True, "props_error": "HTTP 404"}
        unknown = served_model_identity(url, 5, model="no-such-alias")
        assert unknown["model_listed"] is False and [m["id"] for m in unknown["models"]] == ["simulator", "judge"]
    with _stub_server({}) as url:
        assert served_model_identity(url, 5) == {"models_error": "HTTP 404", "props_error": "HTTP 404"}
    assert served_model_identity(f"http://127.0.0.1:{free_port()}", 2) == {"models_error": "ConnectError",
                                                                          "props_error": "ConnectError"}


def test_judge_server_identity_of_a_real_llama_server(openai_server):
    from rlver_lib.evaluation.judge import served_model_identity
    from rlver_lib.models import smollm2_gguf_path

    got = served_model_identity(openai_server, 30, model="smollm2")
    assert got["model_listed"] is True and [m["id"] for m in got["models"]] == ["smollm2"]
    assert "created" not in got["models"][0]
    props = got["props"]
    assert props["model_path"] == str(smollm2_gguf_path())
    assert props["default_generation_settings"]["n_ctx"] == 2048  # the fixture's context per slot
    assert len(props["chat_template_sha256"]) == 64
    # the same answer through the /v1 root and on a second call: nothing volatile is kept
    assert served_model_identity(openai_server + "/v1", 30, model="smollm2") == got


def test_build_judge_records_the_model_behind_the_alias(openai_server, monkeypatch):
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import (
        build_judge,
        judge_description,
        judge_name,
        served_model_identity,
    )
    from rlver_lib.models import smollm2_gguf_path

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    eval_cfg = EvaluationConfig(judge=JudgeConfig(backend="openai", base_url=openai_server + "/v1", model="smollm2",
                                                  concurrency=1))
    before = judge_description(eval_cfg.judge, seed=4)
    assert "served" not in before
    judge = build_judge(eval_cfg, run_seed=4)
    try:
        assert judge.served_model == served_model_identity(openai_server, 30, model="smollm2")
        described = judge_description(eval_cfg.judge, seed=4)
        assert described["served"] == judge.served_model
        assert {k: v for k, v in described.items() if k != "served"} == before
        assert described["served"]["props"]["model_path"] == str(smollm2_gguf_path())
        name = judge_name(described)
        assert f"`smollm2` (serving `{smollm2_gguf_path().name}`) through `openai` at {openai_server}/v1" in name
        assert "top_k" in name and "min_p" in name and "seed 4" in name
    finally:
        close_backend(judge)


def test_build_judge_asks_the_llama_server_it_started(monkeypatch):
    """A ``llamacpp`` judge: the server the backend started on a free port is asked."""
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import build_judge, judge_description
    from rlver_lib.models import EMBEDDED_POLICY, smollm2_gguf_path

    monkeypatch.setattr("rlver_lib.evaluation.judge._SERVED", {})
    eval_cfg = EvaluationConfig(judge=JudgeConfig(backend="llamacpp", model=EMBEDDED_POLICY, concurrency=1,
                                                  n_ctx=1024, n_threads=1))
    judge = build_judge(eval_cfg, run_seed=0)
    try:
        served = judge_description(eval_cfg.judge, seed=0)["served"]
        assert served["model_listed"] is True
        assert [m["id"] for m in served["models"]] == [smollm2_gguf_path().stem]  # the backend's alias
        assert served["props"]["model_path"] == str(smollm2_gguf_path())
        assert served["props"]["default_generation_settings"]["n_ctx"] == 1024
    finally:
        close_backend(judge)


def test_check_same_judge_names_nested_served_and_sampling_differences():
    from rlver_lib.evaluation.judge import JudgeMismatchError, check_same_judge

    proto = {"name": "full", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 10, "repeats": 1}
    judge = {"backend": "openai", "model": "simulator", "top_k": 0, "seed": 0,
             "served": {"models": [{"id": "simulator", "root": "Qwen/Qwen2.5-72B-Instruct"}],
                        "props": {"model_path": "/m/a.gguf"}}}
    check_same_judge({"x": {"judge": judge, "protocol": proto},
                      "y": {"judge": json.loads(json.dumps(judge)), "protocol": proto}})
    other = {**judge, "top_k": 40, "served": {**judge["served"], "props": {"model_path": "/m/b.gguf"}}}
    with pytest.raises(JudgeMismatchError) as err:
        check_same_judge({"x": {"judge": judge, "protocol": proto}, "y": {"judge": other, "protocol": proto}})
    assert "judge.top_k: x=0 vs y=40" in str(err.value)
    assert "judge.served.props.model_path: x='/m/a.gguf' vs y='/m/b.gguf'" in str(err.value)
    unserved = {k: v for k, v in judge.items() if k != "served"}
    with pytest.raises(JudgeMismatchError, match=r"judge\.served\.props\.model_path: x='/m/a\.gguf' vs y=None"):
        check_same_judge({"x": {"judge": judge, "protocol": proto}, "y": {"judge": unserved, "protocol": proto}})
