"""Ablation cells side by side (notebook 05): one row per cell with its grid axes,
paired differences against a reference cell under one judge, and per-cell tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from rlver_lib.analysis.hacking import paired_estimate, sycophancy_rate
from rlver_lib.analysis.runs import config_fields, run_config, run_name
from rlver_lib.analysis.strategies import UNPARSED, plot_strategy_mix, plot_strategy_use, strategy_mix, strategy_use
from rlver_lib.config import PAPER_AXES, get_dotted
from rlver_lib.files import RunFolder, atomic_write_text
from rlver_lib.records import dialogue_view, scored_records

# --------------------------------------------------------------------------- ablation grids


def cell_fields(run_dir: str | Path, axes: Sequence[str] = PAPER_AXES) -> dict[str, Any]:
    """What defines one run of a grid, from its ``config.yaml``: each dotted ``axes``
    key, ``training.steps``, ``policy.model`` and the benchmark ``judge``
    (``backend:model (difficulty)``); ``None`` values without a ``config.yaml``."""
    cfg = run_config(run_dir)
    keys = dict.fromkeys([*axes, "training.steps", "policy.model"])
    if cfg is None:
        return {**keys, "judge": None}
    judge = cfg.evaluation.judge
    return {**{key: get_dotted(cfg, key) for key in keys},
            "judge": f"{judge.backend}:{judge.model} ({judge.difficulty})"}


def cells_table(run_dirs: Sequence[str | Path], axes: Sequence[str] = PAPER_AXES) -> pd.DataFrame:
    """One row per run: ``run`` and its :func:`cell_fields`; with more than one run,
    only the columns whose values differ between runs are kept (plus ``run``), so the
    table says what varies per cell."""
    table = pd.DataFrame([{"run": run_name(Path(d)), **cell_fields(d, axes)} for d in run_dirs])
    if len(table) > 1:
        varying = [c for c in table.columns if c == "run" or table[c].astype(str).nunique() > 1]
        table = table[varying]
    return table


def scenario_finals(run_dir: str | Path, label: str = "trained") -> pd.Series:
    """Mean final emotion per scenario id of ``<run>/eval/<label>/dialogues.jsonl``
    (repeats averaged; errored dialogues left out); empty when absent."""
    recs = scored_records(RunFolder(run_dir).eval_dir(label).dialogues)
    if not recs:
        return pd.Series(dtype=float)
    frame = pd.DataFrame({"scenario_id": [r["scenario_id"] for r in recs],
                          "final": [dialogue_view(r).final_emotion for r in recs]})
    return frame.groupby("scenario_id")["final"].mean()


def paired_cell_differences(run_dirs: Sequence[str | Path], *, reference: str | None = None, label: str = "trained",
                            n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Cells against a reference cell on the same test scenarios, paired by scenario.

    ``reference``: a run name (default: the first run), or ``"all"`` for every pair of
    cells once, the earlier run as the reference (a three-arm ablation's two differences
    against its first arm and the difference between the other two).  Per pair: ``run``,
    ``reference``, ``n`` (common scenarios), ``reference_score`` and ``score`` (mean
    final emotion over those scenarios), ``diff`` (mean paired difference ``run`` minus
    ``reference``, emotion points) with ``low`` / ``high`` (bootstrap over scenarios) and
    ``p_value`` (sign-flip test), and ``same_judge`` (both cells' ``evaluation.judge``
    equal).  With a single common scenario only ``diff`` is given.  Raises
    ``ValueError`` for an unknown reference.
    """
    dirs = {run_name(Path(d)): Path(d) for d in run_dirs}
    names = list(dirs)
    if reference == "all":
        pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    else:
        reference = reference or next(iter(names), None)
        if names and reference not in dirs:
            raise ValueError(f"reference cell {reference!r} is not one of {names} (or 'all')")
        pairs = [(reference, name) for name in names if name != reference]
    finals = {name: scenario_finals(path, label) for name, path in dirs.items()}  # each cell read once
    judges = {name: cell_fields(path)["judge"] for name, path in dirs.items()}
    rows = []
    for ref_name, name in pairs:
        ref, cell = finals[ref_name], finals[name]
        common = sorted(set(ref.index) & set(cell.index))
        row = {"run": name, "reference": ref_name, "n": len(common), "same_judge": judges[name] == judges[ref_name]}
        if common:
            row.update(reference_score=float(ref[common].mean()), score=float(cell[common].mean()),
                       **paired_estimate(ref[common].to_numpy(dtype=float), cell[common].to_numpy(dtype=float),
                                         n_boot=n_boot, confidence=confidence, seed=seed))
        rows.append(row)
    return pd.DataFrame(rows, columns=["run", "reference", "n", "reference_score", "score", "diff", "low", "high",
                                       "p_value", "same_judge"])


