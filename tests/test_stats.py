"""Statistics (rlver_lib.stats), checked against hand computations, scipy and exact enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rlver_lib.stats import (
    bootstrap_ci,
    cluster_bootstrap,
    cluster_bootstrap_ci,
    cohen_kappa,
    paired_difference,
    partial_spearman,
    pearson,
    permutation_test_partial,
    residuals_within,
    seed_pooled_ci,
    sign_flip_method,
    sign_flip_test,
    sign_test,
    spearman,
)

# A fixed paired table: 8 scenarios, baseline and trained Sentient scores.
BASELINE = np.array([40.0, 35.0, 52.0, 60.0, 20.0, 45.0, 38.0, 50.0])
TRAINED = np.array([48.0, 33.0, 60.0, 61.0, 30.0, 45.0, 47.0, 56.0])


def test_paired_difference_arithmetic_on_a_fixed_table():
    d = TRAINED - BASELINE  # [8, -2, 8, 1, 10, 0, 9, 6]
    assert d.tolist() == [8, -2, 8, 1, 10, 0, 9, 6]
    result = paired_difference(BASELINE, TRAINED, n_boot=5, confidence=0.8, seed=7)
    assert result.mean_diff == pytest.approx(40 / 8)
    # the bootstrap by hand: 5 resamples of the 8 differences, 10th / 90th percentiles
    idx = np.random.default_rng(7).integers(0, 8, size=(5, 8))
    means = np.sort([d[row].sum() / 8 for row in idx])
    # linear interpolation at positions 0.1 * 4 = 0.4 and 0.9 * 4 = 3.6
    low = means[0] + 0.4 * (means[1] - means[0])
    high = means[3] + 0.6 * (means[4] - means[3])
    assert (result.ci_low, result.ci_high) == pytest.approx((low, high))
    # exact sign-flip test by enumerating all 2**8 sign patterns
    observed = abs(d.mean())
    extreme = sum(abs((d * np.array(signs)).mean()) >= observed - 1e-12
                  for signs in itertools.product([1, -1], repeat=8))
    assert result.p_value == pytest.approx(extreme / 2**8)
    # sign test: 6 positive of 7 non-zero, two-sided binomial(7, 1/2)
    tail = sum(math.comb(7, k) for k in (0, 1, 6, 7)) / 2**7
    assert result.sign_test_p == pytest.approx(tail)
    assert (result.n_scenarios, result.n_positive, result.n_negative, result.n_zero) == (8, 6, 1, 1)
    assert set(result.to_dict()) >= {"mean_diff", "ci_low", "ci_high", "n_scenarios", "p_value"}


def test_paired_difference_matches_scipy_bootstrap_and_permutation_in_distribution():
    from scipy import stats as sps

    rng = np.random.default_rng(0)
    a = rng.normal(50, 10, size=40)
    b = a + rng.normal(3, 4, size=40)
    ours = paired_difference(a, b, n_boot=4000, seed=1, n_resamples=4000)
    ref = sps.bootstrap((b - a,), np.mean, method="percentile", n_resamples=4000,
                        random_state=np.random.default_rng(2)).confidence_interval
    assert ours.ci_low == pytest.approx(ref.low, abs=0.25) and ours.ci_high == pytest.approx(ref.high, abs=0.25)
    assert ours.p_value < 0.001
    with pytest.raises(ValueError, match="not paired"):
        paired_difference([1.0, 2.0], [1.0])


def test_sign_flip_and_sign_test_edge_cases():
    assert sign_flip_test([0.0, 0.0, 0.0]) == 1.0
    assert sign_test([0.0, 0.0]) == 1.0
    # all 4 differences positive: exact two-sided p = 2 / 16
    assert sign_flip_test([1.0, 2.0, 3.0, 4.0]) == pytest.approx(2 / 16)
    with pytest.raises(ValueError):
        sign_flip_test([])
    with pytest.raises(ValueError):
        sign_flip_test([1.0, np.inf])


def test_cluster_bootstrap_resamples_whole_clusters():
    values = np.array([10.0, 20.0, 30.0, 70.0, 80.0, 5.0])
    clusters = ["a", "a", "a", "b", "b", "c"]
    est = cluster_bootstrap_ci(values, clusters, n_boot=6, confidence=0.5, seed=4)
    assert est.value == pytest.approx(values.mean())
    members = {0: [10.0, 20.0, 30.0], 1: [70.0, 80.0], 2: [5.0]}  # clusters in order of appearance
    idx = np.random.default_rng(4).integers(0, 3, size=(6, 3))
    means = np.sort([np.mean([v for c in row for v in members[c]]) for row in idx])
    assert (est.low, est.high) == pytest.approx(tuple(np.percentile(means, [25, 75])))
    # one value per cluster: the plain bootstrap, draw for draw
    plain = bootstrap_ci(values, n_boot=50, seed=3)
    assert cluster_bootstrap_ci(values, list(range(6)), n_boot=50, seed=3) == plain
    with pytest.raises(ValueError, match="labels"):
        cluster_bootstrap_ci(values, ["a"], n_boot=10)


def test_clustered_interval_is_wider_than_the_naive_one_for_replicas():
    # 12 scenarios x 4 identical replicas: resampling replicas as if independent is too narrow
    rng = np.random.default_rng(5)
    per_scenario = rng.normal(50, 15, size=12)
    values = np.repeat(per_scenario, 4)
    clusters = np.repeat(np.arange(12), 4).tolist()
    naive = bootstrap_ci(values, n_boot=2000, seed=0)
    clustered = cluster_bootstrap_ci(values, clusters, n_boot=2000, seed=0)
    assert (clustered.high - clustered.low) > 1.6 * (naive.high - naive.low)


def test_cluster_bootstrap_of_any_statistic():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    est = cluster_bootstrap(lambda idx: float(np.median(x[idx])), 4, ["p", "p", "q", "q"], n_boot=20, seed=0)
    assert est.value == pytest.approx(2.5)
    assert 1.5 <= est.low <= est.high <= 3.5


def test_sign_flip_is_exact_only_while_every_sign_pattern_is_enumerated():
    # 2**13 = 8,192 <= 9,999 + 1 patterns: enumerated; 2**14 = 16,384 > 10,000: Monte Carlo
    assert sign_flip_method(13) == "exact, all 2^13 = 8192 sign patterns"
    assert sign_flip_method(14) == "Monte Carlo, 9999 resamples"
    assert sign_flip_method(3, n_resamples=7).startswith("exact")  # 2**3 = 8 = 7 + 1
    assert sign_flip_method(3, n_resamples=6) == "Monte Carlo, 6 resamples"
    with pytest.raises(ValueError):
        sign_flip_method(0)
    # d = [1, -2, 3], sum 2; the 8 signed sums are +-6, +-4, +-2, 0, 0: six have |sum| >= 2
    assert sign_flip_test([1.0, -2.0, 3.0], n_resamples=7) == 6 / 8
    # all 3 positive, sum 6: only the all-plus and all-minus patterns reach |6|
    assert sign_flip_test([1.0, 2.0, 3.0], n_resamples=7) == 2 / 8
    # 13 positive differences, default resamples: exact, 2 of 8192 patterns
    assert sign_flip_test(np.arange(1.0, 14.0)) == 2 / 2**13
    result = paired_difference(BASELINE, TRAINED, n_boot=5)
    assert result.p_method == "exact, all 2^8 = 256 sign patterns" and result.to_dict()["p_method"] == result.p_method
    assert paired_difference(np.zeros(14), np.arange(1.0, 15.0), n_boot=5).p_method == "Monte Carlo, 9999 resamples"


def test_sign_flip_monte_carlo_above_the_exact_range():
    # n = 6 with 50 resamples: 2**6 = 64 > 51, so 50 random patterns and p = (1 + #extreme) / 51
    d = np.array([3.0, -1.0, 4.0, 1.0, -5.0, 9.0])  # sum 11
    signs = 2 * np.random.default_rng(4).integers(0, 2, size=(50, 6)) - 1
    extreme = int((np.abs(signs @ d) >= 11 - 1e-9).sum())
    assert sign_flip_test(d, n_resamples=50, seed=4) == (1 + extreme) / 51
    # never 0, even when no random pattern is as extreme as the data
    assert sign_flip_test(np.full(40, 1.0), n_resamples=99, seed=0) == 1 / 100
    with pytest.raises(ValueError):
        sign_flip_test([1.0, 2.0], n_resamples=0)


def test_bootstrap_matches_hand_computed_percentiles():
    values = np.array([3.0, 7.0, 1.0, 9.0, 5.0])
    est = bootstrap_ci(values, n_boot=7, confidence=0.9, seed=3)
    idx = np.random.default_rng(3).integers(0, 5, size=(7, 5))
    means = sorted(values[row].mean() for row in idx)
    # 5th / 95th percentile of 7 sorted means, linear interpolation: positions 0.3 and 5.7
    low = means[0] + 0.3 * (means[1] - means[0])
    high = means[5] + 0.7 * (means[6] - means[5])
    assert est.value == pytest.approx(5.0)
    assert (est.low, est.high) == pytest.approx((low, high))
    assert bootstrap_ci(values, n_boot=7, confidence=0.9, seed=3) == est


def test_bootstrap_degenerate_and_errors():
    est = bootstrap_ci([42.0] * 6, n_boot=50, seed=1)
    assert (est.value, est.low, est.high) == (42.0, 42.0, 42.0)
    with pytest.raises(ValueError):
        bootstrap_ci([], n_boot=10)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, np.nan], n_boot=10)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, 2.0], confidence=1.5)


def test_bootstrap_covers_known_mean_about_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    trials = 200
    for t in range(trials):
        sample = rng.normal(10.0, 2.0, size=60)
        est = bootstrap_ci(sample, n_boot=400, seed=t)
        hits += est.low <= 10.0 <= est.high
    assert 0.88 <= hits / trials <= 0.99


def test_spearman_and_pearson_match_scipy_and_are_nan_when_undefined():
    from scipy.stats import pearsonr, spearmanr

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=30), rng.normal(size=30)
    y[:5] = x[:5]  # some agreement
    x[7] = x[8]  # a tie, ranked on average
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    assert pearson(x, y) == pytest.approx(pearsonr(x, y).statistic, abs=1e-12)
    for fn in (spearman, pearson):
        assert math.isnan(fn([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])) and math.isnan(fn([1.0], [2.0]))


def test_residuals_within_removes_each_groups_mean():
    v = np.array([[1.0, 2.0, 6.0, 10.0, 3.0], [0.0, 0.0, 1.0, 1.0, 4.0]])
    groups = np.array([0, 0, 1, 1, 2])
    expected = np.array([[-0.5, 0.5, -2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])  # by hand
    np.testing.assert_allclose(residuals_within(v, groups), expected)
    np.testing.assert_allclose(residuals_within(v[0], groups), expected[0])
    np.testing.assert_allclose(residuals_within(v[0], None), v[0] - v[0].mean())


def test_cohen_kappa_hand_computed():
    # 2x2 table: both yes 20, a yes/b no 5, a no/b yes 10, both no 15 (n=50)
    a = ["y"] * 25 + ["n"] * 25
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    p_o, p_e = 35 / 50, 0.5 * 0.6 + 0.5 * 0.4
    assert cohen_kappa(a, b) == pytest.approx((p_o - p_e) / (1 - p_e))  # 0.4
    assert cohen_kappa(a, b) == pytest.approx(0.4)
    # three labels: diagonal 4+3+1 of 10; marginals a (5,3,2), b (4,4,2)
    a3 = list("xxxxxyyyzz")
    b3 = list("xxxxyyyxzy")  # x:x x4, x:y 1, y:y 2... checked below by counting
    p_o3 = sum(u == v for u, v in zip(a3, b3)) / 10
    pa = {k: a3.count(k) / 10 for k in "xyz"}
    pb = {k: b3.count(k) / 10 for k in "xyz"}
    p_e3 = sum(pa[k] * pb[k] for k in "xyz")
    assert (p_o3, p_e3) == pytest.approx((0.7, 0.5 * 0.5 + 0.3 * 0.4 + 0.2 * 0.1))
    assert cohen_kappa(a3, b3) == pytest.approx((0.7 - 0.39) / (1 - 0.39))
    assert cohen_kappa(["x", "y"], ["x", "y"]) == pytest.approx(1.0)
    assert np.isnan(cohen_kappa(["x", "x"], ["x", "x"]))
    with pytest.raises(ValueError):
        cohen_kappa(["x"], [])


def test_permutation_p_against_exact_enumeration_within_dialogues():
    # two dialogues of four turns: all 4! * 4! = 576 within-dialogue permutations by hand
    # (the reference statistic, partial_spearman, is checked against the textbook formula
    # in test_agreement.py; the exact count 59/576 pins it here too)
    judge = np.array([8, 4, 7, 3, -3, 1, -5, -10.0])  # dialogue b judged lower throughout
    recorded = np.array([5, 10, -5, -10, 5, 5, -10, -5.0])
    before = np.array([37, 53, 54, 21, 29, 22, 58, 28.0])
    clusters = ["a"] * 4 + ["b"] * 4
    observed = partial_spearman(judge, recorded, before)
    stats = [partial_spearman(np.concatenate([judge[:4][list(p)], judge[4:][list(q)]]), recorded, before)
             for p in itertools.permutations(range(4)) for q in itertools.permutations(range(4))]
    exact = np.mean(np.abs(stats) >= abs(observed) - 1e-12)
    assert exact == pytest.approx(59 / 576)  # neither tiny nor 1
    p = permutation_test_partial(judge, recorded, before, clusters, n_resamples=4000, seed=0)
    assert p == pytest.approx(exact, abs=0.025)
    assert permutation_test_partial(judge, recorded, before, clusters, n_resamples=4000, seed=0) == p  # seeded
    # a global shuffle (across dialogues) is a different test and gives a different answer here
    rng = np.random.default_rng(0)
    glob = [partial_spearman(rng.permutation(judge), recorded, before) for _ in range(2000)]
    assert abs(np.mean(np.abs(glob) >= abs(observed) - 1e-12) - exact) > 0.05


def test_permutation_p_sees_only_within_dialogue_agreement():
    rng = np.random.default_rng(3)
    clusters = np.repeat(np.arange(10), 3).tolist()
    recorded = rng.choice([-10, -5, 5, 10], size=30).astype(float)
    before = rng.integers(0, 101, size=30).astype(float)
    # a judge that gives each dialogue SAGE's mean change for it: agreement between dialogues only
    level = np.repeat([recorded[i:i + 3].mean() for i in range(0, 30, 3)], 3)
    stat = partial_spearman(level, recorded, before)
    assert abs(stat) > 0.3
    assert permutation_test_partial(level, recorded, before, clusters, n_resamples=300, seed=0) == 1.0
    # a judge that follows SAGE turn by turn: the smallest p the resamples allow
    assert permutation_test_partial(recorded + 0.1 * before / 100, recorded, before, clusters,
                                    n_resamples=300, seed=0) == pytest.approx(1 / 301)
    assert permutation_test_partial(np.zeros(30), recorded, before, clusters) is None  # constant judge
    with pytest.raises(ValueError):
        permutation_test_partial(recorded, recorded, before, clusters, n_resamples=0)


# --------------------------------------------------------------------------- seeds pooled


def test_seed_pooled_ci_carries_the_spread_between_seeds():
    # each seed's differences are constant over the 5 scenarios (0, 3, 6): a resample's
    # mean is the mean of 3 seeds drawn with replacement, so P(mean = 0) = P(mean = 6)
    # = 1/27 = 3.7 % > 2.5 %: the 95 % interval is exactly [0, 6] around 3
    d = np.repeat([[0.0], [3.0], [6.0]], 5, axis=1)
    est = seed_pooled_ci(d, n_boot=4000, seed=1)
    assert (est.value, est.low, est.high) == (3.0, 0.0, 6.0)


def test_seed_pooled_ci_carries_the_spread_between_scenarios():
    # identical seeds: only the scenario draw matters, so the interval is the plain
    # bootstrap's over the scenarios (same width to sampling error), not a point
    a = np.array([9.7, 3.8, 0.4, 2.8, 6.1, -1.2, 4.4, 5.0, 2.2, 7.9, 1.0, 3.3])
    est = seed_pooled_ci(np.tile(a, (3, 1)), n_boot=4000, seed=2)
    plain = bootstrap_ci(a, n_boot=4000, seed=3)
    assert est.value == pytest.approx(a.mean())
    assert est.low == pytest.approx(plain.low, abs=0.25) and est.high == pytest.approx(plain.high, abs=0.25)
    assert est.high - est.low > 3.0


def test_seed_pooled_ci_is_the_mean_of_the_seeds_means():
    d = np.array([[1.0, 2.0, 6.0], [-3.0, 0.0, 0.0], [4.0, 4.0, 4.0]])  # seed means 3, -1, 4
    assert seed_pooled_ci(d, n_boot=10).value == pytest.approx(2.0)


@pytest.mark.parametrize("bad", [[[1.0, 2.0], [3.0]], [[]], [[1.0, float("nan")]], [1.0, 2.0]])
def test_seed_pooled_ci_refuses_ragged_empty_or_non_finite_input(bad):
    with pytest.raises(ValueError, match="seed_pooled_ci"):
        seed_pooled_ci(bad)
