"""The learned appraiser's file, head and pooling (rlver_lib.appraiser)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn.linear_model import RidgeCV

from rlver_lib import appraiser
from rlver_lib.appraiser import (
    ALPHAS,
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


def test_head_is_ridge_on_standardised_features_and_clamps():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 3)) * [1.0, 10.0, 0.1] + 5
    y = 4 * x[:, 0] - 0.2 * x[:, 1] + rng.normal(size=80)
    head = fit_head(x, y)
    z = (x - x.mean(0)) / x.std(0)
    ref = RidgeCV(alphas=ALPHAS).fit(z, y)
    np.testing.assert_allclose(head.predict(x), np.clip(ref.predict(z), -10, 10))
    assert head.predict(np.array([[1e3, 0, 0]]))[0] == 10.0


def test_file_round_trip_and_its_refusals(tmp_path):
    head = fit_head(np.eye(4), np.array([1.0, -2.0, 3.0, 0.0]))
    path = tmp_path / "a.json"
    save_appraiser(path, head, {"fold_scores": {}})
    again = load_appraiser(path)
    np.testing.assert_allclose(again.predict(np.eye(4)), head.predict(np.eye(4)))
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
    assert head.coef.ndim == 1 and head.coef.size == head.mean.size
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
    head = fit_head(rng.normal(size=(30, 10)), rng.normal(size=30) * 20)  # 3 texts x 2 dims + 4 covariates
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
