"""Reply-blind predictors of SAGE's changes and the first-turn test (docs/BENCHMARK.md
"Judge agreement").

SAGE's judgements run in streaks, so a turn's change can be guessed without reading the
reply: from the emotion before, the previous change, the turn index and the reply's
length.  :func:`reply_blind_predictors` holds the fixed rules (:data:`BASELINES`) and
:func:`crossfit_reply_blind` a gradient-boosted model of those four covariates
(:func:`covariates`), cross-fitted by file: a turn of one file (one policy model's
dialogues) is scored by a model fitted on the other files' turns only, so no dialogue is
scored by a model that saw it or its model's other dialogues.  An appraisal that reads
the reply must add to that prediction (partial Spearman given it).

:func:`first_turn_spearman` is the first-turn test: every first reply to a SAGE profile
has the same context (emotion 40, the same opening line), so across the models' replies
to one opening only the reply differs; the Spearman is taken within profile.

Turns are :class:`rlver_lib.evaluation.agreement.ReplayTurn` (read here by attribute).
Nothing like this exists in SAGE or RLVER.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from rlver_lib.appraiser import covariates
from rlver_lib.stats import row_corr

#: Fixed reply-blind predictors of a turn's change (:func:`reply_blind_predictors`):
#: name -> (description, the metrics that mean something for it).  ``boosted`` is
#: :func:`crossfit_reply_blind`'s prediction, added by the caller.
BASELINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "emotion_before": ("the emotion before (a score)", ("spearman",)),
    "threshold_rule": ("+5 if emotion before >= 40, else -5", ("spearman", "sign_agreement", "mae")),
    "reply_length": ("shorter reply scores higher", ("spearman",)),
    "constant": ("constant +5", ("sign_agreement", "mae")),
    "boosted": ("gradient-boosted (emotion before, previous change, turn, length), other files",
                ("spearman", "sign_agreement", "mae")),
}

def file_of(turn: Any) -> str:
    """The file label of a turn: its ``dialogue`` (``<file>:<record id>``) before the last colon."""
    return turn.dialogue.rsplit(":", 1)[0]


def reply_blind_predictors(turns: Sequence[Any]) -> dict[str, np.ndarray]:
    """The fixed :data:`BASELINES` predictors of ``turns`` (all but ``boosted``), each
    shape (n,), none reading the reply's content: ``emotion_before`` (0-100),
    ``threshold_rule`` (+5 when emotion_before >= 40, else -5), ``reply_length`` (minus
    the reply's length in characters: shorter scores higher), ``constant`` (+5)."""
    before = np.array([t.emotion_before for t in turns], dtype=float)
    return {"emotion_before": before,
            "threshold_rule": np.where(before >= 40, 5.0, -5.0),
            "reply_length": -np.array([len(t.history[-1]["content"]) for t in turns], dtype=float),
            "constant": np.full(len(turns), 5.0)}


def crossfit_reply_blind(turns: Sequence[Any], pool: Sequence[Any], *, seed: int = 0) -> np.ndarray:
    """The gradient-boosted reply-blind prediction of each of ``turns`` (shape (n,),
    emotion points), cross-fitted by file.

    For each file among ``turns`` (:func:`file_of`), a
    :class:`sklearn.ensemble.GradientBoostingRegressor` (squared error, 100 trees of
    depth 3, learning rate 0.05, ``random_state=seed``) is fitted on the
    :func:`covariates` and recorded changes of every turn of ``pool`` (all the turns
    available, not only the scored sample) from the *other* files, and predicts that
    file's turns.  Raises ``ValueError`` when ``pool`` holds fewer than two files or a
    file of ``turns`` has no other file to learn from.
    """
    from sklearn.ensemble import GradientBoostingRegressor

    pool = list(pool)
    files = sorted({file_of(t) for t in pool})
    if len(files) < 2:
        raise ValueError("crossfit_reply_blind needs turns of at least two files (models) to cross-fit")
    x_pool, y_pool = covariates(pool), np.array([t.recorded_change for t in pool], dtype=float)
    pool_files = np.array([file_of(t) for t in pool])
    x = covariates(turns, pool)
    out = np.full(len(turns), np.nan)
    turn_files = np.array([file_of(t) for t in turns])
    for name in sorted(set(turn_files)):
        train = pool_files != name
        if not train.any():
            raise ValueError(f"crossfit_reply_blind: no other file to fit {name}'s prediction on")
        model = GradientBoostingRegressor(n_estimators=100, max_depth=3, learning_rate=0.05, random_state=seed)
        model.fit(x_pool[train], y_pool[train])
        scored = turn_files == name
        out[scored] = model.predict(x[scored])
    return out


def _within_ranks(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Average ranks of ``values`` inside each group, centred on the group's mean rank."""
    from scipy.stats import rankdata

    out = np.zeros(values.size)
    for g in np.unique(groups):
        members = groups == g
        ranks = rankdata(values[members])
        out[members] = ranks - ranks.mean()
    return out


def first_turn_spearman(x: Sequence[float], y: Sequence[float], groups: Sequence[Any]) -> float:
    """Within-profile Spearman of ``x`` and ``y`` (shape (n,)), grouped by ``groups``.

    Each value is ranked inside its group (average ranks for ties) and centred on the
    group's mean rank; the result is the Pearson correlation of the pooled centred ranks
    (groups of one value contribute nothing).  With groups of two it is the share of
    concordant minus discordant pairs, weighted; between-group level differences (one
    profile is easier) cannot make it positive.  NaN when no group has two values or a
    side has no within-group variance.
    """
    x, y, g = np.asarray(x, dtype=float), np.asarray(y, dtype=float), np.asarray(groups)
    if x.shape != y.shape or x.shape != g.shape or x.ndim != 1:
        raise ValueError("first_turn_spearman needs three 1-D sequences of the same length")
    if x.size < 2:
        return float("nan")
    return float(row_corr(_within_ranks(x, g), _within_ranks(y, g)))
