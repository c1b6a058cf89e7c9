"""The learned appraiser's file, head and pooling (rlver_lib.appraiser)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlver_lib import appraiser
from rlver_lib.appraiser import (
    WINDOW,
    AppraiserFileError,
    Embedder,
    fit_head,
    load_appraiser,
    save_appraiser,
)


class _CharTokenizer:
    """One token per character: id = its code point modulo 50."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 for c in text]}


def _embedder() -> Embedder:
    e = object.__new__(Embedder)
    e.tokenizer = _CharTokenizer()
    e.table = np.arange(100, dtype=np.float32).reshape(50, 2)
    return e


def test_pooling_keeps_the_last_window_tokens_and_counts_the_cut():
    e = _embedder()
    long = "a" * 5 + "b" * WINDOW  # 5 tokens over the window: the a's are cut
    rows, cuts = e.pool(["ab", long])
    a, b = ord("a") % 50, ord("b") % 50
    np.testing.assert_allclose(rows[0], (e.table[a] + e.table[b]) / 2)
    np.testing.assert_allclose(rows[1], e.table[b])
    assert cuts == 1


def _rows(rng, n=120, d=5):
    """turn_features-like rows: 3 pooled texts of d dims, then the 4 covariates."""
    texts = rng.normal(size=(n, 3 * d))
    cov = np.column_stack([rng.uniform(0, 100, n), rng.choice([-5.0, 5.0], n), rng.integers(0, 5, n),
                           rng.integers(20, 400, n)])
    return np.hstack([texts, cov])


def test_head_is_multinomial_logistic_on_first_components_covariates_and_cosines():
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x, d = _rows(rng), 5
    latent = x[:, 10] + 0.02 * (x[:, 15] - 50) + rng.normal(size=120)
    y = np.array([-10.0, -5.0, 5.0, 10.0])[np.digitize(latent, np.quantile(latent, [0.25, 0.5, 0.75]))]
    y += rng.choice([-2.0, 0.0, 1.0], 120)  # off SAGE's values: each joins the nearest class
    y[0] = 0.0  # equidistant from -5 and +5: joins the lower
    head = fit_head(x, y)
    # by hand: PCA(1) of each text, log(1 + chars), the two cosines, standardised
    profile, user, reply = x[:, :d], x[:, d:2 * d], x[:, 2 * d:3 * d]
    pcs = [PCA(1).fit(b).transform(b)[:, 0] for b in (profile, user, reply)]
    cos = [(reply * b).sum(1) / np.linalg.norm(reply, axis=1) / np.linalg.norm(b, axis=1) for b in (user, profile)]
    z = np.column_stack([*pcs, x[:, 15:18], np.log(1 + x[:, 18]), *cos])
    z = (z - z.mean(0)) / z.std(0)
    labels = np.select([y < -7.5, y <= 0, y < 7.5], [-10.0, -5.0, 5.0], 10.0)  # nearest of -10, -5, 5, 10
    ref = LogisticRegression(C=0.1, max_iter=5000).fit(z, labels)
    # a PCA axis's sign is arbitrary: compare what does not depend on it
    np.testing.assert_allclose(head.probabilities(x), ref.predict_proba(z), atol=1e-4)
    assert list(head.classes) == [-10.0, -5.0, 5.0, 10.0]


def test_prediction_is_the_median_class_plus_a_hundredth_of_the_mean():
    p = np.array([0.3, 0.1, 0.4, 0.2])  # cumulative 0.3, 0.4, 0.8: median +5; mean -3 - 0.5 + 2 + 2 = 0.5
    head = appraiser.Appraiser(np.zeros((3, 1)), np.ones((3, 1)), np.arange(9), np.zeros(9), np.ones(9),
                               np.zeros((4, 9)), np.log(p), np.array([-10.0, -5.0, 5.0, 10.0]))
    assert head.predict(np.ones((1, 7)))[0] == pytest.approx(5.005)


