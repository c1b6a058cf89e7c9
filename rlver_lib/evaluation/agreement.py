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

The references are reply-blind predictors on the same turns
(:mod:`rlver_lib.evaluation.reply_blind`: fixed rules and a gradient-boosted model
cross-fitted by file): SAGE's judgements run in streaks, so the emotion before and the
history already predict a turn's change, and a judge that is handed them can agree with
SAGE without reading the reply.  Evidence that it reads the reply
(:mod:`rlver_lib.evaluation.agreement_stats`): the partial Spearman given the emotion
before and given the boosted prediction, the within-dialogue permutation test, and the
first-turn test (within profile, across the models' replies to one opening).
:func:`retest_noise` measures how much a dialogue's final emotion moves when the
judge's seed changes.

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
from rlver_lib.evaluation.agreement_stats import (
    agreement_metrics,
    baseline_metrics,
    first_turn_block,
    fold_blocks,
    partial_block,
)
from rlver_lib.evaluation.judge import Judge
from rlver_lib.evaluation.reply_blind import (
    BASELINES,
    crossfit_reply_blind,
    file_of,
    reply_blind_predictors,
)
from rlver_lib.files import JsonlError, atomic_write_json, iter_jsonl
from rlver_lib.params import build_config, load_config
from rlver_lib.scenarios import ScenarioFileError, load_scenarios
from rlver_lib.stats import MIN_N, N_PERMUTATIONS, format_p, permutation_test_partial
from rlver_lib.user_prompts import SimulatorRequest

#: Default number of dialogues ``rlver judge-agreement`` draws (:func:`sample_dialogues`).
DEFAULT_DIALOGUES = 64


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
    """Every turn of at least ``n`` dialogues, drawn by profile: SAGE profiles (record
    ids) in a random order (``numpy.random.default_rng(seed).permutation``) are taken
    with every file's dialogue of each, until ``n`` dialogues are reached; kept in file
    order.  All turns when ``n`` is ``None`` or not smaller than the number of
    dialogues.  Whole dialogues: a judge re-reads a dialogue's long profile once per
    slot, so they cost far less per turn than scattered turns; whole profiles: the
    first-turn test compares the models' replies to one opening.  Raises
    ``ValueError`` for n < 1.
    """
    if n is not None and n < 1:
        raise ValueError(f"dialogues must be >= 1, got {n}")
    names = list(dict.fromkeys(t.dialogue for t in turns))
    if n is None or n >= len(names):
        return list(turns)
    by_profile: dict[str, set[str]] = {}
    for t in turns:
        by_profile.setdefault(t.record_id, set()).add(t.dialogue)
    profiles = list(by_profile)
    chosen: set[str] = set()
    for i in np.random.default_rng(seed).permutation(len(profiles)):
        if len(chosen) >= n:
            break
        chosen |= by_profile[profiles[i]]
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
                    retest: Any | None = None, pool: Sequence[ReplayTurn] | None = None) -> dict[str, Any]:
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
    - ``baselines``: :func:`baseline_metrics` of the reply-blind predictors on the same
      turns, ``boosted`` among them when ``pool`` (every available turn; default
      ``turns``) holds two or more files
      (:func:`rlver_lib.evaluation.reply_blind.crossfit_reply_blind`);
    - ``partial_given_boosted``: :func:`partial_block` given that prediction (``None``
      without it);
    - ``first_turn``: :func:`first_turn_block` (within-profile Spearman of first turns);
    - ``folds``: :func:`fold_blocks` per file;
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
    partial = partial_block(j, r, z, clusters, **boot)
    result["partial_spearman"], result["partial_spearman_ci"] = partial["value"], partial["ci"]
    result["permutation_p"] = permutation_test_partial(j, r, z, clusters, n_resamples=permutation_resamples,
                                                       seed=seed)
    result["permutation_resamples"] = int(permutation_resamples)
    predictors = reply_blind_predictors(kept)
    pool = list(turns if pool is None else pool)
    boosted = None
    if len({file_of(t) for t in pool}) > 1:
        boosted = predictors["boosted"] = crossfit_reply_blind(kept, pool, seed=seed)
    result["baselines"] = baseline_metrics(recorded, predictors, clusters, **boot)
    result["partial_given_boosted"] = None if boosted is None else partial_block(j, r, boosted, clusters, **boot)
    result["first_turn"] = first_turn_block(j, r, kept, **boot)
    result["folds"] = fold_blocks(j, r, boosted, kept, **boot)
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


def _ci_text(block: dict[str, Any] | None) -> str:
    return _fmt(block["value"], block["ci"]) or "n/a" if block else "n/a"


def _partial_line(result: dict[str, Any]) -> str:
    """The partial given the boosted reply-blind model and the first-turn test, in words."""
    boosted = result.get("partial_given_boosted")
    text = ("judge: partial Spearman given the gradient-boosted reply-blind prediction "
            + (_ci_text(boosted) if boosted else "n/a (needs two or more files to cross-fit)"))
    first = result.get("first_turn")
    if first:
        text += (f"; first-turn within-profile Spearman {_ci_text(first['judge'])} (reply length "
                 f"{_ci_text(first['reply_length'])}) over {first['n_turns']} first replies to "
                 f"{first['n_profiles']} profiles")
    else:
        text += "; first-turn test: n/a (no profile with two first replies)"
    return text


