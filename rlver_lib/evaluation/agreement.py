"""Judge agreement: how closely does a simulated user's appraisal follow SAGE's judge?

SAGE's stored benchmark transcripts (``*_result.jsonl``, judged by a DeepSeek-V3-based
simulated user) record, for every appraised policy reply, the emotion before it and the
judge's change. :func:`judge_agreement` replays those replies one by one through our
benchmark judge's appraisal (``evaluation.judge``), each with the same profile, visible
history and recorded emotion SAGE's judge saw, and compares the changes (integers, or
reals for an expected-value appraisal): Spearman's rho, Pearson's r, sign agreement,
mean absolute error, the shares of negative changes, a confusion table of bucketed
changes (:data:`BUCKETS`), with bootstrap intervals that resample dialogues
(:func:`rlver_lib.stats.cluster_bootstrap`).

The references are reply-blind predictors on the same turns (:data:`BASELINES`):
SAGE's judgements run in streaks, so the emotion before a turn already predicts its
change, and a judge that is handed the emotion and the history can agree with SAGE
without reading the reply.  Evidence that it reads the reply: the partial Spearman
correlation given the emotion before (:func:`partial_spearman`) and its within-dialogue
permutation test (:func:`permutation_test_partial`).  :func:`retest_noise` measures how
much a dialogue's final emotion moves when the judge's seed changes.

Nothing like this exists in SAGE or RLVER; docs/ARCHITECTURE.md ("Code map").
"""

from __future__ import annotations

import json
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from rlver_lib.appraisal import apply_change
from rlver_lib.backends import close_backend
from rlver_lib.config import build_config, load_config
from rlver_lib.evaluation.judge import build_judge, judge_description, judge_seed
from rlver_lib.files import JsonlError, atomic_write_json, iter_jsonl
from rlver_lib.scenarios import ScenarioFileError, load_scenarios
from rlver_lib.stats import MIN_N, cluster_bootstrap
from rlver_lib.user_prompts import SimulatorRequest

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

#: Reply-blind predictors of a turn's change (:func:`reply_blind_predictors`):
#: name -> (description, the metrics that mean something for it).
BASELINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "emotion_before": ("the emotion before (a score)", ("spearman",)),
    "threshold_rule": ("+5 if emotion before >= 40, else -5", ("spearman", "sign_agreement", "mae")),
    "reply_length": ("shorter reply scores higher", ("spearman",)),
    "constant": ("constant +5", ("sign_agreement", "mae")),
}

#: Default number of within-dialogue permutations of :func:`permutation_test_partial`.
N_PERMUTATIONS = 2000


@dataclass(frozen=True)
class ReplayTurn:
    """One appraised policy reply of a stored SAGE dialogue.

    ``dialogue``: ``<file name>:<record id>`` (the resampling cluster); ``turn``: 0-based
    policy-turn index; ``emotion_before``: the recorded emotion before the reply (0-100);
    ``recorded_change``: SAGE's judge's change (-10..10); ``history``: the visible
    messages (``role``, ``content``) up to and including the reply.
    """

    dialogue: str
    record_id: str
    turn: int
    emotion_before: int
    recorded_change: int
    history: tuple[dict[str, str], ...]


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def replay_turns(record: dict[str, Any], file_name: str) -> list[ReplayTurn]:
    """The replayable turns of one SAGE result record: every assistant message preceded
    by a user message with an ``emotion-point`` and followed by a user message whose
    ``planning.change`` is an integer."""
    history = record.get("history") or []
    visible = [{"role": m.get("role"), "content": str(m.get("content") or "")} for m in history]
    turns, policy_turn = [], -1
    for i, message in enumerate(history):
        if message.get("role") != "assistant":
            continue
        policy_turn += 1
        if i == 0 or i + 1 >= len(history):
            continue
        before, after = history[i - 1], history[i + 1]
        emotion = _int(before.get("emotion-point")) if before.get("role") == "user" else None
        planning = after.get("planning") if after.get("role") == "user" else None
        change = _int(planning.get("change")) if isinstance(planning, dict) else None
        if emotion is None or change is None:
            continue
        turns.append(ReplayTurn(f"{file_name}:{record.get('id')}", str(record.get("id")), policy_turn,
                                emotion, change, tuple(visible[: i + 1])))
    return turns


