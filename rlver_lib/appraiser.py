"""The learned appraiser: a small classifier on frozen features of the embedded simulator
model, fitted to SAGE's stored judgements (docs/BENCHMARK.md "Measuring a judge before trusting it";
issue "an emotion reward that reads the reply").

Feature recipe (:data:`FEATURE_RECIPE`): the input token embeddings of Qwen2.5-Coder-1.5B-Instruct
(the embedded simulator's GGUF in the cache, as ``rlver models prepare`` joins it; layer 0,
dequantised with ``gguf``), mean-pooled over three texts: the hidden intention with the
persona (cached per profile), the last user message and the reply, each cut from the
front to its last :data:`WINDOW` tokens (the cut counted).  Beside them, the reply-blind
covariates (:data:`COVARIATES`, the inputs of the reply-blind baselines of
:mod:`rlver_lib.evaluation.reply_blind`) as their own additive term.  A deeper layer
reads context better but costs about 0.8 s per layer per 128 tokens on two loaded
cores (docs/MEASURED.md), past the 3 s per reply budget.

Head (:data:`HEAD_RECIPE`, :func:`fit_head`): SAGE's changes are four values
(-10, -5, +5, +10), so a multinomial logistic model predicts their distribution from
nine inputs (:data:`INPUTS`): the first principal component of each pooled text, the
covariates, and the cosines of the pooled reply with the user message and with the
profile; the change is the predictive median plus 0.01 x the mean.  On held-out folds
it replaced a ridge on all 4,612 features (Spearman 0.32 -> 0.61, MAE 5.70 -> 4.06;
docs/MEASURED.md), but a twin of the same head on the covariates alone scores about as
well: what it adds by reading the reply is small.  The emotion update stays
``e = clamp(e + clamp(change, -10, 10), 0, 100)``.
The fitted head is a small JSON file (:func:`save_appraiser`, :func:`load_appraiser`)
stamped with the recipe and model; a file for another stamp is refused.
Nothing like this exists in SAGE or RLVER.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rlver_lib.files import atomic_write_json, cache_dir

#: The simulator GGUF the features come from: ``rlver_lib.models``' SIMULATOR_FILENAME and
#: SIMULATOR_SHA256 (restated, not imported: models builds the simulator, which reads this
#: module; tests/test_appraiser.py checks that they agree).
SIMULATOR_FILENAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SIMULATOR_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"

#: Column names of :func:`covariates`.
COVARIATES = ("emotion_before", "previous_change", "turn", "reply_chars")


def covariates(turns: Sequence[Any], history: Sequence[Any] = ()) -> np.ndarray:
    """The reply-blind covariates of ``turns``, shape (n, 4) in :data:`COVARIATES` order:
    the emotion before (0-100), the previous change (SAGE's recorded change of the same
    dialogue's turn ``turn - 1``, looked up among ``turns`` and ``history``; 0 on a first
    turn or when that turn is not replayable), the 0-based policy-turn index and the
    reply's length in characters."""
    recorded = {(t.dialogue, t.turn): t.recorded_change for t in [*history, *turns]}
    return np.array([[t.emotion_before, recorded.get((t.dialogue, t.turn - 1), 0), t.turn,
                      len(t.history[-1]["content"])] for t in turns], dtype=float)



#: Tokens kept of each text (its last ones; longer texts are cut from the front).
WINDOW = 256

#: The feature recipe (the cache key of benchmarks/appraiser_fit.py's features).
FEATURE_RECIPE: dict[str, Any] = {
    "model": SIMULATOR_FILENAME, "model_sha256": SIMULATOR_SHA256,
    "features": "input token embeddings (layer 0), mean-pooled",
    "texts": ["hidden intention + persona", "last user message", "reply"],
    "window_tokens": WINDOW, "covariates": list(COVARIATES),
}

#: SAGE's changes, the head's classes: a recorded change joins the nearest (ties to the
#: lower; SAGE's files hold one 0 among 2,312 turns).
CLASSES = (-10.0, -5.0, 5.0, 10.0)

#: Inverse L2 penalty of the logistic head (sklearn's ``C``); chosen on the held-out
#: folds of benchmarks/appraiser_fit.py, where 1 component a text beat 32 (docs/MEASURED.md).
PENALTY_C = 0.1

