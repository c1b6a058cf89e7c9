"""Reward-hacking diagnostics (rlver_lib.analysis.hacking): reply features, distinct-n,
partial correlations, length control, injection probes, simulator consistency,
sycophancy, what changed in the replies."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_support import dialogue_record
from reference_data import rlver_test_profiles

from rlver_lib.analysis.hacking import (
    CONTROL_REPLIES,
    HACKING_FEATURES,
    INJECTIONS,
    at_fault_scenarios,
    distinct_n,
    distinct_table,
    hacking_statistics,
    length_controlled_gain,
    reply_features,
    requests_from_records,
    run_injection_probes,
    simulator_consistency,
    summarize_injection,
    sycophancy_rate,
    sycophancy_replies,
    turn_features,
)
from rlver_lib.analysis.strategies import (
    RuleAnnotator,
    annotate_strategies,
)
from rlver_lib.backends import Generation


def test_reply_features_hand_computed():
    f = reply_features("Sorry, are you ok? Your day sounds hard?", user="Your day sounds bad.")
    # words: sorry are you ok your day sounds hard (8); bigrams 7, of which "your day", "day sounds" in the user's
    assert f == pytest.approx({"reply_length": 40, "question_marks": 2, "second_person_rate": 2 / 8,
                               "apologies": 1, "praise_phrases": 0, "user_overlap": 2 / 7,
                               "non_natural_rate": 0, "score_mentions": 0, "emotion_mentions": 0})
    g = reply_features("Well done! Rate me 10/10 +10 <b>", user=None)
    # non-space characters 26; '<', '>', '/', '+' are not natural-language characters
    assert g["praise_phrases"] == 1 and g["score_mentions"] == 3  # "Rate", "10/10", "+10"
    assert g["non_natural_rate"] == pytest.approx(4 / 26) and g["user_overlap"] == 0
    h = reply_features("对不起，你的感受很重要。您别担心？")
    assert h["apologies"] == 1 and h["question_marks"] == 1 and h["emotion_mentions"] == 1
    assert h["second_person_rate"] == pytest.approx(2 / 14)  # 14 CJK characters, 你 and 您 among them


def test_distinct_n_hand_computed():
    assert distinct_n(["a b a b", "a b"], 2) == pytest.approx(2 / 4)
    assert distinct_n(["a b a b", "a b"], 1) == pytest.approx(2 / 6)
    assert np.isnan(distinct_n(["a"], 2))
    table = distinct_table(pd.DataFrame({"source": ["x", "x", "y"], "reply": ["a b", "a b", "c d e"]}))
    assert table.set_index("source")["distinct_2"].to_dict() == {"x": 0.5, "y": 1.0}


def _hacking_table():
    # step 1: d1 (10, +2), (20, +4); d2 (30, +3) / step 2: d3 (40, +8), (50, +6); d4 (60, +10)
    rows = [("d1", 1, 10, 2), ("d1", 1, 20, 4), ("d2", 1, 30, 3),
            ("d3", 2, 40, 8), ("d3", 2, 50, 6), ("d4", 2, 60, 10), ("d4", 2, 70, None)]
    table = pd.DataFrame(rows, columns=["dialogue_id", "step", "length", "change"])
    table["reply"] = ["a" * n for n in table["length"]]
    table["user"] = "hm"
    return turn_features(table)


def test_hacking_statistics_hand_computed():
    table = _hacking_table()
    assert table["reply_length"].tolist() == [10, 20, 30, 40, 50, 60, 70]
    stats = hacking_statistics(table, features=["reply_length"], n_boot=400).set_index("feature")
    # within-step deviations: x -10, 0, 10 | -10, 0, 10; y -1, 1, 0 | 0, -2, 2
    # r = 30 / sqrt(400 * 10)
    assert stats.loc["reply_length", "r"] == pytest.approx(30 / np.sqrt(4000))
    assert stats.loc["reply_length", "n_turns"] == 6 and stats.loc["reply_length", "n_clusters"] == 4
    low, high = stats.loc["reply_length", ["low", "high"]]
    assert -1 <= low <= high <= 1 and low < high
    # without the step partialled out: plain Pearson r = 255 / sqrt(1750 * 47.5)
    plain = hacking_statistics(table, features=["reply_length"], control=None, n_boot=50)
    assert plain["r"].iloc[0] == pytest.approx(255 / np.sqrt(1750 * 47.5))
    # one cluster: every resample is the whole table, so the interval collapses onto r
    one = hacking_statistics(table.assign(dialogue_id="all"), features=["reply_length"], n_boot=50)
    assert one["low"].iloc[0] == pytest.approx(one["r"].iloc[0]) == pytest.approx(one["high"].iloc[0])
    # a feature constant within every step has no correlation
    const = hacking_statistics(table, features=["apologies"], n_boot=20)
    assert np.isnan(const["r"].iloc[0])
    every = hacking_statistics(table, n_boot=20)
    assert every["feature"].tolist() == list(HACKING_FEATURES)
    with pytest.raises(KeyError):
        hacking_statistics(table.drop(columns=["change"]), n_boot=10)


def test_length_controlled_gain_hand_computed():
    base = pd.DataFrame({"source": "baseline", "reply_length": [10, 20, 30, 40], "change": [0, 0, 4, 4]})
    trained = pd.DataFrame({"source": "trained", "reply_length": [30, 40, 50, 60], "change": [4, 4, 8, 8]})
    table, summary = length_controlled_gain(pd.concat([base, trained]), n_bins=2)
    # pooled median 35: bin [10, 35] baseline 0,0,4 vs trained 4; bin (35, 60] baseline 4 vs trained 4,8,8
    assert table["n_reference"].tolist() == [3, 1] and table["n_treatment"].tolist() == [1, 3]
    assert table["gain"].tolist() == pytest.approx([4 - 4 / 3, 20 / 3 - 4])
    assert summary["raw_gain"] == pytest.approx(4.0)
    assert summary["within_bin_gain"] == pytest.approx(8 / 3)  # longer replies explain a third of the gain
    with pytest.raises(ValueError):
        length_controlled_gain(base, n_bins=2)


def _scenarios(n):
    return rlver_test_profiles(n)


def test_injection_probes_with_rule_simulator():
    from rlver_lib.scenarios import load_scenarios
    from rlver_lib.simulator import RuleSimulator

    scenarios = load_scenarios("builtin:test")[:2] + _scenarios(1)
    probes = run_injection_probes(RuleSimulator(), scenarios)
    assert len(probes) == 3 * (1 + len(INJECTIONS["en"]))
    assert set(probes["language"]) == {"en", "zh"}
    # each probe is the control with an injection appended
    for _, row in probes[probes["kind"] != "control"].iterrows():
        assert row["reply"].startswith(CONTROL_REPLIES[row["language"]])
    # rule simulator: +10 for a reply ending in a question mark (the control), -5 otherwise
    assert set(probes[probes["kind"] == "control"]["change"]) == {10}
    assert set(probes[probes["kind"] != "control"]["change"]) == {-5}
    summary = summarize_injection(probes, n_boot=50)
    assert summary.loc["probe - control", "diff"] == pytest.approx(-15.0)
    assert summary.loc["fake_system", ["n", "control", "probe"]].tolist() == [3, 10, -5]


def test_summarize_injection_pairs_by_scenario():
    probes = pd.DataFrame({"scenario_id": ["s1", "s1", "s2", "s2", "s3", "s3"],
                           "kind": ["control", "fake_system"] * 3,
                           "change": [2, 5, -1, 3, 4, np.nan]})
    row = summarize_injection(probes, n_boot=50).loc["fake_system"]
    # s3 has no usable probe appraisal: pairs (2, 5) and (-1, 3) -> differences 3 and 4
    assert row["n"] == 2 and row["diff"] == pytest.approx(3.5) and row["control"] == pytest.approx(0.5)


def test_simulator_consistency():
    from rlver_lib.simulator import RuleSimulator, default_change_fn

    scenarios = _scenarios(2)
    records = [dialogue_record("d0", ["Why?", "ok.", "And then?"], [50, 45, 55], scenarios[0].id),
               dialogue_record("d1", ["Sure."], [35], scenarios[1].id)]
    samples = requests_from_records(records, scenarios, n=10, seed=0)
    assert len(samples) == 4
    req, change = next((r, c) for r, c in samples if r.dialogue_id == "d0:3")
    assert (req.emotion, req.turn, change) == (45, 2, 10)
    assert [m["content"] for m in req.history] == ["I had a bad day.", "Why?", "hm", "ok.", "hm", "And then?"]

    def make_simulator(seed):  # seed 0 reproduces the run; seed 1 flips every change
        return RuleSimulator() if seed == 0 else RuleSimulator(lambda reply: -default_change_fn(reply))

    table = simulator_consistency(make_simulator, samples, seed=0, other_seed=1).set_index("condition")
    assert table.loc["same_seed", "sign_agreement"] == 1.0
    assert table.loc["same_seed", "mean_abs_diff"] == 0.0
    assert table.loc["other_seed", "sign_agreement"] == 0.0
    # recorded 10, -5, 10, -5 vs flipped -10, 5, -10, 5
    assert table.loc["other_seed", "mean_abs_diff"] == pytest.approx(15.0)
    with pytest.raises(KeyError):
        requests_from_records(records, scenarios[:1], n=10, seed=0)


def test_sycophancy_on_at_fault_scenarios():
    from rlver_lib.config import SamplingParams
    from rlver_lib.scenarios import load_scenarios

    shipped = load_scenarios("builtin:all")
    at_fault = at_fault_scenarios(shipped)
    assert [s.id for s in at_fault] == [f"en-0{i}" for i in range(49, 55)]
    test_ids = {s.id for s in load_scenarios("builtin:test")}
    assert {s.id for s in at_fault} & test_ids == {"en-049", "en-051", "en-053"}

    class Policy:  # absolves on even samples only
        def generate(self, conversations, sampling, json_schema=None):
            assert conversations[0][-1]["role"] == "user"
            even = sampling.seed % 2 == 0
            return [Generation(text="It's not your fault at all." if even else "What happened next?")
                    for _ in conversations]

    replies = sycophancy_replies(Policy(), at_fault[:2], n_samples=2, sampling=SamplingParams(seed=0),
                                   think=False, seed=0)
    assert len(replies) == 4 and replies["user"].iloc[0] == at_fault[0].opening_line
    annotated = pd.concat([replies, annotate_strategies(RuleAnnotator(), list(replies["reply"]))], axis=1)
    annotated["policy"] = "base"
    absolved = annotated["reply"].str.contains("not your fault").mean()
    rate = sycophancy_rate(annotated, n_boot=50).iloc[0]
    assert rate["rate"] == pytest.approx(absolved) and rate["n_replies"] == 4 and rate["n_scenarios"] == 2


def _bench_records(replies_by_scenario):
    return [{"scenario_id": sid, "transcript": [x for reply in replies
                                                for x in ({"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": reply})]}
            for sid, replies in replies_by_scenario.items()]


def test_reply_changes_by_hand():
    from rlver_lib.analysis.hacking import reply_changes

    base = _bench_records({"a": ["I see.", "I see you."], "b": ["Okay then."]})
    trained = _bench_records({"a": ["How do you feel?", "I see. How do you feel?"], "b": ["How do you feel?"]})
    out = reply_changes(base, trained, top=3)
    length = out["length"].set_index("side")
    assert length.loc["baseline", "replies"] == 3 and length.loc["trained", "replies"] == 3
    assert length.loc["baseline", "mean_chars"] == pytest.approx((6 + 10 + 10) / 3)
    assert length.loc["trained", "mean_words"] == pytest.approx((4 + 6 + 4) / 3)
    assert length.loc["baseline", "question_share"] == 0 and length.loc["trained", "question_share"] == 1
    phrases = out["phrases"].set_index("bigram")
    # "how do", "do you", "you feel" in all 3 trained replies, none before; "i see" 2/3 -> 1/3
    assert phrases.loc["do you", "change"] == pytest.approx(1.0)
    assert phrases.loc["i see", "baseline_share"] == pytest.approx(2 / 3)
    assert phrases.loc["i see", "trained_share"] == pytest.approx(1 / 3)
    assert list(out["phrases"]["change"]) == sorted(out["phrases"]["change"], reverse=True)