def load_replay(paths: Sequence[str | Path]) -> tuple[list[ReplayTurn], dict[str, Any]]:
    """All replayable turns of SAGE result files and the scenarios they need.

    Returns ``(turns, scenarios)`` with ``scenarios`` keyed by ``ReplayTurn.dialogue``
    (profiles read by :func:`rlver_lib.scenarios.load_scenarios`, which reads SAGE
    result files as RLVER/SAGE profiles).  A file is named by its file name, or by its
    path as given when two files share a name.  Raises ``FileNotFoundError``,
    ``ValueError`` for a file given twice, or
    :class:`rlver_lib.scenarios.ScenarioFileError` / :class:`rlver_lib.files.JsonlError`
    naming the file and line of a bad record.
    """
    paths = [Path(p) for p in paths]
    resolved = [p.resolve() for p in paths]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise ValueError(f"{paths[i]}: given twice")
    names = [p.name for p in paths]
    turns: list[ReplayTurn] = []
    scenarios: dict[str, Any] = {}
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        by_id = {s.id: s for s in load_scenarios(path)}
        label = path.name if names.count(path.name) == 1 else str(path)
        for _, record in iter_jsonl(path):
            found = replay_turns(record, label)
            for t in found:
                scenarios[t.dialogue] = by_id[t.record_id]
            turns += found
    return turns, scenarios


def sample_turns(turns: Sequence[ReplayTurn], n: int | None, seed: int) -> list[ReplayTurn]:
    """``n`` turns drawn without replacement (``numpy.random.default_rng(seed)``), kept in
    file order; all turns when ``n`` is ``None`` or not smaller than their number."""
    if n is not None and n < 1:
        raise ValueError(f"sample must be >= 1, got {n}")
    if n is None or n >= len(turns):
        return list(turns)
    chosen = np.sort(np.random.default_rng(seed).choice(len(turns), size=n, replace=False))
    return [turns[i] for i in chosen]


def sample_dialogues(turns: Sequence[ReplayTurn], n: int | None, seed: int) -> list[ReplayTurn]:
    """Every turn of ``n`` dialogues drawn without replacement
    (``numpy.random.default_rng(seed)``), kept in file order; all turns when ``n`` is
    ``None`` or not smaller than the number of dialogues.  A clustered sample: a judge
    re-reads a dialogue's long profile once per slot, so whole dialogues cost far less
    per turn than turns scattered over many dialogues.  Raises ``ValueError`` for n < 1.
    """
    if n is not None and n < 1:
        raise ValueError(f"dialogues must be >= 1, got {n}")
    names = list(dict.fromkeys(t.dialogue for t in turns))
    if n is None or n >= len(names):
        return list(turns)
    chosen = {names[i] for i in np.random.default_rng(seed).choice(len(names), size=n, replace=False)}
    return [t for t in turns if t.dialogue in chosen]


def lane_order(turns: Sequence[ReplayTurn], lanes: int) -> list[list[int]]:
    """Batches of indices into ``turns``: each batch holds at most one turn per dialogue,
    and one dialogue's turns go out in order in consecutive batches (a "lane" keeps a
    dialogue until its turns run out, then takes the next one).  A server that keeps
    each request's prompt in a slot then finds the previous turn's prompt, a prefix of
    the next one, already computed.  Raises ``ValueError`` for lanes < 1.
    """
    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    queues: dict[str, list[int]] = {}
    for i, t in enumerate(turns):
        queues.setdefault(t.dialogue, []).append(i)
    waiting = list(queues.values())
    active: list[list[int]] = []
    batches: list[list[int]] = []
    while waiting or active:
        while waiting and len(active) < lanes:
            active.append(waiting.pop(0))
        batches.append([queue.pop(0) for queue in active])
        active = [queue for queue in active if queue]
    return batches


