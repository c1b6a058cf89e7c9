"""A run's files as tidy tables: training metrics and dialogues, evaluation summaries,
replies of every source, :func:`compare_runs` across runs, the paired report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rlver_lib.analysis.hacking import reply_changes
from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.config import PAPER_AXES, RunConfig, get_dotted
from rlver_lib.files import RunFolder, iter_jsonl
from rlver_lib.params import load_run_config
from rlver_lib.plots import plot_emotion_trajectories, plot_paired_scenarios
from rlver_lib.records import dialogue_view, load_records, policy_turns, scored_records
from rlver_lib.stats import cluster_bootstrap_ci, seed_pooled_ci

# --------------------------------------------------------------------------- tables


def run_name(run_dir: Path) -> str:
    return Path(run_dir).name


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """``<run>/train/metrics.jsonl`` as a DataFrame with a ``run`` column.

    Raises ``FileNotFoundError`` when the run has no training metrics.
    """
    path = RunFolder(run_dir).metrics
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training metrics")
    return pd.DataFrame([rec for _, rec in iter_jsonl(path)]).assign(run=run_name(run_dir))


def dialogue_table(records: Iterable[dict[str, Any]], **columns: Any) -> pd.DataFrame:
    """One row per dialogue: ``final_emotion``, ``reward`` (= final / 100),
    ``n_turns``, ``success``, ``failure``, ``termination`` (``None`` for SAGE records),
    mean ``reply_length`` (characters), plus constant ``columns`` (e.g. ``step=3``)."""
    rows = []
    for rec in records:
        view = dialogue_view(rec)
        replies = [t["reply"] for t in policy_turns(rec)]
        rows.append({
            **columns,
            "dialogue_id": rec.get("dialogue_id", rec.get("id")),
            "scenario_id": rec.get("scenario_id"),
            "final_emotion": view.final_emotion,
            "reward": view.final_emotion / 100,
            "n_turns": view.n_turns,
            "success": view.final_emotion >= SUCCESS_EMOTION,
            "failure": view.final_emotion < FAILURE_EMOTION,
            "termination": rec.get("termination"),
            "reply_length": float(np.mean([len(r) for r in replies])) if replies else np.nan,
        })
    return pd.DataFrame(rows)


def turn_table(records: Iterable[dict[str, Any]], **columns: Any) -> pd.DataFrame:
    """One row per policy turn of our dialogue records: ``dialogue_id``, ``turn``
    (1-based), ``user`` (the message it answered), ``reply``, ``change``,
    ``emotion`` (after its appraisal), the dialogue's ``reward``, plus constant
    ``columns`` (e.g. ``step=3``)."""
    rows = []
    for rec in records:
        for t in policy_turns(rec):
            rows.append({**columns, "dialogue_id": rec["dialogue_id"], "turn": t["turn"],
                         "user": t["user"], "reply": t["reply"], "change": t["change"],
                         "emotion": t["emotion"], "reward": rec["reward"]})
    return pd.DataFrame(rows, columns=[*columns, "dialogue_id", "turn", "user", "reply",
                                       "change", "emotion", "reward"])


def _step_of(path: Path) -> int:
    match = re.search(r"(\d+)", path.stem)
    if not match:
        raise ValueError(f"{path}: cannot read the training step from the file name")
    return int(match.group(1))


def load_training_dialogues(run_dir: str | Path, *, turns: bool = False) -> pd.DataFrame:
    """All ``<run>/train/dialogues/step_*.jsonl`` as a :func:`dialogue_table` (or a
    :func:`turn_table` with ``turns=True``) with ``run`` and ``step`` columns."""
    files = RunFolder(run_dir).step_dialogues()
    if not files:
        raise FileNotFoundError(f"{run_dir}: no train/dialogues/step_*.jsonl")
    table = turn_table if turns else dialogue_table
    return pd.concat([table(load_records(f), run=run_name(run_dir), step=_step_of(f)) for f in files],
                     ignore_index=True)


def load_eval(run_dir: str | Path) -> pd.DataFrame:
    """Every ``<run>/eval/<label>/summary.json`` as tidy rows: ``run, label, metric,
    value, low, high`` (metrics ``sentient_score, success_rate, failure_rate,
    mean_turns``) — empty when the run has no evaluation."""
    rows = []
    for path in RunFolder(run_dir).summaries():
        summary = json.loads(path.read_text(encoding="utf-8"))
        for metric in ("sentient_score", "success_rate", "failure_rate", "mean_turns"):
            est = summary[metric]
            rows.append({"run": run_name(run_dir), "label": path.parent.name, "metric": metric,
                         "value": est["value"], "low": est["low"], "high": est["high"]})
    return pd.DataFrame(rows, columns=["run", "label", "metric", "value", "low", "high"])



@dataclass
class EvalOverview:
    """A run's benchmarks at a glance: ``table`` (metric x label, each cell ``"value [low,
    high]"``, from :func:`load_eval`) and ``figure`` (mean emotion per turn of every
    ``eval/<label>/trajectory.csv``, :func:`rlver_lib.plots.plot_emotion_trajectories`)."""

    table: pd.DataFrame
    figure: Figure


def eval_overview(run_dir: str | Path) -> EvalOverview | None:
    """The :class:`EvalOverview` of a run (notebook 06), ``None`` when it has no evaluation."""
    ev = load_eval(run_dir)
    if ev.empty:
        return None
    ev["estimate [interval]"] = [f"{v:.2f} [{lo:.2f}, {hi:.2f}]"
                                 for v, lo, hi in zip(ev["value"], ev["low"], ev["high"])]
    trajectories = pd.concat([pd.read_csv(p).assign(label=p.parent.name)
                              for p in RunFolder(run_dir).eval_trajectories()])
    fig = plot_emotion_trajectories(trajectories)
    fig.axes[0].set_title("Mean emotion per turn on the held-out benchmark")
    return EvalOverview(ev.pivot(index="metric", columns="label", values="estimate [interval]"), fig)

def run_config(run_dir: str | Path) -> RunConfig | None:
    """The resolved config a run saved (``<run>/config.yaml``, :func:`rlver_lib.params.load_run_config`),
    ``None`` when the folder has none. Raises :class:`rlver_lib.config.ConfigError`."""
    path = RunFolder(run_dir).config
    return load_run_config(path) if path.is_file() else None


def config_fields(run_dir: str | Path, axes: Sequence[str] = PAPER_AXES) -> dict[str, Any]:
    """``{axis: value}`` of a run's config for each dotted ``axes`` key (``None``
    without a ``config.yaml``)."""
    cfg = run_config(run_dir)
    return {axis: None if cfg is None else get_dotted(cfg, axis) for axis in axes}


def compare_runs(run_dirs: Sequence[str | Path], *, axes: Sequence[str] = PAPER_AXES,
                 label: str = "trained") -> pd.DataFrame:
    """One row per run of an ablation grid: ``run``, one column per dotted ``axes`` key
    (its value in the run's ``config.yaml``), the ``label`` evaluation's figures
    (``sentient_score``, ``sentient_low``, ``sentient_high``, ``success_rate``,
    ``failure_rate``, ``mean_turns``; NaN when absent), the ``baseline``
    Sentient score, and the mean training reward of the last step (NaN without
    training dialogues)."""
    rows = []
    for run_dir in map(Path, run_dirs):
        ev = load_eval(run_dir)
        row: dict[str, Any] = {"run": run_name(run_dir), **config_fields(run_dir, axes)}

        def pick(lbl: str, metric: str, col: str = "value", ev: pd.DataFrame = ev) -> float:
            hit = ev[(ev["label"] == lbl) & (ev["metric"] == metric)]
            return float(hit[col].iloc[0]) if len(hit) else np.nan

        row["sentient_score"] = pick(label, "sentient_score")
        row["sentient_low"] = pick(label, "sentient_score", "low")
        row["sentient_high"] = pick(label, "sentient_score", "high")
        for metric in ("success_rate", "failure_rate", "mean_turns"):
            row[metric] = pick(label, metric)
        row["baseline_score"] = pick("baseline", "sentient_score")
        try:
            train = load_training_dialogues(run_dir)
            row["final_train_reward"] = float(train[train["step"] == train["step"].max()]["reward"].mean())
        except FileNotFoundError:
            row["final_train_reward"] = np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def curve_with_ci(
    df: pd.DataFrame,
    value: str,
    by: Sequence[str] = ("run", "step"),
    *,
    cluster: str = "scenario_id",
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """The training curve: mean of ``value`` per group ``by`` with a band clustered by scenario.

    ``df`` has one row per dialogue (e.g. :func:`load_training_dialogues`) with the
    columns ``by``, ``value`` (e.g. ``reward`` in [0, 1] or ``final_emotion`` in
    points) and ``cluster``.  GRPO's replicas of a scenario share its id and are not
    independent, so each group's band resamples whole scenarios
    (:func:`rlver_lib.stats.cluster_bootstrap_ci`: the mean of all dialogues of the
    drawn scenarios, ``n_boot`` resamples, the ``(1-confidence)/2`` and
    ``(1+confidence)/2`` percentiles, every group seeded ``seed`` so a group's band does
    not depend on the other groups).  With a single scenario in a group the band is
    the point itself: a curve over one scenario carries no between-scenario evidence.
    This is the only curve function; notebooks 03, 05 and 06 plot it with
    :func:`plot_curves`.

    Returns columns ``*by, mean, low, high, n, n_clusters`` (``n`` dialogues,
    ``n_clusters`` distinct scenarios), groups sorted.  Raises ``KeyError`` naming
    missing columns and ``ValueError`` when a row has no ``cluster`` label.
    """
    by = list(by)
    missing = [c for c in (*by, value, cluster) if c not in df.columns]
    if missing:
        raise KeyError(f"curve_with_ci: missing column(s) {missing}")
    unlabelled = int(df[cluster].isna().sum())
    if unlabelled:
        raise ValueError(f"curve_with_ci: {unlabelled} row(s) without a {cluster!r}: the band resamples scenarios")
    rows = []
    for keys, group in df.groupby(by, sort=True):
        keys = keys if isinstance(keys, tuple) else (keys,)
        est = cluster_bootstrap_ci(group[value].to_numpy(dtype=float), group[cluster].tolist(),
                                   n_boot=n_boot, confidence=confidence, seed=seed)
        rows.append({**dict(zip(by, keys)), "mean": est.value, "low": est.low, "high": est.high,
                     "n": len(group), "n_clusters": int(group[cluster].nunique())})
    return pd.DataFrame(rows, columns=[*by, "mean", "low", "high", "n", "n_clusters"])


def rates_over_training(dialogues: pd.DataFrame, by: Sequence[str] = ("run", "step")) -> pd.DataFrame:
    """Success and failure rates per group, long form: ``*by, outcome, rate``."""
    rates = dialogues.groupby(list(by))[["success", "failure"]].mean().reset_index()
    return rates.melt(id_vars=list(by), var_name="outcome", value_name="rate")


def paired_report(run_dir: str | Path, *, top: int = 8) -> dict[str, Any] | None:
    """The paired benchmark of a run for its report: ``figure``
    (:func:`plot_paired_scenarios`), ``length`` and ``phrases``
    (:func:`reply_changes` of the two benchmarks' replies; ``figure`` is ``None`` when
    ``paired.json`` has no per-scenario rows).  ``None`` when the run has no
    ``eval/paired.json`` (it needs a baseline and a trained benchmark)."""
    path = RunFolder(run_dir).paired
    if not path.is_file():
        return None
    paired = json.loads(path.read_text(encoding="utf-8"))
    sides = [load_records(RunFolder(run_dir).eval_dir(paired[side]).dialogues)
             for side in ("baseline", "trained")]
    figure = plot_paired_scenarios(paired) if paired.get("scenarios") else None
    return {"figure": figure, **reply_changes(*sides, top=top)}


def pooled_over_seeds(run_dirs: Sequence[str | Path], *, n_boot: int = 1000,
                      seed: int = 0) -> dict[str, Any]:
    """Paired benchmarks of the same recipe trained with different seeds, per seed and
    pooled.

    Reads each run's ``eval/paired.json``.  Returns ``{"per_seed": DataFrame, "pooled":
    Estimate, "n_scenarios": J}``: ``per_seed`` has one row per run (``run, seed,
    mean_diff, ci_low, ci_high, p_value, p_method, n_positive, n_scenarios,
    baseline_score, trained_score``); ``pooled`` is :func:`rlver_lib.stats.seed_pooled_ci` of the
    (runs, scenarios) differences (the mean of the seeds' paired differences, with an
    interval over seeds and scenarios).  Raises ``FileNotFoundError`` for a run without
    ``paired.json`` and ``ValueError`` when a folder is given twice, the runs did not benchmark the same
    scenarios under the same protocol (the runs and scenarios named) or when a
    ``paired.json`` has no per-scenario rows.
    """
    if not run_dirs:
        raise ValueError("pooled_over_seeds needs at least one run folder")
    resolved = [Path(r).resolve() for r in run_dirs]
    twice = sorted({str(r) for r in run_dirs if resolved.count(Path(r).resolve()) > 1})
    if twice:
        raise ValueError(f"the same run folder given more than once: {', '.join(twice)}")
    rows, diffs, first = [], [], None
    for run_dir in run_dirs:
        path = RunFolder(run_dir).paired
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no paired benchmark (the run needs its baseline and trained stages)")
        paired = json.loads(path.read_text(encoding="utf-8"))
        by_id = {row["scenario_id"]: row["diff"] for row in paired.get("scenarios") or []}
        if not by_id:
            raise ValueError(f"{path}: no per-scenario rows")
        if first is None:
            first = (run_dir, sorted(by_id), paired.get("protocol"))
        elif sorted(by_id) != first[1]:
            odd = sorted(set(by_id) ^ set(first[1]))
            raise ValueError(f"{run_dir} and {first[0]} benchmarked different scenarios ({', '.join(odd)})")
        elif paired.get("protocol") != first[2]:
            raise ValueError(f"{run_dir} and {first[0]} benchmarked under different protocols: "
                             f"{paired.get('protocol')} vs {first[2]}")
        diffs.append([by_id[k] for k in first[1]])
        cfg = run_config(run_dir)
        rows.append({"run": run_name(Path(run_dir)), "seed": None if cfg is None else cfg.seed,
                     **{k: paired[k] for k in ("mean_diff", "ci_low", "ci_high", "p_value", "p_method",
                                               "n_positive", "n_scenarios", "baseline_score",
                                               "trained_score")}})
    return {"per_seed": pd.DataFrame(rows), "pooled": seed_pooled_ci(diffs, n_boot=n_boot, seed=seed),
            "n_scenarios": len(first[1])}


def run_replies(run_dir: str | Path) -> pd.DataFrame:
    """Every policy turn of a run as one table: ``source`` (``baseline``, ``step N``,
    ``trained``), ``step`` (training step; ``NaN`` for the evaluations),
    ``dialogue_id``, ``scenario_id``, ``turn``, ``user``, ``reply``, ``change`` (the
    appraisal's clamped emotion change, ``NaN`` when unappraised), ``reward``.
    Dialogues that ended in a simulator error are left out."""
    run_dir = Path(run_dir)
    parts = []
    for label in ("baseline", "trained"):
        recs = scored_records(RunFolder(run_dir).eval_dir(label).dialogues)
        if recs:
            parts.append(_turns_of(recs).assign(source=label, step=np.nan))
    for path in RunFolder(run_dir).step_dialogues():
        step = _step_of(path)
        recs = scored_records(path)
        if recs:
            parts.append(_turns_of(recs).assign(source=f"step {step}", step=float(step)))
    cols = ["source", "step", "dialogue_id", "scenario_id", "turn", "user", "reply", "change", "reward"]
    if not parts:
        return pd.DataFrame(columns=cols)
    return pd.concat(parts, ignore_index=True)[cols]


def _turns_of(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for rec in records:
        for t in policy_turns(rec):
            rows.append({"dialogue_id": rec.get("dialogue_id"), "scenario_id": rec.get("scenario_id"),
                         "turn": t["turn"], "user": t["user"], "reply": t["reply"],
                         "change": np.nan if t["change"] is None else float(t["change"]),
                         "reward": rec.get("reward", dialogue_view(rec).final_emotion / 100)})
    return pd.DataFrame(rows)


def sample_replies(replies: pd.DataFrame, n_per_source: int, *, seed: int) -> pd.DataFrame:
    """Up to ``n_per_source`` replies of each ``source``, drawn without replacement
    (``DataFrame.sample(random_state=seed)``), in source order then original order."""
    parts = [g.sample(min(n_per_source, len(g)), random_state=seed).sort_index()
             for _, g in replies.groupby("source", sort=False)]
    return pd.concat(parts) if parts else replies.iloc[:0]
