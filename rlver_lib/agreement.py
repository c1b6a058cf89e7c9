"""Judge agreement: how closely does a simulated user's appraisal follow SAGE's judge?

SAGE's stored benchmark transcripts (``*_result.jsonl``, judged by a DeepSeek-V3-based
simulated user) record, for every appraised policy reply, the emotion before it and the
judge's integer change. :func:`judge_agreement` replays those replies one by one
through our benchmark judge's appraisal (``evaluation.judge``), each with the same
profile, visible history and recorded emotion SAGE's judge saw, and compares the
changes: Spearman's rho, Pearson's r, sign agreement, mean absolute error, a confusion
table of bucketed changes (:data:`BUCKETS`), with bootstrap intervals that resample
dialogues (:func:`rlver_lib.stats.cluster_bootstrap`). References: the rule simulator
on the same turns (a floor) and shuffled pairs (chance).

Nothing like this exists in SAGE or RLVER; docs/ARCHITECTURE.md ("evaluation").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from rlver_lib.stats import MIN_N, cluster_bootstrap

#: Buckets of an emotion change (label, low, high), inclusive bounds.
BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("<=-5", -np.inf, -5), ("-4..-1", -4, -1), ("0", 0, 0), ("1..4", 1, 4), (">=5", 5, np.inf),
)
N_SHUFFLES = 200


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
    :class:`rlver_lib.scenarios.ScenarioFileError` / :class:`rlver_lib.io.JsonlError`
    naming the file and line of a bad record.
    """
    from rlver_lib.io import iter_jsonl
    from rlver_lib.scenarios import load_scenarios

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


def appraise_turns(simulator: Any, turns: Sequence[ReplayTurn], scenarios: dict[str, Any], *,
                   batch_size: int = 8, progress: bool = True, desc: str = "judge appraisals",
                   errors: list[str | None] | None = None) -> list[int | None]:
    """Our judge's change (after the update rule's clamp) for each turn; ``None`` where
    the appraisal failed after its retries (its reason appended to ``errors`` when
    given, ``None`` for the turns that worked).

    Uses ``simulator.appraise`` (appraisal only) when it has one, else ``simulator.step``;
    ``batch_size`` requests per call, in :func:`lane_order` (one turn per dialogue per
    call, each dialogue's turns in order), with a progress bar.
    """
    from rlver_lib.simulator import SimulatorRequest

    call: Callable[[list[Any]], list[Any]] = getattr(simulator, "appraise", None) or simulator.step
    changes: list[int | None] = [None] * len(turns)
    reasons: list[str | None] = [None] * len(turns)
    with tqdm(total=len(turns), desc=desc, unit="turn", disable=not progress) as bar:
        for batch in lane_order(turns, batch_size):
            requests = [SimulatorRequest(f"{turns[i].dialogue}@{turns[i].turn}", scenarios[turns[i].dialogue],
                                         [dict(m) for m in turns[i].history], turns[i].emotion_before, turns[i].turn)
                        for i in batch]
            results = {r.dialogue_id: r for r in call(requests)}
            if set(results) != {q.dialogue_id for q in requests}:
                raise ValueError("the judge's results do not match the requested turns")
            for i, request in zip(batch, requests):
                result = results[request.dialogue_id]
                failed = result.error is not None or result.change is None
                changes[i] = None if failed else int(result.change)
                reasons[i] = (result.error or "no change") if failed else None
            bar.update(len(batch))
    if errors is not None:
        errors.extend(reasons)
    return changes


def bucket(change: float) -> str:
    """The :data:`BUCKETS` label of one change."""
    for label, low, high in BUCKETS:
        if low <= change <= high:
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


