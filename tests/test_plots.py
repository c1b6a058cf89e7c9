"""Every figure from a tidy table (rlver_lib.plots): curves, trajectories, breakdowns,
rates, run comparisons, the per-scenario paired plot."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_support import dialogue_record, legend_labels

from rlver_lib.analysis.runs import (
    compare_runs,
    curve_with_ci,
    load_training_dialogues,
    rates_over_training,
)
from rlver_lib.evaluation.benchmark import summarize
from rlver_lib.plots import (
    plot_breakdown,
    plot_curves,
    plot_emotion_trajectories,
    plot_length_vs_reward,
    plot_run_comparison,
    plot_success_failure,
    save_figure,
)


def test_plot_curves_lines_and_bands(runs):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    fig = plot_curves(curve_with_ci(dialogues, "reward", n_boot=20), ylabel="mean reward")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training step", "mean reward")
    assert len(ax.lines) == 2 and len(ax.collections) == 2
    assert legend_labels(ax) == ["grpo-nothink", "ppo-think"]


def test_plot_emotion_trajectories_and_breakdown():
    records = [dialogue_record("a", ["x", "y"], [60, 100]), dialogue_record("b", ["x"], [5])]
    summary = summarize(records, n_boot=20)
    traj = pd.concat([summary.trajectory.assign(label="baseline"), summary.trajectory.assign(label="trained")])
    fig = plot_emotion_trajectories(traj)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "mean emotion (0-100)" and ax.get_xlabel() == "policy turn"
    assert len(ax.lines) == 2 + 2  # two labels, two threshold lines
    assert legend_labels(ax) == ["baseline", "trained"]
    fig = plot_breakdown(summary.breakdown)
    assert [a.get_ylabel() for a in fig.axes] == ["hidden_intention", "personality", "language"]
    assert all(len(a.patches) == 1 for a in fig.axes)  # one "unknown" level each


def test_plot_success_failure_length_and_runs(runs, tmp_path):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    fig = plot_success_failure(rates_over_training(dialogues))
    assert [a.get_ylabel() for a in fig.axes] == ["success rate", "failure rate"]
    assert all(len(a.lines) == 2 for a in fig.axes)
    fig = plot_length_vs_reward(dialogues.assign(reply_length=np.arange(8.0)), hue="run")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "mean reply length (characters)" and len(ax.collections) == 2
    fig = plot_run_comparison(compare_runs(runs))
    assert [a.get_title() for a in fig.axes] == ["by training.algorithm", "by policy.think", "by simulator.difficulty"]
    assert [len(a.patches) for a in fig.axes] == [2, 2, 2]
    assert legend_labels(fig.axes[0]) == ["grpo", "ppo"]
    save_figure(fig, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_run_comparison_legend_has_one_colour_per_level(runs):
    fig = plot_run_comparison(compare_runs(runs))
    for ax in fig.axes:
        handles = ax.get_legend().legend_handles
        colours = {tuple(np.round(h.get_facecolor(), 3)) for h in handles}
        assert len(colours) == len(handles) == 2
        # the bars of a level carry its legend colour
        legend = {t.get_text(): tuple(np.round(h.get_facecolor(), 3))
                  for t, h in zip(ax.get_legend().get_texts(), handles)}
        bar_colours = {tuple(np.round(p.get_facecolor(), 3)) for p in ax.patches}
        assert bar_colours == set(legend.values())


def test_plot_paired_scenarios_sorted_and_titled():
    from rlver_lib.plots import plot_paired_scenarios

    paired = {"baseline": "baseline", "trained": "trained", "mean_diff": 1.5, "ci_low": -2.0, "ci_high": 5.0,
              "p_value": 0.5, "n_scenarios": 2,
              "scenarios": [{"scenario_id": "x", "baseline": 40, "trained": 48, "diff": 8},
                            {"scenario_id": "y", "baseline": 45, "trained": 40, "diff": -5}]}
    fig = plot_paired_scenarios(paired)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["y", "x"]  # sorted by difference
    assert ax.get_title() == "trained - baseline +1.5 [-2.0, +5.0], p = 0.5, n = 2 scenarios"
    with pytest.raises(ValueError):
        plot_paired_scenarios({**paired, "scenarios": []})