#: Names of the head's inputs (:meth:`Appraiser.inputs`).
INPUTS = ("profile_pc1", "user_pc1", "reply_pc1", "emotion_before", "previous_change", "turn",
          "log_reply_chars", "cos_reply_user", "cos_reply_profile")

#: The inputs that do not read the texts: the head on these alone is the reply-blind twin
#: that the learned appraiser is compared with (benchmarks/appraiser_fit.py).
BLIND_INPUTS = ("emotion_before", "previous_change", "turn", "log_reply_chars")


#: The head's recipe; :data:`RECIPE` is the features' and the head's together.
HEAD_RECIPE: dict[str, Any] = {
    "head": "multinomial logistic over SAGE's changes", "classes": list(CLASSES), "penalty_C": PENALTY_C,
    "inputs": list(INPUTS), "components_per_text": 1, "output": "predictive median + 0.01 x predictive mean",
}

#: The shipped appraiser file (package data) and the command that rebuilds it.
SHIPPED = Path(__file__).with_name("appraiser.json")
REBUILD = "python benchmarks/appraiser_fit.py --out rlver_lib/appraiser.json"


#: The whole recipe; its hash is the stamp every appraiser file carries.
RECIPE: dict[str, Any] = {**FEATURE_RECIPE, **HEAD_RECIPE}


class AppraiserFileError(ValueError):
    """A missing, corrupt or foreign appraiser file; the message names the file and
    the command that rebuilds it."""


def stamp(recipe: dict[str, Any] = RECIPE) -> str:
    """sha256 of the recipe's canonical JSON (sorted keys)."""
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


class Embedder:
    """Mean-pooled input token embeddings of the simulator GGUF.

    ``pool(texts)`` -> ``(array (n, d) float32, cuts)``: one row per text, ``cuts`` the
    number of texts longer than :data:`WINDOW` tokens (cut from the front).  Loads the
    tokenizer with transformers and dequantises only ``token_embd.weight`` (151,936 x
    1,536) with ``gguf``.
    """

    def __init__(self, gguf_path: Path | None = None) -> None:
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from transformers import AutoTokenizer

        path = Path(gguf_path or cache_dir() / SIMULATOR_FILENAME)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the simulator GGUF is missing; run: rlver models prepare")
        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tensor = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
        self.table = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        self.table = self.table.reshape(-1, self.table.shape[-1])

    def pool(self, texts: Sequence[str]) -> tuple[np.ndarray, int]:
        rows, cuts = [], 0
        for text in texts:
            ids = self.tokenizer(text or " ", add_special_tokens=False)["input_ids"]
            cuts += len(ids) > WINDOW
            rows.append(self.table[ids[-WINDOW:]].mean(axis=0))
        return np.stack(rows), cuts


def profile_text(scenario: Any) -> str:
    """The hidden intention and the persona of a scenario, one text."""
    return f"{scenario.intention_text}\n{scenario.persona}"


def turn_features(embedder: Embedder, turns: Sequence[Any], scenarios: dict[str, Any],
                  history: Sequence[Any] = ()) -> tuple[np.ndarray, int]:
    """Features of ``turns`` (ReplayTurn-like), shape (n, 3 d + 4): the pooled profile,
    last user message and reply, then :func:`covariates` (``history``: turns whose
    recorded change gives the previous change); with the count of cut texts."""
    profiles = {t.dialogue: profile_text(scenarios[t.dialogue]) for t in turns}
    unique = list(dict.fromkeys(profiles.values()))
    pooled, cuts = embedder.pool(unique)
    by_text = dict(zip(unique, pooled))
    users, cut_u = embedder.pool([_last_user(t.history) for t in turns])
    replies, cut_r = embedder.pool([t.history[-1]["content"] for t in turns])
    prof = np.stack([by_text[profiles[t.dialogue]] for t in turns])
    return np.hstack([prof, users, replies, covariates(turns, history)]), cuts + cut_u + cut_r


def _last_user(history: Sequence[dict[str, str]]) -> str:
    return next((m["content"] for m in reversed(history[:-1]) if m.get("role") == "user"), "")