def _usable_change(result: Any) -> tuple[int | float | None, str | None]:
    """``(change, None)`` for a usable appraisal, ``(None, reason)`` for a failed one.

    Failed: an ``error`` is set (retries spent, an output cut by the token budget and so
    unparseable, a request the server refused), or the change is missing, not a real
    number (``bool`` included) or not finite.  An integer change stays an ``int``, a real
    one (an expected-value appraisal such as -3.7) a ``float``.
    """
    if result.error is not None:
        return None, str(result.error)
    change = result.change
    if change is None:
        return None, "no change"
    if isinstance(change, (bool, np.bool_)) or not isinstance(change, numbers.Real):
        return None, f"change is not a number: {change!r}"
    if not np.isfinite(float(change)):
        return None, f"change is not finite: {change!r}"
    return (int(change) if isinstance(change, numbers.Integral) else float(change)), None


def appraise_turns(simulator: Any, turns: Sequence[ReplayTurn], scenarios: dict[str, Any], *,
                   batch_size: int = 8, progress: bool = True, desc: str = "judge appraisals",
                   errors: list[str | None] | None = None,
                   dropped: list[int] | None = None) -> list[int | float | None]:
    """Our judge's change (after the update rule's clamp; emotion points) for each turn.

    Returns a list aligned with ``turns``: an ``int`` or, for a real-valued appraisal, a
    ``float``; ``None`` where the appraisal failed for any reason (see
    :func:`_usable_change`), its reason appended to ``errors`` when given (``None`` for the
    turns that worked), and to ``dropped`` the messages left out of the judge's prompt to
    fit its context (:func:`rlver_lib.simulator.fit_history`; 0 for most turns).  Uses
    ``simulator.appraise`` (appraisal only) when it has one, else
    ``simulator.step``; ``batch_size`` requests per call, in :func:`lane_order` (one turn
    per dialogue per call, each dialogue's turns in order), with a progress bar.

    A call that raises for a batch (for example one conversation longer than the
    server's context) is retried one request at a time, so that request fails alone
    (its reason: the exception's type and message) and the others keep their
    judgements.  Raises ``ValueError`` when the judge answers for other turns than asked.
    """
    call: Callable[[list[Any]], list[Any]] = getattr(simulator, "appraise", None) or simulator.step
    changes: list[int | float | None] = [None] * len(turns)
    reasons: list[str | None] = [None] * len(turns)
    left_out = [0] * len(turns)

    def run(batch: list[int]) -> None:
        requests = [SimulatorRequest(f"{turns[i].dialogue}@{turns[i].turn}", scenarios[turns[i].dialogue],
                                     [dict(m) for m in turns[i].history], turns[i].emotion_before, turns[i].turn)
                    for i in batch]
        try:
            answered = call(requests)
        except Exception as err:  # noqa: BLE001 - recorded per turn, counted in n_failed
            if len(batch) > 1:
                for i in batch:
                    run([i])
                return
            changes[batch[0]], reasons[batch[0]] = None, f"{type(err).__name__}: {err}"
            return
        results = {r.dialogue_id: r for r in answered}
        if set(results) != {q.dialogue_id for q in requests}:
            raise ValueError("the judge's results do not match the requested turns")
        for i, request in zip(batch, requests):
            changes[i], reasons[i] = _usable_change(results[request.dialogue_id])
            left_out[i] = getattr(results[request.dialogue_id], "history_dropped", 0)

    with tqdm(total=len(turns), desc=desc, unit="turn", disable=not progress) as bar:
        for batch in lane_order(turns, batch_size):
            run(batch)
            bar.update(len(batch))
    if errors is not None:
        errors.extend(reasons)
    if dropped is not None:
        dropped.extend(left_out)
    return changes


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


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import spearmanr

    if x.size < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    return float(spearmanr(x, y).statistic)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.stats import pearsonr

    if x.size < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    return float(pearsonr(x, y).statistic)


def _sign_agreement(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.sign(x) == np.sign(y)))


def _mae(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.abs(x - y)))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "spearman": _spearman, "pearson": _pearson, "sign_agreement": _sign_agreement, "mae": _mae,
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


def reply_blind_predictors(turns: Sequence[ReplayTurn]) -> dict[str, np.ndarray]:
    """The :data:`BASELINES` predictors of ``turns``, each shape (n,), none reading the
    reply's content: ``emotion_before`` (0-100), ``threshold_rule`` (+5 when
    emotion_before >= 40, else -5), ``reply_length`` (minus the reply's length in
    characters: shorter scores higher), ``constant`` (+5)."""
    before = np.array([t.emotion_before for t in turns], dtype=float)
    return {"emotion_before": before,
            "threshold_rule": np.where(before >= 40, 5.0, -5.0),
            "reply_length": -np.array([len(t.history[-1]["content"]) for t in turns], dtype=float),
            "constant": np.full(len(turns), 5.0)}