def _fold_lines(result: dict[str, Any]) -> list[str]:
    """One line per fold (file) of :func:`fold_blocks`."""
    lines = []
    for name, f in result.get("folds", {}).items():
        partial = f.get("partial_given_boosted")
        lines.append(f"fold {name}: {f['n_turns']} turns of {f['n_dialogues']} dialogues; Spearman "
                     f"{_fmt(f['spearman'], f['spearman_ci']) or 'n/a'}, sign agreement "
                     f"{_fmt(f['sign_agreement'], f['sign_agreement_ci'])}, MAE {_fmt(f['mae'], f['mae_ci'], 1)}"
                     + (f", partial given boosted {_ci_text(partial)}" if partial else ""))
    return lines


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
    p, B = result["permutation_p"], result["permutation_resamples"]
    drawn = (f"drawn: {result['n_drawn_dialogues']} of {result['n_available_dialogues']} dialogues; "
             if "n_drawn_dialogues" in result else "")
    lines = [f"judge agreement over {result['n_turns']} turns of {result['n_dialogues']} dialogues "
             f"({drawn}{result['n_failed']} appraisal(s) failed, left out; "
             f"{result.get('n_history_shortened', 0)} prompt(s) shortened to fit the judge's context); "
             "every row on the same turns; intervals resample dialogues",
             pd.DataFrame(rows).to_string(index=False),
             f"judge: Pearson {_fmt(result['pearson'], result['pearson_ci']) or 'n/a'}; partial Spearman given "
             f"the emotion before {_fmt(result['partial_spearman'], result['partial_spearman_ci']) or 'n/a'}, "
             f"within-dialogue permutation {format_p(p, f'Monte Carlo, {B} resamples')} ({B} permutations)",
             _partial_line(result),
             f"negative changes: ours {neg['judge']:.0%}, SAGE judge {neg['recorded']:.0%}; mean change: "
             f"ours {result['mean_judge_change']:+.2f}, SAGE judge {result['mean_recorded_change']:+.2f}"]
    retest = result.get("retest")
    if retest:
        lines.append(f"test-retest noise (second judge seed): SD of a dialogue's final emotion "
                     f"{_fmt(retest['sd'], digits=1) or 'n/a'} (mean |difference| "
                     f"{_fmt(retest['mean_abs_diff'], digits=1) or 'n/a'}) over {retest['n_dialogues']} dialogues, "
                     f"{retest['n_dropped']} left out for a failed appraisal")
    lines += _fold_lines(result)
    lines += ["bucketed changes (rows: SAGE's judge, columns: ours):", table.to_string()]
    if result["n_dialogues"] < MIN_N:
        lines.append(f"note: {result['n_dialogues']} dialogues < {MIN_N}: the intervals say little")
    return "\n".join(lines)


def judge_agreement_command(files: Sequence[str], *, params: str | None = None, overrides: Sequence[str] = (),
                            sample: int | None = None, dialogues: int | None = DEFAULT_DIALOGUES, seed: int = 0,
                            json_out: str | None = None, progress: bool = True,
                            permutations: int = N_PERMUTATIONS, retest_seed: int | None = None,
                            exclude_profiles: str | None = None) -> int:
    """``rlver judge-agreement FILE ... [--params P] [--set k=v ...] [--sample N] [--dialogues D]
    [--seed S] [--permutations B] [--retest-seed R] [--exclude-profiles JSON] [--json OUT]``.

    The judge assessed is ``evaluation.judge`` of the params (default settings when no
    ``--params``) with the ``--set`` overrides.  ``--sample``: turns drawn at random
    (seed ``--seed``); ``--dialogues``: every turn of at least that many dialogues,
    drawn by profile (:func:`sample_dialogues`; default :data:`DEFAULT_DIALOGUES`, 0 or
    ``None`` = all; applied first, when both are given); ``--permutations``: resamples of the
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
        chosen = sample_turns(sample_dialogues(turns, dialogues or None, seed), sample, seed)
    except (FileNotFoundError, JsonlError, ScenarioFileError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not chosen:
        print("error: the files hold no replayable turn (an assistant reply followed by a change)", file=sys.stderr)
        return 2
    judge = Judge.from_config(cfg.evaluation, cfg.seed)
    simulator = judge.simulator
    again = Judge.from_config(retest_cfg.evaluation, retest_cfg.seed) if retest_cfg is not None else None
    retest = again.simulator if again is not None else None
    try:
        result = judge_agreement(chosen, scenarios, simulator, n_boot=cfg.evaluation.n_boot,
                                 confidence=cfg.evaluation.confidence, seed=seed,
                                 batch_size=cfg.evaluation.judge.concurrency, progress=progress,
                                 permutation_resamples=permutations, retest=retest, pool=turns)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        judge.close()
        if again is not None:
            again.close()
    if again is not None:
        result["retest"]["judge"] = again.description
    result = {"judge": judge.description,
              "files": [str(f) for f in files], "sample": sample, "dialogues": dialogues, "seed": seed,
              "exclude_profiles": exclude_profiles,
              "n_available_turns": len(turns), "n_available_dialogues": len({t.dialogue for t in turns}),
              "n_drawn_dialogues": len({t.dialogue for t in chosen}), **result}
    print(format_report(result))
    if json_out:
        atomic_write_json(Path(json_out), result)
        print(f"written: {json_out}")
    return 0