def test_the_reply_blind_twin_never_reads_the_texts():
    rng = np.random.default_rng(2)
    x = _rows(rng)
    x[:, 10] *= 5  # the reply's first dimension: its first principal axis, and it decides
    y = np.where(x[:, 10] > 0, 5.0, -5.0)
    other = x.copy()
    other[:, :15] = rng.normal(size=(120, 15))
    twin = fit_head(x, y, appraiser.BLIND_INPUTS)
    np.testing.assert_array_equal(twin.predict(x), twin.predict(other))
    full = fit_head(x, y)
    assert np.mean(np.sign(full.predict(x)) == np.sign(y)) > 0.8 > np.mean(np.sign(twin.predict(x)) == np.sign(y))
    with pytest.raises(ValueError, match="unknown inputs"):
        fit_head(x, y, ("reply_length",))


def test_file_round_trip_and_its_refusals(tmp_path):
    x = _rows(np.random.default_rng(3), n=40)
    head = fit_head(x, np.resize([10.0, -5.0, 5.0, -10.0], 40))
    path = tmp_path / "a.json"
    save_appraiser(path, head, {"fold_scores": {}})
    again = load_appraiser(path)
    np.testing.assert_allclose(again.predict(x), head.predict(x))
    with pytest.raises(AppraiserFileError, match=r"missing\.json: no appraiser file; rebuild it with: python"):
        load_appraiser(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(AppraiserFileError, match="bad.json: corrupt.*rebuild it with"):
        load_appraiser(tmp_path / "bad.json")
    data = json.loads(path.read_text())
    data["stamp"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(data))
    with pytest.raises(AppraiserFileError, match="another feature recipe or model"):
        load_appraiser(tmp_path / "other.json")


def test_the_stamp_follows_the_recipe(monkeypatch):
    before = appraiser.stamp()
    assert appraiser.stamp({**appraiser.RECIPE, "window_tokens": WINDOW + 1}) != before
    assert appraiser.stamp(dict(reversed(list(appraiser.RECIPE.items())))) == before


def test_the_shipped_file_loads():
    if not appraiser.SHIPPED.is_file():
        pytest.fail(f"{appraiser.SHIPPED} is not shipped; rebuild it with: {appraiser.REBUILD}")
    head = load_appraiser()
    assert head.coef.shape == (4, len(appraiser.INPUTS)) and head.axes.shape == (3, 1536)
    assert appraiser.SHIPPED.stat().st_size < 1_000_000


def test_the_recipe_names_the_embedded_simulator_model():
    from rlver_lib import models

    assert (appraiser.SIMULATOR_FILENAME, appraiser.SIMULATOR_SHA256) == (models.SIMULATOR_FILENAME,
                                                                          models.SIMULATOR_SHA256)


def test_learned_appraisal_predicts_from_pooled_texts_and_its_own_previous_change(tmp_path):
    from types import SimpleNamespace

    from rlver_lib.appraiser import LearnedAppraisal

    e = _embedder()
    rng = np.random.default_rng(1)
    x = np.hstack([rng.normal(size=(30, 6)), rng.uniform(1, 100, size=(30, 4))])  # 3 texts x 2 dims + 4 covariates
    head = fit_head(x, rng.normal(size=30) * 20)
    save_appraiser(tmp_path / "h.json", head, {})
    learned = LearnedAppraisal(tmp_path / "h.json")
    learned.embedder = e
    scenario = SimpleNamespace(intention_text="be heard", persona="Ann")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    first = SimpleNamespace(dialogue_id="d", scenario=scenario, history=history, emotion=40, turn=0)
    (a,) = learned([first])
    pooled = [e.pool([t])[0][0] for t in ("be heard\nAnn", "hi", "hello")]
    x0 = np.concatenate([*pooled, [40, 0, 0, 5]])
    assert a["change"] == pytest.approx(head.predict(x0[None])[0]) and a["mode"] == "learned"
    second = SimpleNamespace(dialogue_id="d", scenario=scenario, history=history, emotion=45, turn=1)
    (b,) = learned([second])
    x1 = np.concatenate([*pooled, [45, a["change"], 1, 5]])
    assert b["change"] == pytest.approx(head.predict(x1[None])[0])
    with pytest.raises(AppraiserFileError):
        LearnedAppraisal(tmp_path / "none.json")
