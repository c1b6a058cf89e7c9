"""Resampling statistics for benchmark figures (docs/ARCHITECTURE.md "Code map").

Shared by the benchmark, the paired baseline-vs-trained comparison, judge agreement and
the training curves: :func:`bootstrap_ci` (independent observations),
:func:`cluster_bootstrap_ci` and :func:`cluster_bootstrap` (whole clusters resampled:
dialogues of one scenario, turns of one dialogue), :func:`sign_flip_test` (paired
permutation test: exact, over all 2**n sign patterns, only while
``2**n <= n_resamples + 1``, so up to n = 13 with the default 9,999 resamples; Monte
Carlo above, see :func:`sign_flip_method`), :func:`sign_test`,
:func:`paired_difference` (both tests and the interval of the mean difference),
:func:`seed_pooled_ci` (paired differences of several training seeds, pooled),
:func:`partial_spearman` (rank partial correlation) with
:func:`permutation_test_partial` (its within-dialogue permutation test),
:func:`cohen_kappa` (agreement of two labellings) and :func:`format_p` (a p-value in
words, a Monte Carlo floor as a bound).
Training curves (per-step intervals clustered by scenario) are
:func:`rlver_lib.analysis.runs.curve_with_ci`, built on :func:`cluster_bootstrap_ci`.

Percentile intervals: the ``(1-confidence)/2`` and ``(1+confidence)/2`` percentiles of
the resampled statistic (numpy's linear interpolation); the same inputs and ``seed``
give the same result. :data:`MIN_N` is the smallest sample for which the report shows
an interval, a p-value or a correlation.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

MIN_N = 10
"""Below this many independent units (scenarios, dialogues) an interval, a p-value or
a correlation says little; reports leave it out or grey it and say why."""

#: Default number of within-dialogue permutations of :func:`permutation_test_partial`.
N_PERMUTATIONS = 2000


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


def seed_pooled_ci(
    differences: Sequence[Sequence[float]] | np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """The mean of paired differences over training seeds and scenarios, with a crossed
    bootstrap interval over both.

    ``differences`` has shape (S, J): row s holds training seed s's per-scenario paired
    differences (trained minus baseline) on the same J held-out scenarios, in the same
    order.  The value is the mean of the seeds' mean differences (= the mean of all
    S x J cells).  Each of ``n_boot`` resamples draws S seeds and, independently, J
    scenarios with replacement (``default_rng(seed)``: seeds first, then scenarios) and
    takes the mean of the drawn rows' drawn columns, so the interval carries both the
    seed-to-seed spread of training and the scenario-to-scenario spread of the benchmark
    (a crossed, "two-way" bootstrap; with S = 1 it is :func:`bootstrap_ci` over the
    scenarios).  Raises ``ValueError`` on a ragged, empty or non-finite input.
    """
    try:
        d = np.asarray(differences, dtype=float)
    except ValueError as err:
        raise ValueError(f"seed_pooled_ci needs one row of the same length per seed: {err}") from None
    if d.ndim != 2 or d.size == 0 or not np.isfinite(d).all():
        raise ValueError(f"seed_pooled_ci needs a finite (seeds, scenarios) array, got shape {d.shape}")
    _check(n_boot, confidence)
    n_seeds, n_scenarios = d.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, n_seeds, size=(n_boot, n_seeds))
    cols = rng.integers(0, n_scenarios, size=(n_boot, n_scenarios))
    means = np.array([d[np.ix_(r, c)].mean() for r, c in zip(rows, cols)])
    low, high = _percentiles(means, confidence)
    return Estimate(float(d.mean()), low, high, confidence)


def _sign_flip_exact(n: int, n_resamples: int) -> bool:
    return 2 ** n <= n_resamples + 1


def sign_flip_method(n: int, n_resamples: int = 9999) -> str:
    """How :func:`sign_flip_test` computes its p-value for ``n`` differences, in words.

    ``"exact, all 2^n = N sign patterns"`` when ``2**n <= n_resamples + 1`` (enumerating
    every pattern costs no more than ``n_resamples`` random ones plus the observed one;
    with the default 9,999 that is n <= 13, 2**13 = 8,192); otherwise
    ``"Monte Carlo, B resamples"``.  Only the first wording may be called exact.
    Raises ``ValueError`` when ``n < 1`` or ``n_resamples < 1``.
    """
    if n < 1 or n_resamples < 1:
        raise ValueError(f"sign_flip_method needs n >= 1 and n_resamples >= 1, got {n}, {n_resamples}")
    if _sign_flip_exact(n, n_resamples):
        return f"exact, all 2^{n} = {2 ** n} sign patterns"
    return f"Monte Carlo, {n_resamples} resamples"


def sign_flip_test(differences: Sequence[float] | np.ndarray, *, n_resamples: int = 9999,
                   seed: int = 0) -> float:
    """Two-sided p-value, in (0, 1], of a zero mean for paired ``differences`` (shape (n,)).

    Under the null each difference is as likely positive as negative, so the mean's
    null distribution comes from flipping signs.  A sign pattern s counts as extreme
    when ``|sum(s * d)| >= |sum(d)| - 1e-12 * sum(|d|)`` (the tolerance absorbs float
    rounding of ties).  Two ways, chosen by :func:`sign_flip_method`:

    - **exact** when ``2**n <= n_resamples + 1`` (n <= 13 with the default 9,999):
      every one of the 2**n patterns is enumerated and p = #extreme / 2**n;
    - **Monte Carlo** otherwise: ``n_resamples`` patterns drawn uniformly with
      ``numpy.random.default_rng(seed)`` (``integers(0, 2, size=(rows, n))`` in blocks
      of rows, 1 -> +1, 0 -> -1) and p = (1 + #extreme) / (n_resamples + 1), which is
      never 0 and is a valid p-value, but only an estimate of the exact one
      (standard error about sqrt(p (1-p) / n_resamples)).

    Returns 1.0 when all differences are 0.  Raises ``ValueError`` on empty or
    non-finite input or ``n_resamples < 1``.
    """
    d = np.asarray(differences, dtype=float)
    if d.ndim != 1 or d.size == 0 or not np.all(np.isfinite(d)):
        raise ValueError("sign_flip_test needs a non-empty 1-D sequence of finite differences")
    if n_resamples < 1:
        raise ValueError(f"sign_flip_test needs n_resamples >= 1, got {n_resamples}")
    if not np.any(d):
        return 1.0
    n = d.size
    threshold = abs(d.sum()) - 1e-12 * np.abs(d).sum()
    if _sign_flip_exact(n, n_resamples):
        patterns = (np.arange(2 ** n)[:, None] >> np.arange(n)) & 1
        extreme = int((np.abs((2 * patterns - 1) @ d) >= threshold).sum())
        return extreme / 2 ** n
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 20) // n)
    extreme = 0
    for start in range(0, n_resamples, block):
        rows = min(block, n_resamples - start)
        signs = 2 * rng.integers(0, 2, size=(rows, n)) - 1
        extreme += int((np.abs(signs @ d) >= threshold).sum())
    return (1 + extreme) / (n_resamples + 1)


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
    two-sided sign-flip permutation test (:func:`sign_flip_test`), computed as
    ``p_method`` says (:func:`sign_flip_method`: ``"exact, ..."`` only when every sign
    pattern was enumerated, else ``"Monte Carlo, B resamples"``); ``sign_test_p``: the
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
    p_method: str = ""

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
    (``n_boot``, ``confidence``, ``seed``), ``p_value`` = :func:`sign_flip_test` (d,
    ``n_resamples``, ``seed``; exact only while ``2**n <= n_resamples + 1``, named in
    ``p_method``), ``sign_test_p`` = :func:`sign_test` (d).  Raises ``ValueError`` when the lengths
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
        n_zero=int((d == 0).sum()), p_method=sign_flip_method(int(d.size), n_resamples),
    )


def residuals_on(v: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Residuals of ``v`` (shape (..., n)) after least squares on ``z`` (shape (n,)) with an
    intercept; centred ``v`` when ``z`` is constant."""
    vc = v - v.mean(axis=-1, keepdims=True)
    zc = z - z.mean()
    zz = float(zc @ zc)
    if zz == 0.0:
        return vc
    return vc - np.multiply.outer((vc @ zc) / zz, zc)


def row_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Pearson correlation of each row of ``a`` (shape (..., n)) with ``b`` (shape (n,));
    NaN where a row or ``b`` has no variance (relative to rounding)."""
    a = a - a.mean(axis=-1, keepdims=True)
    b = b - b.mean()
    na, nb = np.sqrt((a * a).sum(axis=-1)), float(np.sqrt(b @ b))
    scale = max(float(np.max(np.abs(a), initial=0.0)), float(np.max(np.abs(b), initial=0.0)), 1.0)
    tol = 1e-9 * scale * np.sqrt(b.size)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = (a @ b) / (na * nb)
    return np.where((na > tol) & (nb > tol), np.clip(r, -1.0, 1.0), np.nan)


def residuals_within(v: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
    """Residuals of ``v`` (shape (..., n)) after least squares on the indicators of
    ``groups`` (integer codes 0..k-1, shape (n,)): ``v`` minus its mean within each group,
    the fixed-effects partialling out; centred ``v`` when ``groups`` is ``None``."""
    if groups is None:
        return v - v.mean(axis=-1, keepdims=True)
    counts = np.bincount(groups)
    means = np.stack([np.bincount(groups, weights=row, minlength=counts.size) for row in v.reshape(-1, v.shape[-1])])
    means = means / np.maximum(counts, 1)
    return v - means[:, groups].reshape(v.shape)


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (each shape (n,)): the Pearson
    correlation of their average ranks (ties as :func:`scipy.stats.spearmanr`), in
    [-1, 1]; NaN for fewer than 2 values or a constant sequence."""
    from scipy.stats import rankdata

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return pearson(rankdata(x), rankdata(y)) if x.size >= 2 else float("nan")


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of ``x`` and ``y`` (each shape (n,)), in [-1, 1]; NaN for
    fewer than 2 values or a constant sequence (:func:`row_corr`)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return float(row_corr(x, y)) if x.size >= 2 else float("nan")


def partial_spearman(x: Sequence[float], y: Sequence[float], z: Sequence[float]) -> float:
    """Spearman partial correlation of ``x`` and ``y`` given ``z`` (each shape (n,)).

    All three are ranked (average ranks for ties, as :func:`scipy.stats.spearmanr`), the
    ranked ``z`` is regressed out of the ranked ``x`` and ``y`` (least squares with an
    intercept), and the result is the Pearson correlation of the two residuals, in
    [-1, 1]: equal to ``(r_xy - r_xz r_yz) / sqrt((1 - r_xz^2) (1 - r_yz^2))`` on Spearman
    correlations.  NaN when fewer than 3 values or a residual has no variance (for
    example ``x`` constant, or a monotone function of ``z``).  Raises ``ValueError`` on
    mismatched lengths.
    """
    from scipy.stats import rankdata

    x, y, z = (np.asarray(v, dtype=float) for v in (x, y, z))
    if x.ndim != 1 or x.shape != y.shape or x.shape != z.shape:
        raise ValueError("partial_spearman needs three 1-D sequences of the same length")
    if x.size < 3:
        return float("nan")
    rz = rankdata(z)
    return float(row_corr(residuals_on(rankdata(x), rz), residuals_on(rankdata(y), rz)))


def permutation_test_partial(judge: Sequence[float], recorded: Sequence[float], before: Sequence[float],
                             clusters: Sequence[Any], *, n_resamples: int = N_PERMUTATIONS,
                             seed: int = 0) -> float | None:
    """Two-sided p-value of :func:`partial_spearman` ``(judge, recorded | before)`` under
    a permutation of the judge's changes within each dialogue (all inputs shape (n,);
    ``clusters`` names each turn's dialogue).

    What it tests: the null hypothesis that, inside each dialogue, the judge's changes
    are exchangeable across the dialogue's turns, i.e. which of its turns got which of
    the judge's changes carries no information about SAGE's recorded change or the
    emotion before.  Each resample shuffles the judge's changes among the turns of every
    dialogue independently (``numpy.random.default_rng(seed)``; the recorded changes and
    emotions stay in place), so every dialogue keeps its own set of judged changes and
    their mean level: agreement that only comes from the judge scoring whole dialogues
    higher or lower (dialogue-level agreement, or the streaks that the emotion before
    carries) is kept under the null and cannot make p small; only turn-by-turn
    agreement within dialogues can.  Dialogues of one turn take part unchanged.

    Returns ``(1 + #{|stat_perm| >= |stat_obs|}) / (n_resamples + 1)`` (in (0, 1]; ties
    within rounding count as at least as extreme), or ``None`` when the observed
    statistic is NaN.  Raises ``ValueError`` for ``n_resamples < 1`` or mismatched lengths.
    """
    from scipy.stats import rankdata

    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    j, r, z = (np.asarray(v, dtype=float) for v in (judge, recorded, before))
    if j.ndim != 1 or not (j.shape == r.shape == z.shape) or len(clusters) != j.size:
        raise ValueError("permutation_test_partial needs 1-D inputs of the same length")
    observed = partial_spearman(j, r, z)
    if not np.isfinite(observed):
        return None
    rz = rankdata(z)
    rj = rankdata(j)  # ranks of a permuted vector = the permuted ranks
    fixed = residuals_on(rankdata(r), rz)
    rng = np.random.default_rng(seed)
    permuted = np.tile(rj, (n_resamples, 1))
    groups: dict[Any, list[int]] = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    for members in groups.values():  # dialogues in order of first appearance
        if len(members) > 1:
            permuted[:, members] = rj[rng.permuted(np.tile(members, (n_resamples, 1)), axis=1)]
    stats = row_corr(residuals_on(permuted, rz), fixed)
    extreme = np.count_nonzero(np.abs(np.nan_to_num(stats, nan=0.0)) >= abs(observed) - 1e-12)
    return float((1 + extreme) / (n_resamples + 1))


def cohen_kappa(a: Sequence[Any], b: Sequence[Any]) -> float:
    """Cohen's kappa of two labellings (Cohen 1960), sklearn's
    :func:`sklearn.metrics.cohen_kappa_score`: (p_o - p_e) / (1 - p_e), with p_o the
    observed agreement and p_e = sum_k p_a(k) p_b(k) the chance agreement.  Labels are
    compared as strings.  Returns NaN when p_e = 1 (both raters use one and the same
    label throughout).  Raises ``ValueError`` on empty or unequal-length inputs."""
    from sklearn.metrics import cohen_kappa_score

    if len(a) != len(b) or not len(a):
        raise ValueError("cohen_kappa needs two non-empty labellings of equal length")
    sa, sb = [str(v) for v in a], [str(v) for v in b]
    if len(set(sa) | set(sb)) == 1:  # p_e = 1: kappa is 0/0
        return float("nan")
    return float(cohen_kappa_score(sa, sb))


def format_p(p: float | None, method: str = "") -> str:
    """A p-value in words: ``"p = 0.0312"`` (3 significant digits), or, where a Monte
    Carlo p-value sits at its floor ``1 / (B + 1)`` (no resample as extreme as the
    observed one; ``method`` as :func:`sign_flip_method` words it, ``"Monte Carlo, B
    resamples"``), ``"p < 1e-4"`` for B = 9,999: the floor is a bound, not an estimate.
    ``"p = n/a"`` for ``None`` or NaN."""
    if p is None or not np.isfinite(p):
        return "p = n/a"
    found = re.match(r"Monte Carlo, (\d+) resamples", method)
    if found:
        floor = 1.0 / (int(found.group(1)) + 1)
        if p <= floor * (1 + 1e-9):
            mantissa, exponent = f"{floor:.0e}".split("e")
            return f"p < {mantissa}e{int(exponent)}"
    return f"p = {p:.3g}"
