"""Baseline against trained on the same scenarios (rlver_lib.evaluation.paired)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from evaluation_support import scored

from rlver_lib.evaluation.benchmark import summarize


def test_paired_comparison_by_scenario_and_repeat():
    from rlver_lib.evaluation.paired import paired_comparison
    from rlver_lib.pipeline.report import describe_paired

    baseline = [scored("a", 0, 40), scored("a", 1, 50), scored("b", 0, 30), scored("b", 1, 20),
                scored("c", 0, 60), scored("c", 1, 10, "error"), scored("d", 0, 45), scored("e", 0, 50)]
    trained = [scored("a", 0, 60), scored("a", 1, 55), scored("b", 0, 25), scored("b", 1, 35),
               scored("c", 0, 80), scored("c", 1, 90), scored("d", 0, 45, "error")]
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
    from rlver_lib.files import write_jsonl
    from rlver_lib.pipeline.report import headline_markdown

    # a has two pairs, b and c one each (c's second pair errored on the trained side, last emotion 45)
    records = {"baseline": [scored("a", 0, 40), scored("a", 1, 60), scored("b", 0, 20), scored("c", 0, 10),
                            scored("c", 1, 50)],
               "trained": [scored("a", 0, 70), scored("a", 1, 90), scored("b", 0, 30), scored("c", 0, 0),
                           scored("c", 1, 45, "error")]}
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