def agreement_metrics(recorded: Sequence[float], ours: Sequence[float], clusters: Sequence[Any], *,
                      n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Agreement of ``ours`` with ``recorded`` (both shape (n,), changes in emotion points).

    Returns ``n_turns``, ``n_dialogues`` (distinct ``clusters``), ``spearman``,
    ``pearson``, ``sign_agreement`` (share, [0, 1]), ``mae`` (emotion points), each with
    ``<name>_ci`` = ``[low, high]`` from a bootstrap over clusters, the mean changes, and
    ``confusion`` (:func:`confusion_table` as ``{"buckets", "rows", "columns", "counts"}``).
    A correlation of constant values is ``None``.  Raises ``ValueError`` on empty or
    mismatched input.
    """
    r, o = np.asarray(recorded, dtype=float), np.asarray(ours, dtype=float)
    if r.shape != o.shape or r.ndim != 1 or r.size == 0:
        raise ValueError("agreement_metrics needs two non-empty 1-D sequences of the same length")
    out: dict[str, Any] = {"n_turns": int(r.size), "n_dialogues": int(len(set(clusters)))}
    for name, fn in METRICS.items():
        est = cluster_bootstrap(lambda idx, fn=fn: fn(r[idx], o[idx]), r.size, clusters,
                                n_boot=n_boot, confidence=confidence, seed=seed)
        out[name] = _finite(est.value)
        out[f"{name}_ci"] = [_finite(est.low), _finite(est.high)]
    out["mean_recorded_change"] = float(r.mean())
    out["mean_judge_change"] = float(o.mean())
    table = confusion_table(r, o)
    out["confusion"] = {"buckets": list(table.index), "rows": "recorded (SAGE judge)", "columns": "judge (ours)",
                        "counts": table.to_numpy().tolist()}
    return out


def shuffled_control(recorded: Sequence[float], ours: Sequence[float], *, n_shuffles: int = N_SHUFFLES,
                     seed: int = 0) -> dict[str, Any]:
    """Chance agreement: ``ours`` permuted across turns ``n_shuffles`` times
    (``default_rng(seed)``); per metric the mean over shuffles and its 2.5-97.5 %
    range (``<name>_range``)."""
    r, o = np.asarray(recorded, dtype=float), np.asarray(ours, dtype=float)
    rng = np.random.default_rng(seed)
    values: dict[str, list[float]] = {name: [] for name in METRICS}
    for _ in range(n_shuffles):
        shuffled = rng.permutation(o)
        for name, fn in METRICS.items():
            values[name].append(fn(r, shuffled))
    out: dict[str, Any] = {"n_shuffles": n_shuffles}
    for name, vals in values.items():
        v = np.array(vals, dtype=float)
        v = v[np.isfinite(v)]
        out[name] = _finite(v.mean()) if v.size else None
        out[f"{name}_range"] = [_finite(x) for x in np.percentile(v, [2.5, 97.5])] if v.size else [None, None]
    return out


def judge_agreement(turns: Sequence[ReplayTurn], scenarios: dict[str, Any], simulator: Any, *,
                    n_boot: int = 1000, confidence: float = 0.95, seed: int = 0, batch_size: int = 8,
                    progress: bool = True, floor: Any | None = None) -> dict[str, Any]:
    """Replay ``turns`` through ``simulator`` and measure its agreement with SAGE's judge.

    Returns :func:`agreement_metrics` of the turns our judge appraised (``n_failed``:
    turns whose appraisal failed, left out), plus ``floor_rule`` (the same metrics for
    ``floor``, default the rule simulator, on the same turns), ``control_shuffled``
    (:func:`shuffled_control`) and ``turns`` (one row per turn: ``dialogue, turn,
    emotion_before, recorded, judge, rule, error``).  Raises ``ValueError`` when no turn was
    appraised.
    """
    from rlver_lib.simulator import RuleSimulator

    turns = list(turns)
    if not turns:
        raise ValueError("judge_agreement: no replayable turns")
    errors: list[str | None] = []
    ours = appraise_turns(simulator, turns, scenarios, batch_size=batch_size, progress=progress, errors=errors)
    rule = appraise_turns(floor or RuleSimulator(), turns, scenarios, batch_size=len(turns), progress=False)
    ok = [i for i, c in enumerate(ours) if c is not None]
    if not ok:
        first = next((e for e in errors if e), "unknown")
        raise ValueError(f"judge_agreement: every one of the {len(turns)} appraisals failed; the first: "
                         f"{first[:600]}")
    recorded = [turns[i].recorded_change for i in ok]
    clusters = [turns[i].dialogue for i in ok]
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    result = agreement_metrics(recorded, [ours[i] for i in ok], clusters, **boot)
    result["n_failed"] = len(turns) - len(ok)
    result["floor_rule"] = agreement_metrics(recorded, [rule[i] for i in ok], clusters, **boot)
    result["control_shuffled"] = shuffled_control(recorded, [ours[i] for i in ok], seed=seed)
    result["turns"] = [{"dialogue": t.dialogue, "turn": t.turn, "emotion_before": t.emotion_before,
                        "recorded": t.recorded_change, "judge": c, "rule": r, "error": e}
                       for t, c, r, e in zip(turns, ours, rule, errors)]
    return result


def _fmt(value: float | None, ci: list[float | None] | None = None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.{digits}f}"
    if ci and ci[0] is not None and ci[1] is not None:
        text += f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return text


def format_report(result: dict[str, Any]) -> str:
    """The printed summary of a :func:`judge_agreement` result: the three rows (judge,
    rule floor, shuffled control) and the judge's confusion table."""
    rows = []
    for name, block in (("judge", result), ("rule floor", result["floor_rule"])):
        rows.append({"": name, "spearman": _fmt(block["spearman"], block["spearman_ci"]),
                     "pearson": _fmt(block["pearson"], block["pearson_ci"]),
                     "sign agreement": _fmt(block["sign_agreement"], block["sign_agreement_ci"]),
                     "MAE": _fmt(block["mae"], block["mae_ci"], 1)})
    c = result["control_shuffled"]
    rows.append({"": "shuffled pairs", "spearman": _fmt(c["spearman"], c["spearman_range"]),
                 "pearson": _fmt(c["pearson"], c["pearson_range"]),
                 "sign agreement": _fmt(c["sign_agreement"], c["sign_agreement_range"]),
                 "MAE": _fmt(c["mae"], c["mae_range"], 1)})
    conf = result["confusion"]
    table = pd.DataFrame(conf["counts"], index=pd.Index(conf["buckets"], name="SAGE \\ ours"), columns=conf["buckets"])
    lines = [f"judge agreement over {result['n_turns']} turns of {result['n_dialogues']} dialogues "
             f"({result['n_failed']} appraisal(s) failed, left out); intervals resample dialogues",
             pd.DataFrame(rows).to_string(index=False),
             f"mean change: SAGE judge {result['mean_recorded_change']:+.2f}, ours {result['mean_judge_change']:+.2f}",
             "bucketed changes (rows: SAGE's judge, columns: ours):", table.to_string()]
    if result["n_dialogues"] < MIN_N:
        lines.append(f"note: {result['n_dialogues']} dialogues < {MIN_N}: the intervals say little")
    return "\n".join(lines)


def judge_agreement_command(files: Sequence[str], *, params: str | None = None, overrides: Sequence[str] = (),
                            sample: int | None = None, dialogues: int | None = None, seed: int = 0,
                            json_out: str | None = None, progress: bool = True) -> int:
    """``rlver judge-agreement FILE ... [--params P] [--set k=v ...] [--sample N] [--seed S] [--json OUT]``.

    The judge assessed is ``evaluation.judge`` of the params (default settings when no
    ``--params``) with the ``--set`` overrides.  ``--sample``: turns drawn at random
    (seed ``--seed``); ``--dialogues``: every turn of that many dialogues drawn at random
    (applied first, when both are given); ``--json``: write the result (``n_turns``, ``spearman``,
    ``spearman_ci``, ``sign_agreement``, ``mae``, ...) to OUT.  Returns 0, or 2 after
    printing the error when a file is missing or bad (a bad config raises
    :class:`rlver_lib.config.ConfigError`).
    """
    from rlver_lib.config import build_config, load_config
    from rlver_lib.evaluation import build_judge, close_simulator, judge_description, judge_seed
    from rlver_lib.io import JsonlError, atomic_write_json
    from rlver_lib.scenarios import ScenarioFileError

    cfg = load_config(params, list(overrides)) if params else build_config({}, list(overrides))
    try:
        turns, scenarios = load_replay(files)
        chosen = sample_turns(sample_dialogues(turns, dialogues, seed), sample, seed)
    except (FileNotFoundError, JsonlError, ScenarioFileError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not chosen:
        print("error: the files hold no replayable turn (an assistant reply followed by a change)", file=sys.stderr)
        return 2
    judge = build_judge(cfg.evaluation, cfg.seed)
    try:
        result = judge_agreement(chosen, scenarios, judge, n_boot=cfg.evaluation.bootstrap_samples,
                                 confidence=cfg.evaluation.confidence, seed=seed,
                                 batch_size=cfg.evaluation.judge.concurrency, progress=progress)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        close_simulator(judge)
    result = {"judge": judge_description(cfg.evaluation.judge, judge_seed(cfg.evaluation, cfg.seed)),
              "files": [str(f) for f in files], "sample": sample, "dialogues": dialogues, "seed": seed,
              "n_available_turns": len(turns), **result}
    print(format_report(result))
    if json_out:
        atomic_write_json(Path(json_out), result)
        print(f"written: {json_out}")
    return 0