def baseline_metrics(recorded: Sequence[float], turns: Sequence[ReplayTurn], clusters: Sequence[Any], *,
                     n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Agreement of each reply-blind predictor (:func:`reply_blind_predictors`) with
    ``recorded`` (shape (n,), aligned with ``turns`` and ``clusters``).

    Returns ``{name: {"spearman", "sign_agreement", "mae"}}`` in :data:`BASELINES` order,
    each value with its ``<metric>_ci`` from :func:`rlver_lib.stats.cluster_bootstrap`
    (same settings as the judge's).  Metrics a predictor has no meaning for are ``None``
    (a score, not a change: emotion before and reply length have Spearman only; a
    constant has no rank correlation).  Raises ``ValueError`` on mismatched lengths.
    """
    r = np.asarray(recorded, dtype=float)
    if r.shape != (len(turns),) or len(clusters) != len(turns):
        raise ValueError("baseline_metrics: recorded, turns and clusters must have the same length")
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    predictors = reply_blind_predictors(turns)
    out = {}
    for name, (_, names) in BASELINES.items():
        absent = [m for m in ("spearman", "sign_agreement", "mae") if m not in names]
        out[name] = _bootstrapped(r, predictors[name], clusters, names, absent, **boot)
    return out


def _residuals(v: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Residuals of ``v`` (shape (..., n)) after least squares on ``z`` (shape (n,)) with an
    intercept; centred ``v`` when ``z`` is constant."""
    vc = v - v.mean(axis=-1, keepdims=True)
    zc = z - z.mean()
    zz = float(zc @ zc)
    if zz == 0.0:
        return vc
    return vc - np.multiply.outer((vc @ zc) / zz, zc)


def _row_corr(a: np.ndarray, b: np.ndarray) -> np.ndarray:
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
    return float(_row_corr(_residuals(rankdata(x), rz), _residuals(rankdata(y), rz)))


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
    fixed = _residuals(rankdata(r), rz)
    rng = np.random.default_rng(seed)
    permuted = np.tile(rj, (n_resamples, 1))
    groups: dict[Any, list[int]] = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    for members in groups.values():  # dialogues in order of first appearance
        if len(members) > 1:
            permuted[:, members] = rj[rng.permuted(np.tile(members, (n_resamples, 1)), axis=1)]
    stats = _row_corr(_residuals(permuted, rz), fixed)
    extreme = np.count_nonzero(np.abs(np.nan_to_num(stats, nan=0.0)) >= abs(observed) - 1e-12)
    return float((1 + extreme) / (n_resamples + 1))


def _chain(start: float, changes: Sequence[float]) -> float:
    e = float(start)
    for c in changes:
        e = apply_change(e, float(c))[1]
    return e


def retest_noise(changes_a: Sequence[float | None], changes_b: Sequence[float | None],
                 turns: Sequence[ReplayTurn]) -> dict[str, Any]:
    """Test-retest noise of a judge: the SD of a dialogue's final emotion across two
    simulator seeds, averaged over dialogues.

    ``changes_a`` and ``changes_b``: two runs of the judge over the same ``turns``
    (aligned with them, emotion points; ``None`` = a failed appraisal), with different
    seeds.  Per dialogue, each run's judged changes are chained in turn order from the
    dialogue's first recorded ``emotion_before`` with the update rule
    ``e = clamp(e + clamp(change, -10, 10), 0, 100)`` (over reals; no early stop at 100
    or below 10, since the replayed dialogue goes on), giving finals ``a`` and ``b``.
    The SD of two values (ddof 1) is ``|a - b| / sqrt(2)``.  Only the sampled turns of a
    dialogue are chained (whole dialogues: ``--dialogues``).  The replay feeds the judge
    the recorded history and emotion, so this is the noise of the appraisals alone,
    not of re-simulated dialogues.

    Returns ``n_dialogues`` (used), ``n_dropped`` (dialogues with a failed appraisal in
    either run, left out), ``mean_abs_diff`` (mean of ``|a - b|``, emotion points),
    ``sd`` (mean of ``|a - b| / sqrt(2)``), ``pooled_sd`` (``sqrt(mean((a - b)^2 / 2))``,
    the root-mean-square form) and ``dialogues`` (``[{"dialogue", "final_a",
    "final_b"}]``); the three figures are ``None`` when no dialogue is left.  Raises
    ``ValueError`` when the lengths differ.
    """
    if not (len(changes_a) == len(changes_b) == len(turns)):
        raise ValueError("retest_noise: changes_a, changes_b and turns must have the same length")
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(turns):
        groups.setdefault(t.dialogue, []).append(i)
    rows, dropped = [], 0
    for dialogue, members in groups.items():
        members = sorted(members, key=lambda i: turns[i].turn)
        if any(changes_a[i] is None or changes_b[i] is None for i in members):
            dropped += 1
            continue
        start = turns[members[0]].emotion_before
        rows.append({"dialogue": dialogue, "final_a": _chain(start, [changes_a[i] for i in members]),
                     "final_b": _chain(start, [changes_b[i] for i in members])})
    diff = np.array([abs(row["final_a"] - row["final_b"]) for row in rows], dtype=float)
    return {"n_dialogues": len(rows), "n_dropped": dropped,
            "mean_abs_diff": float(diff.mean()) if rows else None,
            "sd": float(np.mean(diff / np.sqrt(2))) if rows else None,
            "pooled_sd": float(np.sqrt(np.mean(diff ** 2 / 2))) if rows else None,
            "dialogues": rows}


def judge_agreement(turns: Sequence[ReplayTurn], scenarios: dict[str, Any], simulator: Any, *,
                    n_boot: int = 1000, confidence: float = 0.95, seed: int = 0, batch_size: int = 8,
                    progress: bool = True, permutation_resamples: int = N_PERMUTATIONS,
                    retest: Any | None = None) -> dict[str, Any]:
    """Replay ``turns`` through ``simulator`` and measure its agreement with SAGE's judge.

    Every figure is computed on the turns the judge appraised (``n_failed``: turns
    whose appraisal failed for any reason, left out; their reasons in
    ``turns[i]["error"]``).  Returns :func:`agreement_metrics` (``spearman``, ``pearson``,
    ``sign_agreement``, ``mae`` with ``_ci``; ``share_negative``; ``confusion``), plus:

    - ``partial_spearman``: :func:`partial_spearman` of the judge's change and the
      recorded change given the emotion before; ``partial_spearman_ci`` from a
      bootstrap over dialogues (``n_boot``, ``confidence``, ``seed``);
    - ``permutation_p``: :func:`permutation_test_partial` (within-dialogue permutations,
      ``permutation_resamples`` of them, seed ``seed``), recorded as ``permutation_resamples``;
    - ``baselines``: :func:`baseline_metrics` of the reply-blind predictors on the same turns;
    - ``retest`` (only when a second judge ``retest`` is given, e.g. the same judge with
      another seed): :func:`retest_noise` of the two runs, with ``n_failed`` of the second;
    - ``n_history_shortened``: turns whose prompt was shortened to fit the judge's context;
    - ``turns``: one row per turn: ``dialogue, turn, emotion_before, recorded,
      reply_chars, judge, error, history_dropped`` (and ``judge_retest``, ``error_retest``).

    Figures that cannot be computed (a correlation of constant values, a partial
    correlation of fewer than 3 turns) are ``None``.  Raises ``ValueError`` when no turn
    was appraised, or as :func:`appraise_turns`.
    """
    turns = list(turns)
    if not turns:
        raise ValueError("judge_agreement: no replayable turns")
    errors: list[str | None] = []
    dropped: list[int] = []
    ours = appraise_turns(simulator, turns, scenarios, batch_size=batch_size, progress=progress, errors=errors,
                          dropped=dropped)
    ok = [i for i, c in enumerate(ours) if c is not None]
    if not ok:
        first = next((e for e in errors if e), "unknown")
        raise ValueError(f"judge_agreement: every one of the {len(turns)} appraisals failed; the first: "
                         f"{first[:600]}")
    kept = [turns[i] for i in ok]
    recorded = [t.recorded_change for t in kept]
    judged = [ours[i] for i in ok]
    before = [t.emotion_before for t in kept]
    clusters = [t.dialogue for t in kept]
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    result = agreement_metrics(recorded, judged, clusters, **boot)
    result["n_failed"] = len(turns) - len(ok)
    result["n_history_shortened"] = sum(d > 0 for d in dropped)
    j, r, z = (np.asarray(v, dtype=float) for v in (judged, recorded, before))
    est = cluster_bootstrap(lambda idx: partial_spearman(j[idx], r[idx], z[idx]), len(ok), clusters, **boot)
    result["partial_spearman"] = _finite(est.value)
    result["partial_spearman_ci"] = [_finite(est.low), _finite(est.high)]
    result["permutation_p"] = permutation_test_partial(j, r, z, clusters, n_resamples=permutation_resamples,
                                                       seed=seed)
    result["permutation_resamples"] = int(permutation_resamples)
    result["baselines"] = baseline_metrics(recorded, kept, clusters, **boot)
    rows = [{"dialogue": t.dialogue, "turn": t.turn, "emotion_before": t.emotion_before,
             "recorded": t.recorded_change, "reply_chars": len(t.history[-1]["content"]), "judge": c, "error": e,
             "history_dropped": d}
            for t, c, e, d in zip(turns, ours, errors, dropped)]
    if retest is not None:
        errors_b: list[str | None] = []
        again = appraise_turns(retest, turns, scenarios, batch_size=batch_size, progress=progress,
                               desc="retest appraisals", errors=errors_b)
        result["retest"] = {**retest_noise(ours, again, turns),
                            "n_failed": sum(c is None for c in again)}
        for row, c, e in zip(rows, again, errors_b):
            row["judge_retest"], row["error_retest"] = c, e
    result["turns"] = rows
    return result


def _fmt(value: float | None, ci: list[float | None] | None = None, digits: int = 2) -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    if ci and ci[0] is not None and ci[1] is not None:
        text += f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return text


def format_report(result: dict[str, Any]) -> str:
    """The printed summary of a :func:`judge_agreement` result: the judge's row and, under
    it, one row per reply-blind baseline on the same turns (blank: not meaningful); the
    partial Spearman with its permutation p; the shares of negative changes; the
    test-retest noise when measured; the judge's confusion table."""
    def row(name: str, block: dict[str, Any]) -> dict[str, str]:
        return {"": name, "spearman": _fmt(block["spearman"], block["spearman_ci"]),
                "sign agreement": _fmt(block["sign_agreement"], block["sign_agreement_ci"]),
                "MAE": _fmt(block["mae"], block["mae_ci"], 1)}

    rows = [row("judge (ours)", result)]
    rows += [row(f"baseline: {BASELINES[name][0]}", block) for name, block in result["baselines"].items()]
    width = max(len(r[""]) for r in rows)
    for r in rows:  # names left-aligned
        r[""] = r[""].ljust(width)
    conf = result["confusion"]
    table = pd.DataFrame(conf["counts"], index=pd.Index(conf["buckets"], name="SAGE \\ ours"), columns=conf["buckets"])
    neg = result["share_negative"]
    p = result["permutation_p"]
    lines = [f"judge agreement over {result['n_turns']} turns of {result['n_dialogues']} dialogues "
             f"({result['n_failed']} appraisal(s) failed, left out; "
             f"{result.get('n_history_shortened', 0)} prompt(s) shortened to fit the judge's context); "
             "every row on the same turns; intervals resample dialogues",
             pd.DataFrame(rows).to_string(index=False),
             f"judge: Pearson {_fmt(result['pearson'], result['pearson_ci']) or 'n/a'}; partial Spearman given "
             f"the emotion before {_fmt(result['partial_spearman'], result['partial_spearman_ci']) or 'n/a'}, "
             f"within-dialogue permutation p = {'n/a' if p is None else f'{p:.4f}'} "
             f"({result['permutation_resamples']} permutations)",
             f"negative changes: ours {neg['judge']:.0%}, SAGE judge {neg['recorded']:.0%}; mean change: "
             f"ours {result['mean_judge_change']:+.2f}, SAGE judge {result['mean_recorded_change']:+.2f}"]
    retest = result.get("retest")
    if retest:
        lines.append(f"test-retest noise (second judge seed): SD of a dialogue's final emotion "
                     f"{_fmt(retest['sd'], digits=1) or 'n/a'} (mean |difference| "
                     f"{_fmt(retest['mean_abs_diff'], digits=1) or 'n/a'}) over {retest['n_dialogues']} dialogues, "
                     f"{retest['n_dropped']} left out for a failed appraisal")
    lines += ["bucketed changes (rows: SAGE's judge, columns: ours):", table.to_string()]
    if result["n_dialogues"] < MIN_N:
        lines.append(f"note: {result['n_dialogues']} dialogues < {MIN_N}: the intervals say little")
    return "\n".join(lines)


def judge_agreement_command(files: Sequence[str], *, params: str | None = None, overrides: Sequence[str] = (),
                            sample: int | None = None, dialogues: int | None = None, seed: int = 0,
                            json_out: str | None = None, progress: bool = True,
                            permutations: int = N_PERMUTATIONS, retest_seed: int | None = None,
                            exclude_profiles: str | None = None) -> int:
    """``rlver judge-agreement FILE ... [--params P] [--set k=v ...] [--sample N] [--dialogues D]
    [--seed S] [--permutations B] [--retest-seed R] [--exclude-profiles JSON] [--json OUT]``.

    The judge assessed is ``evaluation.judge`` of the params (default settings when no
    ``--params``) with the ``--set`` overrides.  ``--sample``: turns drawn at random
    (seed ``--seed``); ``--dialogues``: every turn of that many dialogues drawn at random
    (applied first, when both are given); ``--permutations``: resamples of the
    permutation test (seed ``--seed``); ``--retest-seed``: replay the same turns a second
    time with the judge seeded R (``evaluation.judge.seed=R``) and report the test-retest
    noise (:func:`retest_noise`); ``--exclude-profiles``: leave out every dialogue whose
    SAGE profile (record id) appears in the ``turns`` of an earlier result JSON (this
    command's, or the calibration benchmark's), so figures come from profiles that chose
    nothing; ``--json``: write the :func:`judge_agreement` result to OUT.  Returns 0, or 2
    after printing the error when a file is missing or bad (a bad
    config raises :class:`rlver_lib.config.ConfigError`).
    """
    def config(extra: Sequence[str] = ()) -> Any:
        sets = list(overrides) + list(extra)
        return load_config(params, sets) if params else build_config({}, sets)

    cfg = config()
    retest_cfg = config([f"evaluation.judge.seed={retest_seed}"]) if retest_seed is not None else None
    try:
        turns, scenarios = load_replay(files)
        if exclude_profiles:
            earlier = json.loads(Path(exclude_profiles).read_text())["turns"]
            used = {row["dialogue"].rsplit(":", 1)[-1] for row in earlier}
            turns = [t for t in turns if t.record_id not in used]
        chosen = sample_turns(sample_dialogues(turns, dialogues, seed), sample, seed)
    except (FileNotFoundError, JsonlError, ScenarioFileError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not chosen:
        print("error: the files hold no replayable turn (an assistant reply followed by a change)", file=sys.stderr)
        return 2
    judge = build_judge(cfg.evaluation, cfg.seed)
    again = build_judge(retest_cfg.evaluation, retest_cfg.seed) if retest_cfg is not None else None
    try:
        result = judge_agreement(chosen, scenarios, judge, n_boot=cfg.evaluation.bootstrap_samples,
                                 confidence=cfg.evaluation.confidence, seed=seed,
                                 batch_size=cfg.evaluation.judge.concurrency, progress=progress,
                                 permutation_resamples=permutations, retest=again)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        close_backend(judge)
        if again is not None:
            close_backend(again)
    if retest_cfg is not None:
        result["retest"]["judge"] = judge_description(retest_cfg.evaluation.judge,
                                                      judge_seed(retest_cfg.evaluation, retest_cfg.seed))
    result = {"judge": judge_description(cfg.evaluation.judge, judge_seed(cfg.evaluation, cfg.seed)),
              "files": [str(f) for f in files], "sample": sample, "dialogues": dialogues, "seed": seed,
              "exclude_profiles": exclude_profiles,
              "n_available_turns": len(turns), **result}
    print(format_report(result))
    if json_out:
        atomic_write_json(Path(json_out), result)
        print(f"written: {json_out}")
    return 0
