"""Resampling statistics for benchmark figures (docs/ARCHITECTURE.md "evaluation").

Shared by the benchmark, the paired baseline-vs-trained comparison, judge agreement and
the training curves: :func:`bootstrap_ci` (independent observations),
:func:`cluster_bootstrap_ci` and :func:`cluster_bootstrap` (whole clusters resampled:
dialogues of one scenario, turns of one dialogue), :func:`sign_flip_test` (paired
permutation test, exact for n <= 16), :func:`sign_test`, :func:`paired_difference`
(both tests and the interval of the mean difference) and :func:`curve_ci` (per-step
curves clustered by scenario).

Percentile intervals: the ``(1-confidence)/2`` and ``(1+confidence)/2`` percentiles of
the resampled statistic (numpy's linear interpolation); the same inputs and ``seed``
give the same result. :data:`MIN_N` is the smallest sample for which the report shows
an interval, a p-value or a correlation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

MIN_N = 10
"""Below this many independent units (scenarios, dialogues) an interval, a p-value or
a correlation says little; reports leave it out or grey it and say why."""


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile bootstrap interval ``[low, high]``."""

    value: float
    low: float
    high: float
    confidence: float


def _check(n_boot: int, confidence: float) -> None:
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _percentiles(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    alpha = (1 - confidence) / 2
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return float("nan"), float("nan")
    low, high = np.percentile(stats, [100 * alpha, 100 * (1 - alpha)])
    return float(low), float(high)


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean of ``values`` (shape (n,)) with a percentile bootstrap confidence interval.

    Draws ``n_boot`` resamples of size n with replacement as one index matrix
    ``numpy.random.default_rng(seed).integers(0, n, size=(n_boot, n))``, takes each
    resample's mean, and returns the ``(1-confidence)/2`` and ``(1+confidence)/2``
    percentiles of those means (numpy's default linear interpolation).

    Raises ``ValueError`` on an empty input, non-finite values, ``n_boot < 1`` or a
    confidence outside (0, 1).
    """
    x = _finite_1d(values, "bootstrap_ci")
    _check(n_boot, confidence)
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    low, high = _percentiles(x[idx].mean(axis=1), confidence)
    return Estimate(float(x.mean()), low, high, confidence)


def _finite_1d(values, name: str) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{name} needs a non-empty 1-D sequence of values")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: values must be finite")
    return x


def _cluster_codes(clusters: Sequence[Any], n: int) -> tuple[np.ndarray, int]:
    if len(clusters) != n:
        raise ValueError(f"clusters has {len(clusters)} labels for {n} values")
    codes, uniques = pd.factorize(pd.Series(list(clusters), dtype=object), sort=False)
    return codes, len(uniques)


def cluster_bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    clusters: Sequence[Any],
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean of ``values`` (shape (n,)) with a bootstrap interval that resamples clusters.

    ``clusters`` (length n) labels each value's cluster (for example its scenario id).
    Each of ``n_boot`` resamples draws C of the C clusters with replacement
    (``default_rng(seed).integers(0, C, size=(n_boot, C))``, clusters numbered in order
    of first appearance) and takes the mean of all values of the drawn clusters
    (sum of their values / number of their values).  With one value per cluster this
    is exactly :func:`bootstrap_ci` with the same seed.

    Raises ``ValueError`` on empty or non-finite input, mismatched lengths or bad
    ``n_boot`` / ``confidence``.
    """
    x = _finite_1d(values, "cluster_bootstrap_ci")
    _check(n_boot, confidence)
    codes, n_clusters = _cluster_codes(clusters, x.size)
    sums = np.bincount(codes, weights=x, minlength=n_clusters)
    counts = np.bincount(codes, minlength=n_clusters).astype(float)
    idx = np.random.default_rng(seed).integers(0, n_clusters, size=(n_boot, n_clusters))
    low, high = _percentiles(sums[idx].sum(axis=1) / counts[idx].sum(axis=1), confidence)
    return Estimate(float(x.mean()), low, high, confidence)


def cluster_bootstrap(
    statistic: Callable[[np.ndarray], float],
    n_units: int,
    clusters: Sequence[Any],
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Any ``statistic`` of clustered data with a cluster-resampling percentile interval.

    ``statistic(index)`` receives an int array of row indices (length varies, rows of
    a drawn cluster appear once per draw) and returns a float; ``n_units`` rows are
    labelled by ``clusters`` (length ``n_units``).  The point value is
    ``statistic(arange(n_units))``.  Resamples whose statistic is not finite (for
    example a correlation of a constant resample) are dropped before the percentiles.
    Raises ``ValueError`` on mismatched lengths, ``n_units < 1`` or bad settings.
    """
    if n_units < 1:
        raise ValueError("cluster_bootstrap needs at least one unit")
    _check(n_boot, confidence)
    codes, n_clusters = _cluster_codes(clusters, n_units)
    members = [np.flatnonzero(codes == c) for c in range(n_clusters)]
    idx = np.random.default_rng(seed).integers(0, n_clusters, size=(n_boot, n_clusters))
    stats = np.array([statistic(np.concatenate([members[c] for c in row])) for row in idx], dtype=float)
    low, high = _percentiles(stats, confidence)
    return Estimate(float(statistic(np.arange(n_units))), low, high, confidence)


def sign_flip_test(differences: Sequence[float] | np.ndarray, *, n_resamples: int = 9999,
                   seed: int = 0) -> float:
    """Two-sided p-value of a zero mean for paired ``differences`` (shape (n,)).

    Under the null each difference is as likely positive as negative, so the mean's
    null distribution comes from flipping signs at random
    (``scipy.stats.permutation_test`` with one sample and
    ``permutation_type="samples"``; exact over all 2**n sign patterns when
    ``2**n <= n_resamples``).  Returns a p-value in (0, 1]; 1.0 when all differences
    are 0.  Raises ``ValueError`` on empty or non-finite input.
    """
    from scipy.stats import permutation_test

    d = np.asarray(differences, dtype=float)
    if d.ndim != 1 or d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError("sign_flip_test needs a non-empty 1-D sequence of finite differences")
    if not np.any(d):
        return 1.0
    result = permutation_test((d,), np.mean, permutation_type="samples", alternative="two-sided",
                              n_resamples=n_resamples, random_state=np.random.default_rng(seed))
    return float(min(1.0, result.pvalue))


def sign_test(differences: Sequence[float] | np.ndarray) -> float:
    """Two-sided sign test: p-value of ``binomtest(#positive, #non-zero, 0.5)``.

    Zero differences are dropped; 1.0 when none is left.
    """
    from scipy.stats import binomtest

    d = np.asarray(differences, dtype=float)
    n_pos, n_nonzero = int((d > 0).sum()), int((d != 0).sum())
    return 1.0 if n_nonzero == 0 else float(binomtest(n_pos, n_nonzero, 0.5).pvalue)


@dataclass(frozen=True)
class PairedDifference:
    """Condition B minus condition A over the same units (scenarios).

    ``mean_diff`` (units of the compared figure, e.g. emotion points) with its
    percentile bootstrap interval ``[ci_low, ci_high]`` over units; ``p_value``: the
    two-sided sign-flip permutation test (:func:`sign_flip_test`); ``sign_test_p``: the
    sign test; ``n_positive`` / ``n_negative`` / ``n_zero``: units where B is above,
    below or equal to A.
    """

    mean_diff: float
    ci_low: float
    ci_high: float
    confidence: float
    n_scenarios: int
    p_value: float
    sign_test_p: float
    n_positive: int
    n_negative: int
    n_zero: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields."""
        return asdict(self)


def paired_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    n_resamples: int = 9999,
) -> PairedDifference:
    """The paired comparison of ``b`` against ``a`` (both shape (n,), unit i paired).

    Differences ``d = b - a``; ``mean_diff`` = mean(d) with :func:`bootstrap_ci` of d
    (``n_boot``, ``confidence``, ``seed``), ``p_value`` = :func:`sign_flip_test` (d),
    ``sign_test_p`` = :func:`sign_test` (d).  Raises ``ValueError`` when the lengths
    differ or the input is empty or not finite.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: {a.shape} and {b.shape} values are not paired")
    d = b - a
    est = bootstrap_ci(d, n_boot=n_boot, confidence=confidence, seed=seed)
    return PairedDifference(
        mean_diff=est.value, ci_low=est.low, ci_high=est.high, confidence=confidence,
        n_scenarios=int(d.size), p_value=sign_flip_test(d, n_resamples=n_resamples, seed=seed),
        sign_test_p=sign_test(d), n_positive=int((d > 0).sum()), n_negative=int((d < 0).sum()),
        n_zero=int((d == 0).sum()),
    )


def curve_ci(
    table: pd.DataFrame,
    *,
    value: str,
    step: str = "step",
    cluster: str = "scenario_id",
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """A training curve with intervals clustered by scenario.

    ``table`` has one row per dialogue with columns ``step``, ``value`` and ``cluster``
    (GRPO replicas of one scenario share its id).  Returns one row per step (sorted)
    with ``step, mean, low, high, n, n_clusters``, the interval from
    :func:`cluster_bootstrap_ci` over that step's dialogues, seeded ``seed + step
    index``.  Raises ``KeyError`` naming a missing column.
    """
    missing = [c for c in (step, value, cluster) if c not in table.columns]
    if missing:
        raise KeyError(f"curve_ci: missing column(s) {missing}")
    rows = []
    for k, (s, group) in enumerate(sorted(table.groupby(step), key=lambda kv: kv[0])):
        est = cluster_bootstrap_ci(group[value].to_numpy(dtype=float), group[cluster].tolist(),
                                   n_boot=n_boot, confidence=confidence, seed=seed + k)
        rows.append({step: s, "mean": est.value, "low": est.low, "high": est.high,
                     "n": len(group), "n_clusters": int(group[cluster].nunique())})
    return pd.DataFrame(rows, columns=[step, "mean", "low", "high", "n", "n_clusters"])
