"""Baseline against trained on the same scenarios, repeats and seeds (RLVER §4.1):
:func:`paired_comparison` (per-scenario mean differences, a paired bootstrap interval and
a sign-flip p-value; judge errors bounded at both ends of the scale), written as
``eval/paired.json`` by :func:`write_paired`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from rlver_lib.evaluation.judge import check_same_judge
from rlver_lib.files import RunFolder, atomic_write_json
from rlver_lib.records import dialogue_view, load_records
from rlver_lib.stats import paired_difference

# --------------------------------------------------------------------------- paired comparison


def scenario_scores(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Dialogues as a table ``scenario_id, repeat, final_emotion, error`` (one row per
    dialogue; ``final_emotion`` in points [0, 100], for an errored dialogue its last
    recorded emotion; ``error`` True for termination ``error``).  Raises
    :class:`RecordError` on a record of neither format."""
    rows = []
    for r in records:
        v = dialogue_view(r)
        rows.append({"scenario_id": v.scenario_id, "repeat": v.repeat, "final_emotion": v.final_emotion,
                     "error": v.termination == "error"})
    return pd.DataFrame(rows, columns=["scenario_id", "repeat", "final_emotion", "error"])


ERROR_BOUND_RULE = ("errored dialogues counted at 0 and at 100 (the ends of the emotion scale): for the low bound "
                    "an errored trained dialogue is 0 and an errored baseline one 100, for the high bound the reverse")


@dataclass
class PairedComparison:
    """Trained against baseline on the same scenarios and seeds.

    ``difference``: :class:`rlver_lib.stats.PairedDifference` of the per-scenario
    means over the pairs scored on both sides (emotion points in [-100, 100];
    positive = trained higher; ``difference.p_method`` says whether its p-value is
    exact).  ``table``: one row per scenario with ``scenario_id, baseline, trained,
    diff, n_pairs``.  ``baseline_score`` / ``trained_score``: the mean over the
    table's scenarios of the per-scenario means (points), weighted like ``mean_diff``,
    so ``trained_score - baseline_score == difference.mean_diff`` up to float
    rounding.

    Pair counts: ``n_pairs`` (scenario, repeat) pairs scored on both sides;
    ``n_dropped`` = ``n_dropped_error + n_dropped_missing``, the pairs left out:
    ``n_dropped_error`` present on both sides but ended in a judge error on either
    (or both), ``n_dropped_missing`` present on one side only.  ``errors_low`` /
    ``errors_high``: the same comparison with the errored pairs put back at the bounds
    of :data:`ERROR_BOUND_RULE` (low: errored trained dialogues at 0, errored baseline
    ones at 100; high: the reverse), so the difference the errored pairs could have
    given lies between ``errors_low.mean_diff`` and ``errors_high.mean_diff``;
    ``None`` when no pair errored.
    """

    difference: Any
    table: pd.DataFrame = field(repr=False)
    n_pairs: int = 0
    n_dropped: int = 0
    baseline_score: float = float("nan")
    trained_score: float = float("nan")
    n_dropped_error: int = 0
    n_dropped_missing: int = 0
    errors_low: Any = None
    errors_high: Any = None

    def to_dict(self) -> dict[str, Any]:
        """What ``eval/paired.json`` holds: ``mean_diff, ci_low, ci_high, n_scenarios,
        p_value, p_method`` and the rest of the difference, the pair counts, both scores
        (means of per-scenario means over the paired scenarios), ``errors_low`` /
        ``errors_high`` (the difference's fields with errored pairs at the bounds, or
        ``None``), ``error_bound_rule`` and the per-scenario rows."""
        bounds = {name: (None if d is None else d.to_dict())
                  for name, d in (("errors_low", self.errors_low), ("errors_high", self.errors_high))}
        return {**self.difference.to_dict(), "n_pairs": self.n_pairs, "n_dropped": self.n_dropped,
                "n_dropped_error": self.n_dropped_error, "n_dropped_missing": self.n_dropped_missing,
                "baseline_score": self.baseline_score, "trained_score": self.trained_score,
                "scores_weighting": "mean over the paired scenarios of each scenario's mean over its pairs",
                **bounds, "error_bound_rule": ERROR_BOUND_RULE,
                "test": ("two-sided sign-flip permutation test of the mean per-scenario difference "
                         f"({self.difference.p_method})"),
                "scenarios": self.table.to_dict(orient="records")}


