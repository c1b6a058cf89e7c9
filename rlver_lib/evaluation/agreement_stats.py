"""Agreement statistics of judged changes against SAGE's recorded ones (docs/BENCHMARK.md
"Judge agreement"): Spearman, Pearson, sign agreement and MAE with intervals that
resample dialogues (:func:`agreement_metrics`, :func:`baseline_metrics`), bucketed
confusion tables, the partial Spearman given a reply-blind prediction
(:func:`partial_block`), the first-turn test (:func:`first_turn_block`), statistics per
fold (:func:`fold_blocks`); the within-dialogue permutation test of the partial is
:func:`rlver_lib.stats.permutation_test_partial`.  Used by
:func:`rlver_lib.evaluation.agreement.judge_agreement`; turns are its ``ReplayTurn``
(read by attribute).  Nothing like this exists in SAGE or RLVER.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from rlver_lib.evaluation.reply_blind import BASELINES, file_of, first_turn_spearman
from rlver_lib.stats import cluster_bootstrap, partial_spearman, pearson, spearman

#: Buckets of a real-valued emotion change: (label, low, high, low closed, high closed).
#: Half-open where they meet, so every real number falls in exactly one:
#: (-inf, -4.5], (-4.5, -0.5), [-0.5, 0.5], (0.5, 4.5), [4.5, inf) (the infinite ends
#: included too).  On SAGE's integer scale: <= -5, -4..-1, 0, 1..4, >= 5; an expected
#: change of -4.5 counts as a -5, one of -0.5 as a 0.
BUCKETS: tuple[tuple[str, float, float, bool, bool], ...] = (
    ("(-inf,-4.5]", -np.inf, -4.5, True, True), ("(-4.5,-0.5)", -4.5, -0.5, False, False),
    ("[-0.5,0.5]", -0.5, 0.5, True, True), ("(0.5,4.5)", 0.5, 4.5, False, False),
    ("[4.5,inf)", 4.5, np.inf, True, True),
)


def bucket(change: float) -> str:
    """The :data:`BUCKETS` label of one real-valued change; ``ValueError`` for NaN."""
    for label, low, high, low_closed, high_closed in BUCKETS:
        above = change >= low if low_closed else change > low
        below = change <= high if high_closed else change < high
        if above and below:
            return label
    raise ValueError(f"change {change!r} falls in no bucket")


def confusion_table(recorded: Sequence[float], ours: Sequence[float]) -> pd.DataFrame:
    """Counts of (recorded bucket, our bucket): rows = SAGE's judge, columns = ours,
    in :data:`BUCKETS` order."""
    labels = [b[0] for b in BUCKETS]
    table = pd.DataFrame(0, index=pd.Index(labels, name="recorded"), columns=pd.Index(labels, name="judge"))
    for r, o in zip(recorded, ours):
        table.loc[bucket(r), bucket(o)] += 1
    return table


def _sign_agreement(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.sign(x) == np.sign(y)))


def _mae(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(x - y)))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "spearman": spearman, "pearson": pearson, "sign_agreement": _sign_agreement, "mae": _mae,
}


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def _bootstrapped(r: np.ndarray, o: np.ndarray, clusters: Sequence[Any], names: Sequence[str],
                  absent: Sequence[str] = (), **boot: Any) -> dict[str, Any]:
    """``{name: value, name_ci: [low, high]}`` for each of ``names`` (keys of :data:`METRICS`),
    intervals from :func:`rlver_lib.stats.cluster_bootstrap`; ``None`` for each of ``absent``."""
    out: dict[str, Any] = {}
    for name in names:
        fn = METRICS[name]
        est = cluster_bootstrap(lambda idx, fn=fn: fn(r[idx], o[idx]), r.size, clusters, **boot)
        out[name] = _finite(est.value)
        out[f"{name}_ci"] = [_finite(est.low), _finite(est.high)]
    for name in absent:
        out[name], out[f"{name}_ci"] = None, [None, None]
    return out


def agreement_metrics(recorded: Sequence[float], ours: Sequence[float], clusters: Sequence[Any], *,
                      n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Agreement of ``ours`` with ``recorded`` (both shape (n,), changes in emotion points,
    integers or reals).

    Returns ``n_turns``, ``n_dialogues`` (distinct ``clusters``), ``spearman``,
    ``pearson``, ``sign_agreement`` (share of turns with the same sign, 0 counting as its
    own sign; [0, 1]), ``mae`` (emotion points), each with ``<name>_ci`` = ``[low, high]``
    from a bootstrap over clusters, the mean changes, ``share_negative``
    (``{"judge", "recorded"}``: share of changes < 0) and ``confusion``
    (:func:`confusion_table` as ``{"buckets", "rows", "columns", "counts"}``).  A
    correlation of constant values is ``None``.  Raises ``ValueError`` on empty or
    mismatched input.
    """
    r, o = np.asarray(recorded, dtype=float), np.asarray(ours, dtype=float)
    if r.shape != o.shape or r.ndim != 1 or r.size == 0:
        raise ValueError("agreement_metrics needs two non-empty 1-D sequences of the same length")
    out: dict[str, Any] = {"n_turns": int(r.size), "n_dialogues": int(len(set(clusters)))}
    out.update(_bootstrapped(r, o, clusters, list(METRICS), n_boot=n_boot, confidence=confidence, seed=seed))
    out["mean_recorded_change"] = float(r.mean())
    out["mean_judge_change"] = float(o.mean())
    out["share_negative"] = {"judge": float(np.mean(o < 0)), "recorded": float(np.mean(r < 0))}
    table = confusion_table(r, o)
    out["confusion"] = {"buckets": list(table.index), "rows": "recorded (SAGE judge)", "columns": "judge (ours)",
                        "counts": table.to_numpy().tolist()}
    return out


