"""The reply-blind yardstick: the cross-fitted boosted baseline, the first-turn test, the
profile-wise dialogue draw and the p-value wording (rlver_lib.evaluation.reply_blind,
rlver_lib.evaluation.agreement_stats, rlver_lib.stats.format_p)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy.stats import pearsonr, rankdata
from sklearn.ensemble import GradientBoostingRegressor

from rlver_lib.evaluation.agreement import ReplayTurn, sample_dialogues
from rlver_lib.evaluation.agreement_stats import first_turn_block
from rlver_lib.evaluation.reply_blind import covariates, crossfit_reply_blind, first_turn_spearman
from rlver_lib.stats import format_p, sign_flip_method


def _turn(file: str, rid: str, turn: int, before: int, change: int, reply: str) -> ReplayTurn:
    return ReplayTurn(f"{file}:{rid}", rid, turn, before, change, ({"role": "assistant", "content": reply},))


def _files(seed: int = 0) -> list[ReplayTurn]:
    """Three files (models) x 6 profiles x 4 turns of random emotions and changes."""
    rng = np.random.default_rng(seed)
    return [_turn(f, f"p{p}", k, int(rng.integers(0, 101)), int(rng.integers(-10, 11)), "x" * int(rng.integers(1, 90)))
            for f in ("a.jsonl", "b.jsonl", "c.jsonl") for p in range(6) for k in range(4)]


def test_covariates_take_the_previous_turns_recorded_change():
    turns = [_turn("f", "1", 0, 40, 5, "ab"), _turn("f", "1", 1, 45, -3, "abcd"), _turn("f", "2", 1, 30, 2, "a")]
    x = covariates(turns)
    np.testing.assert_array_equal(x, [[40, 0, 0, 2], [45, 5, 1, 4], [30, 0, 1, 1]])  # "2" has no turn 0: 0


def test_boosted_prediction_of_a_file_is_fitted_on_the_other_files_only():
    pool = _files()
    pred = crossfit_reply_blind(pool, pool, seed=3)
    # by hand: file a's prediction from a model fitted on b and c alone
    train = [t for t in pool if not t.dialogue.startswith("a.jsonl")]
    model = GradientBoostingRegressor(n_estimators=100, max_depth=3, learning_rate=0.05, random_state=3)
    model.fit(covariates(train), [t.recorded_change for t in train])
    in_a = np.array([t.dialogue.startswith("a.jsonl") for t in pool])
    np.testing.assert_allclose(pred[in_a], model.predict(covariates(pool)[in_a]))
    # file a's own recorded changes cannot move its prediction (no leak)...
    flipped = [dataclasses.replace(t, recorded_change=-t.recorded_change) if in_a[i] and t.turn > 0 else t
               for i, t in enumerate(pool)]
    again = crossfit_reply_blind(flipped, flipped, seed=3)
    # ... except through the previous-change covariate, which a turn's history shows: turns 0 and 1 are untouched
    first_two = in_a & np.array([t.turn <= 1 for t in pool])
    np.testing.assert_allclose(again[first_two], pred[first_two])
    with pytest.raises(ValueError, match="two files"):
        crossfit_reply_blind(pool[:4], pool[:4])


def test_first_turn_spearman_is_within_profile_by_hand():
    x = [1.0, 2.0, 9.0, 5.0, 3.0, 4.0]
    y = [0.0, 1.0, 7.0, -5.0, -2.0, 6.0]
    g = ["p", "p", "p", "q", "q", "q"]
    cx = np.concatenate([rankdata(x[:3]) - 2, rankdata(x[3:]) - 2])
    cy = np.concatenate([rankdata(y[:3]) - 2, rankdata(y[3:]) - 2])
    assert first_turn_spearman(x, y, g) == pytest.approx(pearsonr(cx, cy).statistic)
    # a level shift of one profile changes nothing; a pooled Spearman would move
    shifted = [v + 100 * (k == "q") for v, k in zip(y, g)]
    assert first_turn_spearman(x, shifted, g) == pytest.approx(first_turn_spearman(x, y, g))
    assert np.isnan(first_turn_spearman([1, 2], [3, 4], ["p", "q"]))  # no profile with two replies


def test_first_turn_block_keeps_profiles_with_two_first_replies():
    kept = [_turn("a", "p1", 0, 40, 5, "long reply"), _turn("b", "p1", 0, 40, -5, "short"),
            _turn("a", "p2", 0, 40, 3, "xx"), _turn("a", "p1", 1, 45, 2, "y")]
    r = np.array([t.recorded_change for t in kept], dtype=float)
    block = first_turn_block(np.array([4.0, -1.0, 0.0, 9.0]), r, kept, n_boot=50, seed=0)
    assert (block["n_turns"], block["n_profiles"]) == (2, 1)
    assert block["judge"]["value"] == pytest.approx(1.0)
    assert block["reply_length"]["value"] == pytest.approx(-1.0)  # the shorter reply got the lower change
    assert first_turn_block(np.zeros(1), r[2:3], kept[2:3], n_boot=10) is None


def test_dialogues_are_drawn_by_whole_profiles_until_enough():
    pool = _files()
    picked = sample_dialogues(pool, 4, seed=1)
    dialogues = {t.dialogue for t in picked}
    profiles = {t.record_id for t in picked}
    assert len(dialogues) == 6 and len(profiles) == 2  # two profiles x three files >= 4
    assert dialogues == {f"{f}:{p}" for f in ("a.jsonl", "b.jsonl", "c.jsonl") for p in profiles}
    assert picked == [t for t in pool if t in picked]


def test_a_p_value_at_the_monte_carlo_floor_is_a_bound():
    method = sign_flip_method(40, 9999)
    assert format_p(1 / 10000, method) == "p < 1e-4"
    assert format_p(0.03125, method) == "p = 0.0312"
    assert format_p(1 / 2000, "Monte Carlo, 1999 resamples") == "p < 5e-4"
    assert format_p(1 / 4096, sign_flip_method(12, 9999)) == "p = 0.000244"  # exact: no floor
    assert format_p(None) == "p = n/a"