def _blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Split :func:`turn_features` rows (n, 3 d + 4) into profile, user, reply (n, d) and
    the covariates (n, 4)."""
    d = (x.shape[1] - len(COVARIATES)) // 3
    return x[:, :d], x[:, d:2 * d], x[:, 2 * d:3 * d], x[:, 3 * d:]


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(axis=1) / np.where(norms > 0, norms, 1.0)


@dataclass(frozen=True)
class Appraiser:
    """A fitted head: a multinomial logistic model over :data:`CLASSES` on :data:`INPUTS`.

    ``centers``, ``axes``: shape (3, d), the mean and first principal axis of each pooled
    text (profile, user message, reply); ``columns`` (p,): the indices into
    :data:`INPUTS` the model reads (all nine for the shipped head); ``mean``, ``scale``:
    (p,) standardisation of those inputs; ``coef`` (k, p) and ``intercept`` (k,) of the
    logistic model over ``classes`` (k,).  ``predict(x)`` -> change in emotion points:
    the predictive median class plus 0.01 x the predictive mean (which orders replies
    the median ties), in [-10.1, 10.1] before the simulator's clamp to [-10, 10].
    """

    centers: np.ndarray
    axes: np.ndarray
    columns: np.ndarray
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: np.ndarray
    classes: np.ndarray

    def inputs(self, x: np.ndarray) -> np.ndarray:
        """The unstandardised inputs (n, 9) of :func:`turn_features` rows ``x`` (n, 3 d + 4)."""
        return head_inputs(x, self.centers, self.axes)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        """P(class) per row, shape (n, k), rows summing to 1."""
        z = self.inputs(x)[:, self.columns]
        logits = ((z - self.mean) / self.scale) @ self.coef.T + self.intercept
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return predicted_change(self.probabilities(x), self.classes)


def sage_classes(y: np.ndarray) -> np.ndarray:
    """SAGE's changes ``y`` (n,) mapped to the nearest of :data:`CLASSES` (ties to the lower)."""
    classes = np.asarray(CLASSES)
    return classes[np.abs(np.asarray(y, dtype=float)[:, None] - classes).argmin(axis=1)]


