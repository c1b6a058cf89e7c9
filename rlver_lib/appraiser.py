"""The learned appraiser: a ridge head on frozen features of the embedded simulator
model, fitted to SAGE's stored judgements (docs/BENCHMARK.md "Measuring a judge before trusting it";
issue "an emotion reward that reads the reply").

Feature recipe (:data:`RECIPE`): the input token embeddings of Qwen2.5-Coder-1.5B-Instruct
(the embedded simulator's GGUF in the cache, as ``rlver models prepare`` joins it; layer 0,
dequantised with ``gguf``), mean-pooled over three texts: the hidden intention with the
persona (cached per profile), the last user message and the reply, each cut from the
front to its last :data:`WINDOW` tokens (the cut counted).  Beside them, the reply-blind
covariates (:data:`COVARIATES`, the inputs of the reply-blind baselines of
:mod:`rlver_lib.evaluation.reply_blind`) as their own additive term.  A deeper layer
reads context better but costs about 0.8 s per layer per 128 tokens on two loaded
cores (docs/MEASURED.md), past the 3 s per reply budget.

Head: :class:`sklearn.linear_model.Ridge` on standardised features predicting SAGE's
change; the emotion update stays ``e = clamp(e + clamp(change, -10, 10), 0, 100)``.
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

#: The feature recipe; its hash is the stamp every appraiser file carries.
RECIPE: dict[str, Any] = {
    "model": SIMULATOR_FILENAME, "model_sha256": SIMULATOR_SHA256,
    "features": "input token embeddings (layer 0), mean-pooled",
    "texts": ["hidden intention + persona", "last user message", "reply"],
    "window_tokens": WINDOW, "covariates": list(COVARIATES), "head": "ridge on standardised features",
}

#: The shipped appraiser file (package data) and the command that rebuilds it.
SHIPPED = Path(__file__).with_name("appraiser.json")
REBUILD = "python benchmarks/appraiser_fit.py --out rlver_lib/appraiser.json"


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


@dataclass(frozen=True)
class Appraiser:
    """A fitted head: ``mean``, ``scale`` (standardisation, shape (p,)), ``coef`` (p,),
    ``intercept``; ``predict(x)`` -> change (emotion points, clamped to [-10, 10])."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.clip(((x - self.mean) / self.scale) @ self.coef + self.intercept, -10.0, 10.0)


#: Ridge penalties tried by :func:`fit_head` (efficient leave-one-out, sklearn's RidgeCV).
ALPHAS = tuple(np.logspace(0, 5, 11))


def fit_head(x: np.ndarray, y: np.ndarray) -> Appraiser:
    """Ridge (:class:`sklearn.linear_model.RidgeCV` over :data:`ALPHAS`) on features
    standardised with their mean and SD (SD 0 -> 1); ``x`` shape (n, p), ``y`` (n,)."""
    from sklearn.linear_model import RidgeCV

    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    ridge = RidgeCV(alphas=ALPHAS).fit((x - mean) / scale, y)
    return Appraiser(mean, scale, ridge.coef_, float(ridge.intercept_))


def save_appraiser(path: Path, head: Appraiser, meta: dict[str, Any]) -> None:
    """Write ``head`` with ``meta`` (data files' sha256, fold scores...), the recipe and
    its stamp as JSON (atomic)."""
    atomic_write_json(Path(path), {"stamp": stamp(), "recipe": RECIPE, **meta,
                                   "head": {"mean": head.mean.tolist(), "scale": head.scale.tolist(),
                                            "coef": head.coef.tolist(), "intercept": head.intercept}})


def load_appraiser(path: Path = SHIPPED) -> Appraiser:
    """Read an appraiser file.  Raises :class:`AppraiserFileError` naming the file and
    :data:`REBUILD` when it is missing, not JSON, lacks a field, or carries another
    recipe's or model's stamp."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        found = data["stamp"]
        head = data["head"]
        parts = [np.asarray(head[k], dtype=float) for k in ("mean", "scale", "coef")]
        intercept = float(head["intercept"])
    except FileNotFoundError as err:
        raise AppraiserFileError(f"{path}: no appraiser file; rebuild it with: {REBUILD}") from err
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise AppraiserFileError(f"{path}: corrupt appraiser file ({type(err).__name__}: {err}); "
                                 f"rebuild it with: {REBUILD}") from err
    if found != stamp():
        raise AppraiserFileError(f"{path}: fitted for another feature recipe or model (stamp {str(found)[:12]}, "
                                 f"this code {stamp()[:12]}); rebuild it with: {REBUILD}")
    if not (parts[0].shape == parts[1].shape == parts[2].shape) or parts[0].ndim != 1:
        raise AppraiserFileError(f"{path}: corrupt appraiser file (head shapes differ); rebuild it with: {REBUILD}")
    return Appraiser(*parts, intercept)


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