def _per_scenario(pairs: pd.DataFrame, baseline: pd.Series, trained: pd.Series) -> pd.DataFrame:
    table = (pd.DataFrame({"scenario_id": pairs["scenario_id"], "baseline": baseline, "trained": trained})
             .groupby("scenario_id", sort=False)
             .agg(baseline=("baseline", "mean"), trained=("trained", "mean"), n_pairs=("baseline", "size"))
             .reset_index())
    table["diff"] = table["trained"] - table["baseline"]
    return table[["scenario_id", "baseline", "trained", "diff", "n_pairs"]]


def paired_comparison(baseline: Iterable[dict[str, Any]], trained: Iterable[dict[str, Any]], *,
                      n_boot: int = 1000, confidence: float = 0.95, seed: int = 0,
                      n_resamples: int = 9999) -> PairedComparison:
    """Pair two benchmarks by (scenario, repeat) and compare them per scenario.

    Pairs where either side is missing or ended in a judge error are dropped (and
    counted apart); each scenario's difference is the mean over its remaining pairs of
    trained minus baseline final emotion (points); the mean difference over scenarios
    gets a bootstrap interval over scenarios and a sign-flip permutation p-value
    (:func:`rlver_lib.stats.paired_difference` with ``n_resamples``: exact only while
    2**n_scenarios <= n_resamples + 1).  The baseline and trained scores are the means
    of the same per-scenario means, so they subtract to ``mean_diff``.  When pairs
    errored, the comparison is repeated with them at both bounds
    (:data:`ERROR_BOUND_RULE`; see :class:`PairedComparison`).
    Raises ``ValueError`` when no pair is scored on both sides without an error.
    """
    a, b = scenario_scores(baseline), scenario_scores(trained)
    merged = a.merge(b, on=["scenario_id", "repeat"], how="outer", suffixes=("_baseline", "_trained"))
    both = merged["final_emotion_baseline"].notna() & merged["final_emotion_trained"].notna()
    err_a = merged["error_baseline"].astype("boolean").fillna(False).astype(bool)
    err_b = merged["error_trained"].astype("boolean").fillna(False).astype(bool)
    ok = both & ~err_a & ~err_b
    pairs = merged[ok]
    if pairs.empty:
        raise ValueError("paired_comparison: no scenario was scored in both benchmarks")
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed, n_resamples=n_resamples)
    table = _per_scenario(pairs, pairs["final_emotion_baseline"], pairs["final_emotion_trained"])
    diff = paired_difference(table["baseline"].to_numpy(), table["trained"].to_numpy(), **boot)
    n_error = int((both & (err_a | err_b)).sum())
    bounds: dict[str, Any] = {"errors_low": None, "errors_high": None}
    if n_error:
        present = merged[both]
        ea, eb = err_a[both], err_b[both]
        for name, (base_at, trained_at) in (("errors_low", (100.0, 0.0)), ("errors_high", (0.0, 100.0))):
            t = _per_scenario(present, present["final_emotion_baseline"].where(~ea, base_at),
                              present["final_emotion_trained"].where(~eb, trained_at))
            bounds[name] = paired_difference(t["baseline"].to_numpy(), t["trained"].to_numpy(), **boot)
    return PairedComparison(diff, table, n_pairs=int(len(pairs)), n_dropped=int(len(merged) - len(pairs)),
                            baseline_score=float(table["baseline"].mean()),
                            trained_score=float(table["trained"].mean()),
                            n_dropped_error=n_error, n_dropped_missing=int((~both).sum()), **bounds)


def write_paired(run_dir: str | Path, *, baseline: str = "baseline", trained: str = "trained",
                 n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> PairedComparison | None:
    """Write ``<run_dir>/eval/paired.json`` from ``eval/<baseline>`` and ``eval/<trained>``.

    Returns ``None`` (and writes nothing) unless both folders hold ``dialogues.jsonl``.
    Raises :class:`JudgeMismatchError` when the two were judged differently.
    """
    folder = RunFolder(run_dir)
    benches = {name: folder.eval_dir(name) for name in (baseline, trained)}
    if not all(bench.dialogues.is_file() for bench in benches.values()):
        return None
    summaries = {name: json.loads(bench.summary.read_text(encoding="utf-8"))
                 for name, bench in benches.items() if bench.summary.is_file()}
    if len(summaries) == 2:
        check_same_judge(summaries)
    comparison = paired_comparison(load_records(benches[baseline].dialogues),
                                   load_records(benches[trained].dialogues),
                                   n_boot=n_boot, confidence=confidence, seed=seed)
    summary = summaries.get(trained, {})
    atomic_write_json(folder.paired,
                      {"baseline": baseline, "trained": trained, "judge": summary.get("judge"),
                       "protocol": summary.get("protocol"), **comparison.to_dict()})
    return comparison