ANNOTATIONS = "strategy_annotations"
"""The strategy annotator's per-reply annotations, ``<run>/analysis/strategy_annotations.csv``."""
LEGACY_TABLES = {ANNOTATIONS: "strategy_labels"}
"""The name a table had in older run folders, still read by :func:`load_cell_tables`."""


def load_cell_tables(run_dirs: Sequence[str | Path], name: str, axes: Sequence[str] = PAPER_AXES) -> pd.DataFrame:
    """``<run>/analysis/<name>.csv`` of every run that has it, concatenated, with ``run``
    and one column per dotted ``axes`` key; empty when no run has it."""
    parts = []
    for d in map(Path, run_dirs):
        path = RunFolder(d).analysis_table(name)
        if not path.is_file() and name in LEGACY_TABLES:
            path = RunFolder(d).analysis_table(LEGACY_TABLES[name])
        if path.is_file():
            parts.append(pd.read_csv(path).assign(run=run_name(d), **config_fields(d, axes)))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def write_table(run_dir: str | Path, name: str, table: pd.DataFrame) -> Path:
    """Write ``table`` as ``<run>/analysis/<name>.csv`` atomically (what the ablation
    report reads back with :func:`load_cell_tables`)."""
    path = RunFolder(run_dir).analysis_table(name)
    atomic_write_text(path, table.to_csv(index=False))
    return path


def cell_strategy_figures(annotations: pd.DataFrame, factors: Sequence[str] = PAPER_AXES,
                          *, source: str = "trained") -> list[Figure]:
    """Strategy figures across the cells of a grid, from :func:`load_cell_tables` of
    :data:`ANNOTATIONS`: the primary mix of each run's ``source`` replies, then, for
    each factor with more than one level (think vs non-think first), the strategy
    and dimension panels side by side per level (:func:`plot_strategy_use`)."""
    data = (annotations[(annotations["source"] == source) & (annotations["primary"] != UNPARSED)]
            if len(annotations) else annotations)
    if data.empty:
        return []
    fig = plot_strategy_mix(strategy_mix(data, by="run"), by="run", order=list(dict.fromkeys(data["run"])))
    fig.axes[0].set_title(f"Primary strategy per cell ({source} policy)")
    figs = [fig]
    for factor in factors:
        if factor in data and data[factor].astype(str).nunique() > 1:
            fig = plot_strategy_use(strategy_use(data.assign(**{factor: data[factor].astype(str)}), by=factor),
                                    by=factor)
            fig.suptitle(f"Strategies and dimensions by {factor} ({source} policy)")
            figs.append(fig)
    return figs


def cell_hacking_tables(run_dirs: Sequence[str | Path]) -> dict[str, pd.DataFrame]:
    """The hacking diagnostics of every cell side by side (empty tables where no cell
    has them): ``correlations`` (feature x run, ``r [low, high]`` of
    :func:`hacking_statistics`), ``injection`` (each run's pooled ``probe - control``
    row of :func:`summarize_injection`), ``distinct`` (distinct-2 per run and source),
    ``sycophancy`` (absolving rate per run and policy, :func:`sycophancy_rate`)."""
    out: dict[str, pd.DataFrame] = {}
    stats = load_cell_tables(run_dirs, "hacking_stats")
    out["correlations"] = pd.DataFrame() if stats.empty else stats.assign(
        value=[f"{r:+.2f} [{lo:+.2f}, {hi:+.2f}]" if np.isfinite(r) else "n/a"
               for r, lo, hi in zip(stats["r"], stats["low"], stats["high"])]
    ).pivot(index="feature", columns="run", values="value")
    probes = load_cell_tables(run_dirs, "injection_summary")
    out["injection"] = probes if probes.empty else probes[probes["kind"] == "probe - control"].drop(columns="kind")
    distinct = load_cell_tables(run_dirs, "distinct")
    out["distinct"] = distinct if distinct.empty else distinct.pivot(index="run", columns="source",
                                                                     values="distinct_2")
    syc = load_cell_tables(run_dirs, "sycophancy")
    out["sycophancy"] = pd.DataFrame() if syc.empty else pd.concat(
        [sycophancy_rate(g, n_boot=200).assign(run=run) for run, g in syc.groupby("run", sort=False)],
        ignore_index=True)
    return out
