"""Every figure from a tidy table: each function takes a DataFrame (or a stored JSON
dict) and returns a :class:`matplotlib.figure.Figure` built without pyplot;
:func:`save_figure` writes it atomically as PNG. Units: emotion in points [0, 100],
rates in [0, 1], reply length in characters.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.config import PAPER_AXES
from rlver_lib.files import atomic_write_bytes

# --------------------------------------------------------------------------- plots


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 120) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return atomic_write_bytes(path, buf.getvalue())


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width * ncols, height), layout="constrained")
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def plot_curves(
    curves: pd.DataFrame,
    *,
    x: str = "step",
    hue: str = "run",
    ylabel: str = "mean reward",
    xlabel: str = "training step",
    title: str | None = None,
) -> Figure:
    """Lines of ``mean`` against ``x``, one per ``hue`` level, each with its
    ``low``–``high`` band (output of :func:`curve_with_ci`: the band resamples
    scenarios).  Reward, Sentient-score, PPO vs GRPO, think vs non-think and
    difficulty curves all use this."""
    fig, (ax,) = new_figure()
    for level, group in curves.groupby(hue, sort=True):
        group = group.sort_values(x)
        line, = ax.plot(group[x], group["mean"], marker="o", label=str(level))
        ax.fill_between(group[x], group["low"], group["high"], color=line.get_color(), alpha=0.2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(title=hue)
    return fig


def plot_emotion_trajectories(trajectory: pd.DataFrame, *, hue: str = "label") -> Figure:
    """Mean emotion per turn (``turn``, ``mean_emotion`` of
    :func:`rlver_lib.evaluation.benchmark.trajectory_table`), one line per ``hue`` level, with
    the success (100) and failure (10) thresholds as dotted reference lines."""
    fig, (ax,) = new_figure()
    data = trajectory if hue in trajectory else trajectory.assign(**{hue: "all"})
    for level, group in data.groupby(hue, sort=True):
        ax.plot(group["turn"], group["mean_emotion"], marker="o", label=str(level))
    for level in (SUCCESS_EMOTION, FAILURE_EMOTION):
        ax.axhline(level, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="policy turn", ylabel="mean emotion (0-100)", ylim=(0, 105))
    ax.legend(title=hue)
    return fig


def plot_success_failure(rates: pd.DataFrame, *, x: str = "step", hue: str = "run") -> Figure:
    """Success (final >= 100) and failure (final < 10) rates over training: two
    panels, one line per ``hue`` level (output of :func:`rates_over_training`)."""
    fig, axes = new_figure(ncols=2)
    for ax, outcome in zip(axes, ("success", "failure")):
        sub = rates[rates["outcome"] == outcome]
        for level, group in sub.groupby(hue, sort=True):
            group = group.sort_values(x)
            ax.plot(group[x], group["rate"], marker="o", label=str(level))
        ax.set(xlabel="training step", ylabel=f"{outcome} rate", ylim=(-0.02, 1.02), title=outcome)
        ax.legend(title=hue)
    return fig


def plot_length_vs_reward(dialogues: pd.DataFrame, *, hue: str | None = None) -> Figure:
    """Mean reply length (characters) against reward, one scatter and least-squares
    line per ``hue`` level (or one for all)."""
    fig, (ax,) = new_figure()
    groups = dialogues.groupby(hue, sort=True) if hue else [("all", dialogues)]
    for level, group in groups:
        sns.regplot(data=group, x="reply_length", y="reward", ax=ax, ci=None,
                    label=str(level), scatter_kws={"alpha": 0.5})
    ax.set(xlabel="mean reply length (characters)", ylabel="reward")
    ax.legend(title=hue or "")
    return fig


def plot_paired_scenarios(paired: dict[str, Any]) -> Figure:
    """Per-scenario Sentient score before and after training: one row per scenario
    (sorted by the difference), baseline and trained final emotion joined by a line,
    green where trained is higher; the title carries the paired mean difference with
    its interval and p-value.  ``paired``: ``eval/paired.json``
    (:func:`rlver_lib.evaluation.paired.write_paired`).  Raises ``ValueError`` when it has no
    scenario rows."""
    rows = sorted(paired.get("scenarios") or [], key=lambda r: (r["diff"], r["scenario_id"]))
    if not rows:
        raise ValueError("paired comparison has no per-scenario rows")
    fig, (ax,) = new_figure(height=max(3.0, 0.3 * len(rows) + 1.2))
    for y, row in enumerate(rows):
        colour = "tab:green" if row["diff"] > 0 else "tab:red" if row["diff"] < 0 else "grey"
        ax.plot([row["baseline"], row["trained"]], [y, y], color=colour, linewidth=1.5)
    for side, colour in (("baseline", "tab:blue"), ("trained", "tab:orange")):
        ax.scatter([r[side] for r in rows], range(len(rows)), color=colour, label=paired.get(side), zorder=3)
    ax.set_yticks(range(len(rows)), [r["scenario_id"] for r in rows])
    ax.set(xlabel="final emotion (0-100)", title=(
        f"trained - baseline {paired['mean_diff']:+.1f} [{paired['ci_low']:+.1f}, {paired['ci_high']:+.1f}], "
        f"p = {paired['p_value']:.2g}, n = {paired['n_scenarios']} scenarios"))
    ax.legend(loc="best")
    return fig


def plot_breakdown(breakdown: pd.DataFrame) -> Figure:
    """Sentient score per level, one horizontal bar panel per factor (the
    ``breakdown`` table of :class:`rlver_lib.evaluation.benchmark.BenchmarkSummary`)."""
    factors = list(dict.fromkeys(breakdown["factor"]))
    fig, axes = new_figure(ncols=len(factors), width=4.5)
    for ax, factor in zip(axes, factors):
        sub = breakdown[breakdown["factor"] == factor]
        ax.barh([f"{lvl} (n={n})" for lvl, n in zip(sub["level"], sub["n"])], sub["sentient_score"])
        ax.set(xlabel="Sentient score", ylabel=factor, xlim=(0, 100))
    return fig


def plot_run_comparison(table: pd.DataFrame, factors: Sequence[str] = PAPER_AXES) -> Figure:
    """Sentient score of each run with its interval, one panel per ablation factor
    (a column of ``table``: any dotted config key; by default the paper's PPO vs GRPO,
    think vs non-think, simulator difficulty), bars grouped and coloured by the
    factor's level (output of :func:`rlver_lib.analysis.runs.compare_runs`)."""
    fig, axes = new_figure(ncols=len(factors), width=4.5)
    for ax, factor in zip(axes, factors):
        sub = table.sort_values([factor, "run"], key=lambda s: s.astype(str))
        levels = list(dict.fromkeys(sub[factor].astype(str)))
        palette = level_colours(levels)
        err = np.vstack([sub["sentient_score"] - sub["sentient_low"], sub["sentient_high"] - sub["sentient_score"]])
        ax.bar(sub["run"], sub["sentient_score"], yerr=err, capsize=3,
               color=[palette[str(v)] for v in sub[factor]])
        # explicit patches: an empty bar container has no colour of its own, which made
        # every legend entry the same colour
        handles = [Patch(facecolor=colour, label=level) for level, colour in palette.items()]
        ax.set(xlabel="run", ylabel="Sentient score", ylim=(0, 100), title=f"by {factor}")
        ax.tick_params(axis="x", labelrotation=45)
        ax.legend(handles=handles, title=factor)
    return fig


def level_colours(levels: Sequence[Any]) -> dict[str, Any]:
    """One distinct colour per level (seaborn's default cycle, then husl beyond 10)."""
    levels = [str(v) for v in levels]
    colours = sns.color_palette(n_colors=len(levels)) if len(levels) <= 10 else sns.color_palette("husl", len(levels))
    return dict(zip(levels, colours))
