"""A run's files as tidy tables (rlver_lib.analysis.runs): training dialogues, metrics,
evaluations, curves with scenario-resampled intervals, replies to annotate."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from rlver_lib.analysis.runs import (
    compare_runs,
    curve_with_ci,
    load_eval,
    load_metrics,
    load_training_dialogues,
    pooled_over_seeds,
    rates_over_training,
    run_replies,
    sample_replies,
)


def test_run_tables_and_compare_runs(runs):
    dialogues = load_training_dialogues(runs[0])
    assert dialogues.groupby("step")["final_emotion"].apply(list).to_dict() == {1: [50, 45], 2: [60, 70]}
    assert dialogues["reply_length"].tolist() == [4.0] * 4
    turns = load_training_dialogues(runs[0], turns=True)
    assert turns[["turn", "user", "reply", "change"]].iloc[0].tolist() == [1, "I had a bad day.", "Why?", 10]
    assert load_metrics(runs[1])["reward_mean"].tolist() == [0.475, 0.65]
    ev = load_eval(runs[0])
    assert set(ev["label"]) == {"baseline", "trained"} and len(ev) == 8
    table = compare_runs(runs)
    assert table[["run", "training.algorithm", "policy.think", "simulator.difficulty"]].values.tolist() == [
        ["ppo-think", "ppo", True, "moderate"], ["grpo-nothink", "grpo", False, "hard"]]
    assert table["sentient_score"].tolist() == [70.0, 50.0]
    assert table["baseline_score"].tolist() == [20.0, 20.0]
    assert table["final_train_reward"].tolist() == pytest.approx([0.65, 0.65])


def test_curve_with_ci_and_rates(runs):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    curves = curve_with_ci(dialogues, "reward", n_boot=50)
    step1 = curves[(curves["run"] == "ppo-think") & (curves["step"] == 1)].iloc[0]
    assert step1["mean"] == pytest.approx(0.475) and step1["n"] == 2
    assert 0.45 <= step1["low"] <= step1["mean"] <= step1["high"] <= 0.5
    rates = rates_over_training(dialogues.assign(success=[True, False, False, False] * 2))
    assert rates[(rates["outcome"] == "success") & (rates["step"] == 1)]["rate"].tolist() == [0.5, 0.5]


def _grpo_table():
    # step 1: scenario a's replicas 0.2, 0.4 (mean 0.3), b's 0.6, 0.8 (mean 0.7); step 2: one scenario
    return pd.DataFrame({"run": "r", "step": [1, 1, 1, 1, 2, 2], "reward": [0.2, 0.4, 0.6, 0.8, 0.5, 0.9],
                         "scenario_id": ["a", "a", "b", "b", "a", "a"]})


def test_curve_with_ci_resamples_scenarios_not_dialogues():
    curves = curve_with_ci(_grpo_table(), "reward", n_boot=6, confidence=0.5, seed=4)
    assert list(curves.columns) == ["run", "step", "mean", "low", "high", "n", "n_clusters"]
    assert curves["mean"].tolist() == pytest.approx([0.5, 0.7])
    assert curves["n"].tolist() == [4, 2] and curves["n_clusters"].tolist() == [2, 1]
    # step 1 by hand: default_rng(4).integers(0, 2, size=(6, 2)) draws the scenario pairs
    # (b,b) (b,b) (b,b) (b,a) (a,b) (a,a) -> means 0.7 0.7 0.7 0.5 0.5 0.3; sorted
    # 0.3 0.5 0.5 0.7 0.7 0.7, 25th / 75th percentiles at positions 1.25 and 3.75: 0.5 and 0.7
    assert (curves["low"].iloc[0], curves["high"].iloc[0]) == pytest.approx((0.5, 0.7))
    # step 2: both dialogues share one scenario, so the band has nothing to resample
    assert (curves["low"].iloc[1], curves["high"].iloc[1]) == pytest.approx((0.7, 0.7))
    # any scenario resample's mean is 0.3, 0.5 or 0.7; resampling dialogues would reach 0.2 or 0.25 (5 in 256)
    wide = curve_with_ci(_grpo_table(), "reward", n_boot=2000, confidence=0.99)
    assert 0.3 - 1e-12 <= wide["low"].iloc[0] and wide["high"].iloc[0] <= 0.7 + 1e-12
    with pytest.raises(KeyError, match="scenario_id"):
        curve_with_ci(_grpo_table().drop(columns="scenario_id"), "reward")
    with pytest.raises(ValueError, match="without a 'scenario_id'"):
        curve_with_ci(_grpo_table().assign(scenario_id=None), "reward")


def test_one_curve_function_in_the_library_and_the_notebooks():
    from rlver_lib import stats

    assert not hasattr(stats, "curve_ci")  # the unclustered duplicate is gone; stats keeps the bootstrap
    root = Path(__file__).resolve().parents[1] / "notebooks"
    for name in ("03_training", "05_ablations", "06_analysis"):
        cells = json.loads((root / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert "runs.curve_with_ci(" in code and "curve_ci(" not in code.replace("curve_with_ci(", ""), name


def test_run_replies_reads_evaluations_and_training(runs):
    replies = run_replies(runs[0])
    assert set(replies["source"]) == {"step 1", "step 2"}  # the fixture runs have no eval dialogues
    assert replies["change"].tolist() == [10, 5, 20, 30]
    sample = sample_replies(replies, 1, seed=0)
    assert sample["source"].tolist() == ["step 1", "step 2"]


# --------------------------------------------------------------------------- seeds pooled


def _paired_run(root: Path, name: str, diffs: dict[str, float], protocol: dict | None = None) -> Path:
    run = root / name
    (run / "eval").mkdir(parents=True)
    paired = {"mean_diff": sum(diffs.values()) / len(diffs), "ci_low": -1.0, "ci_high": 1.0, "p_value": 0.5,
              "p_method": "exact", "n_positive": sum(v > 0 for v in diffs.values()), "n_scenarios": len(diffs),
              "baseline_score": 40.0, "trained_score": 41.0, "protocol": protocol or {"max_policy_turns": 1},
              "scenarios": [{"scenario_id": k, "diff": v} for k, v in diffs.items()]}
    (run / "eval" / "paired.json").write_text(json.dumps(paired))
    return run


def test_pooled_over_seeds_pairs_scenarios_by_id_across_runs(tmp_path):
    a = _paired_run(tmp_path, "s0", {"en-1": 1.0, "en-2": 3.0})
    b = _paired_run(tmp_path, "s1", {"en-2": -2.0, "en-1": 4.0})  # other order: paired by id
    out = pooled_over_seeds([a, b], n_boot=2000)
    assert list(out["per_seed"]["run"]) == ["s0", "s1"] and out["n_scenarios"] == 2
    assert out["pooled"].value == pytest.approx((1 + 3 + 4 - 2) / 4)
    # the draws of the two seeds: (s0, s0) mean 2, (s1, s1) mean 1, mixed 1.5, each with
    # the scenarios drawn too; a wrong pairing (s1's 4.0 with en-2) would give other means
    assert -2.0 <= out["pooled"].low < out["pooled"].value < out["pooled"].high <= 4.0


def test_pooled_over_seeds_refuses_runs_of_other_scenarios_protocols_or_twice(tmp_path):
    a = _paired_run(tmp_path, "s0", {"en-1": 1.0, "en-2": 3.0})
    b = _paired_run(tmp_path, "s1", {"en-1": 1.0, "en-3": 3.0})
    c = _paired_run(tmp_path, "s2", {"en-1": 1.0, "en-2": 3.0}, protocol={"max_policy_turns": 3})
    with pytest.raises(ValueError, match="different scenarios \\(en-2, en-3\\)"):
        pooled_over_seeds([a, b])
    with pytest.raises(ValueError, match="different protocols"):
        pooled_over_seeds([a, c])
    with pytest.raises(ValueError, match="more than once"):
        pooled_over_seeds([a, tmp_path / "." / "s0"])
    with pytest.raises(FileNotFoundError, match="no paired benchmark"):
        pooled_over_seeds([a, tmp_path / "missing"])