def predicted_change(p: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The head's output from class probabilities ``p`` (n, k) over ``classes`` (k,): the
    predictive median class plus 0.01 x the predictive mean (which orders replies the
    median ties), emotion points, shape (n,)."""
    return classes[(p.cumsum(axis=1) >= 0.5).argmax(axis=1)] + 0.01 * (p @ classes)


def head_inputs(x: np.ndarray, centers: np.ndarray, axes: np.ndarray) -> np.ndarray:
    """:data:`INPUTS` of rows ``x``: each text's projection on its axis (after centring),
    the covariates with the reply length as log(1 + chars), and the cosines of the
    pooled reply with the user message and with the profile.  Shape (n, 9)."""
    profile, user, reply, cov = _blocks(x)
    pcs = [(block - c) @ a for block, c, a in zip((profile, user, reply), centers, axes)]
    return np.column_stack([*pcs, cov[:, :3], np.log1p(cov[:, 3]), _cosine(reply, user), _cosine(reply, profile)])


def fit_head(x: np.ndarray, y: np.ndarray, inputs: Sequence[str] = INPUTS) -> Appraiser:
    """Fit the head on :func:`turn_features` rows ``x`` (n, 3 d + 4) and SAGE's changes
    ``y`` (n,): :class:`sklearn.decomposition.PCA` (1 component) per pooled text, the
    ``inputs`` (names among :data:`INPUTS`; :data:`BLIND_INPUTS` gives the reply-blind
    twin) standardised by their mean and SD (SD 0 -> 1), then
    :class:`sklearn.linear_model.LogisticRegression` (``C`` = :data:`PENALTY_C`) on the
    changes mapped to :data:`CLASSES`.  Raises ValueError on an unknown input name."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise ValueError(f"fit_head: unknown inputs {unknown}; the head reads {list(INPUTS)}")
    columns = np.array([i for i, name in enumerate(INPUTS) if name in inputs])

    pcas = [PCA(n_components=1, random_state=0).fit(block) for block in _blocks(x)[:3]]
    centers = np.stack([p.mean_ for p in pcas])
    axes = np.stack([p.components_[0] for p in pcas])
    z = head_inputs(x, centers, axes)[:, columns]
    mean, scale = z.mean(axis=0), z.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    model = LogisticRegression(C=PENALTY_C, max_iter=5000).fit((z - mean) / scale, sage_classes(y))
    coef, intercept = model.coef_, model.intercept_
    if coef.shape[0] == 1:  # two classes: sklearn keeps one row, for the second class
        coef, intercept = np.vstack([-coef / 2, coef / 2]), np.array([-intercept[0] / 2, intercept[0] / 2])
    return Appraiser(centers, axes, columns, mean, scale, coef, intercept, model.classes_.astype(float))


#: The fields of :class:`Appraiser` as a file stores them (lists of numbers).
_HEAD_FIELDS = ("centers", "axes", "columns", "mean", "scale", "coef", "intercept", "classes")


def save_appraiser(path: Path, head: Appraiser, meta: dict[str, Any]) -> None:
    """Write ``head`` with ``meta`` (data files' sha256, fold scores...), the recipe and
    its stamp as JSON (atomic)."""
    atomic_write_json(Path(path), {"stamp": stamp(), "recipe": RECIPE, **meta,
                                   "head": {k: getattr(head, k).tolist() for k in _HEAD_FIELDS}})


def load_appraiser(path: Path = SHIPPED) -> Appraiser:
    """Read an appraiser file.  Raises :class:`AppraiserFileError` naming the file and
    :data:`REBUILD` when it is missing, not JSON, lacks a field, has fields of
    inconsistent shapes, or carries another recipe's or model's stamp."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        found = data["stamp"]
        head = Appraiser(*(np.asarray(data["head"][k], dtype=int if k == "columns" else float)
                           for k in _HEAD_FIELDS))
    except FileNotFoundError as err:
        raise AppraiserFileError(f"{path}: no appraiser file; rebuild it with: {REBUILD}") from err
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AppraiserFileError(f"{path}: corrupt appraiser file ({type(err).__name__}: {err}); "
                                 f"rebuild it with: {REBUILD}") from err
    if found != stamp():
        raise AppraiserFileError(f"{path}: fitted for another feature recipe or model (stamp {str(found)[:12]}, "
                                 f"this code {stamp()[:12]}); rebuild it with: {REBUILD}")
    k, p = len(head.classes), len(head.columns)
    if not (0 < p <= len(INPUTS) and head.columns.min() >= 0 and head.columns.max() < len(INPUTS)
            and head.centers.shape == head.axes.shape and head.centers.ndim == 2 and head.centers.shape[0] == 3
            and head.mean.shape == head.scale.shape == (p,) and head.coef.shape == (k, p)
            and head.intercept.shape == (k,)):
        raise AppraiserFileError(f"{path}: corrupt appraiser file (head shapes differ); rebuild it with: {REBUILD}")
    return head


@dataclass
class _Turn:
    """A simulator request read as a replay turn (:func:`covariates`, :func:`turn_features`)."""

    dialogue: str
    turn: int
    emotion_before: float
    recorded_change: float
    history: Sequence[dict[str, str]]


class LearnedAppraisal:
    """``simulator.appraisal: learned``: the change of each request from the appraiser
    file (default :data:`SHIPPED`; read at construction, so a missing, corrupt or
    foreign file fails before any dialogue, :class:`AppraiserFileError`).

    ``__call__(requests)`` (``SimulatorRequest``: ``dialogue_id``, ``scenario``,
    ``history`` ending with the reply, ``emotion``, ``turn``) -> one appraisal dict per
    request: ``{"mode": "learned", "checklist": [], "change": float in [-10, 10],
    "texts_cut": int}``.
    The previous change covariate is the change this appraiser gave the same dialogue's
    previous turn.  ``texts_cut`` counts all texts cut to the window so far.
    """

    def __init__(self, path: Path = SHIPPED) -> None:
        self.head = load_appraiser(path)
        self.embedder: Embedder | None = None
        self.previous: dict[tuple[str, int], float] = {}
        self.texts_cut = 0

    def __call__(self, requests: Sequence[Any]) -> list[dict[str, Any]]:
        self.embedder = self.embedder or Embedder()
        turns = [_Turn(r.dialogue_id, r.turn, r.emotion, 0.0, r.history) for r in requests]
        known = [_Turn(d, k, 0.0, c, ()) for (d, k), c in self.previous.items()]
        x, cuts = turn_features(self.embedder, turns, {r.dialogue_id: r.scenario for r in requests}, known)
        self.texts_cut += cuts
        changes = self.head.predict(x)
        for t, c in zip(turns, changes):
            self.previous[(t.dialogue, t.turn)] = float(c)
        # an empty checklist: the reply step reads no appraisal notes, as after `expected`
        return [{"mode": "learned", "checklist": [], "change": float(c), "texts_cut": self.texts_cut}
                for c in changes]