def baseline_metrics(recorded: Sequence[float], predictors: dict[str, np.ndarray], clusters: Sequence[Any], *,
                     n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Agreement of each reply-blind predictor with ``recorded`` (shape (n,), aligned with
    ``clusters``); ``predictors``: name (a key of
    :data:`rlver_lib.evaluation.reply_blind.BASELINES`) -> shape (n,).

    Returns ``{name: {"spearman", "sign_agreement", "mae"}}`` in :data:`BASELINES` order
    (names absent from ``predictors`` left out), each value with its ``<metric>_ci`` from
    :func:`rlver_lib.stats.cluster_bootstrap` (same settings as the judge's).  Metrics a
    predictor has no meaning for are ``None`` (a score, not a change: emotion before and
    reply length have Spearman only; a constant has no rank correlation).  Raises
    ``ValueError`` on mismatched lengths.
    """
    r = np.asarray(recorded, dtype=float)
    if any(np.shape(v) != r.shape for v in predictors.values()) or len(clusters) != r.size:
        raise ValueError("baseline_metrics: recorded, predictors and clusters must have the same length")
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    out = {}
    for name, (_, names) in BASELINES.items():
        if name in predictors:
            absent = [m for m in ("spearman", "sign_agreement", "mae") if m not in names]
            out[name] = _bootstrapped(r, np.asarray(predictors[name], dtype=float), clusters, names, absent, **boot)
    return out


def partial_block(judged: np.ndarray, recorded: np.ndarray, given: np.ndarray, clusters: Sequence[Any],
                  **boot: Any) -> dict[str, Any]:
    """``{"value", "ci"}``: :func:`rlver_lib.stats.partial_spearman` of ``judged`` and
    ``recorded`` given ``given`` (each shape (n,)), its interval from a bootstrap over
    ``clusters`` (:func:`rlver_lib.stats.cluster_bootstrap`); ``None`` where undefined."""
    est = cluster_bootstrap(lambda idx: partial_spearman(judged[idx], recorded[idx], given[idx]), judged.size,
                            clusters, **boot)
    return {"value": _finite(est.value), "ci": [_finite(est.low), _finite(est.high)]}


def first_turn_block(judged: np.ndarray, recorded: np.ndarray, kept: Sequence[Any],
                     **boot: Any) -> dict[str, Any] | None:
    """The first-turn test (:func:`rlver_lib.evaluation.reply_blind.first_turn_spearman`)
    on the first turns of ``kept`` (aligned with ``judged`` and ``recorded``), grouped
    and resampled by SAGE profile (record id): ``n_turns``, ``n_profiles`` (those with
    at least two replies), ``judge`` and ``reply_length`` (the baseline: minus the
    reply's length), each ``{"value", "ci"}``.  ``None`` when no profile has two first
    replies (draw profiles of several files: ``sample_dialogues``)."""
    first = [i for i, t in enumerate(kept) if t.turn == 0]
    groups = np.array([kept[i].record_id for i in first])
    ids, counts = np.unique(groups, return_counts=True)
    shared = set(ids[counts > 1])
    first = [i for i in first if kept[i].record_id in shared]
    if not first:
        return None
    g = [kept[i].record_id for i in first]
    r = recorded[first]
    out: dict[str, Any] = {"n_turns": len(first), "n_profiles": len(shared)}
    length = -np.array([len(kept[i].history[-1]["content"]) for i in first], dtype=float)
    for name, x in (("judge", judged[first]), ("reply_length", length)):
        est = cluster_bootstrap(lambda idx, x=x: first_turn_spearman(x[idx], r[idx], [g[i] for i in idx]),
                                len(first), g, **boot)
        out[name] = {"value": _finite(est.value), "ci": [_finite(est.low), _finite(est.high)]}
    return out


def fold_blocks(judged: np.ndarray, recorded: np.ndarray, boosted: np.ndarray | None, kept: Sequence[Any],
                **boot: Any) -> dict[str, dict[str, Any]]:
    """Per file (:func:`rlver_lib.evaluation.reply_blind.file_of`, one policy model's
    dialogues: the cross-fitting fold): ``n_turns``, ``n_dialogues``, ``spearman``,
    ``sign_agreement``, ``mae`` (with ``_ci``) and, when ``boosted`` is given,
    ``partial_given_boosted`` (:func:`partial_block`); intervals resample the fold's
    dialogues."""
    files = np.array([file_of(t) for t in kept])
    out = {}
    for name in dict.fromkeys(files):
        idx = np.flatnonzero(files == name)
        clusters = [kept[i].dialogue for i in idx]
        block: dict[str, Any] = {"n_turns": int(idx.size), "n_dialogues": len(set(clusters))}
        block.update(_bootstrapped(recorded[idx], judged[idx], clusters, ("spearman", "sign_agreement", "mae"),
                                   **boot))
        if boosted is not None:
            block["partial_given_boosted"] = partial_block(judged[idx], recorded[idx], boosted[idx], clusters, **boot)
        out[name] = block
    return out
