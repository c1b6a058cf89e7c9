"""The Sentient benchmark (RLVER §4.1): held-out scenarios played against the judge,
summarised with scenario-bootstrap intervals (docs/BENCHMARK.md).

Protocols ``full`` (every reply appraised) and ``sage`` (SAGE's stored runs: the 10th
reply unappraised). Figures over the dialogues that did not end in a judge error:
Sentient score (mean final emotion, points [0, 100]), success and failure rates (final
>= 100, < 10) and mean turns, with percentile bootstrap intervals that resample scenarios.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from rlver_lib import character
from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.backends import ChatBackend, derive_seed
from rlver_lib.config import EvaluationConfig, SamplingParams
from rlver_lib.files import EvalFolder, atomic_write_json, atomic_write_text, write_jsonl
from rlver_lib.records import DialogueView, dialogue_view
from rlver_lib.rollout import parse_think, policy_messages, run_rollouts
from rlver_lib.stats import Estimate, cluster_bootstrap_ci

BREAKDOWN_FACTORS = ("hidden_intention", "personality", "language")


def transcript_protocol(views: Sequence[DialogueView]) -> dict[str, Any]:
    """Which benchmark protocol a set of transcripts follows, read from the transcripts.

    A dialogue whose last entry is a policy reply with no emotion update after it is
    SAGE's turn rule (the capped dialogue's last reply is never appraised); a dialogue
    in which every reply is followed by an update is consistent with ``full``.
    Returns ``{"protocol": "sage" | "full", "n_last_unappraised", "n_all_appraised",
    "policy_replies", "appraised_replies"}``: ``sage`` when at least one dialogue ends
    unappraised, else ``full``.  Dialogues that ended early look the same under both.
    """
    unappraised = sum(v.last_unappraised for v in views)
    return {
        "protocol": "sage" if unappraised else "full",
        "n_last_unappraised": int(unappraised),
        "n_all_appraised": int(sum(v.n_appraised >= v.n_turns for v in views)),
        "policy_replies": int(sum(v.n_turns for v in views)),
        "appraised_replies": int(sum(v.n_appraised for v in views)),
    }


# --------------------------------------------------------------------------- summary


@dataclass
class BenchmarkSummary:
    """Benchmark figures over ``n`` scored dialogues (units: see the module docstring).

    ``n_error``: dialogues that ended with termination ``error`` (the judge gave no
    usable appraisal); they are left out of every figure.  ``error_rate`` =
    n_error / (n + n_error), in [0, 1).  Bounds on what the errors could do to the
    Sentient score (points, over all n + n_error dialogues): ``score_errors_as_zero``
    (each errored dialogue counted at 0, the lowest final emotion it could have
    reached) and ``score_errors_as_100`` (counted at 100); the score the complete
    benchmark would have had lies in ``[score_errors_as_zero, score_errors_as_100]``,
    whatever the errored dialogues would have done.  ``score_errors_at_last``: the
    errored ones counted at their last recorded emotion, a point guess and **not** a
    bound (kept for callers that print it).  ``terminations``: count per
    termination (ours; empty for SAGE records), ``n_context_limit`` among them.
    ``n_scenarios``: distinct scenarios among the scored dialogues (the resampling
    unit of every interval).
    ``breakdown``: one row per (factor, level) with columns ``factor, level, n,
    n_scenarios, sentient_score, sentient_low, sentient_high, success_rate,
    failure_rate, mean_turns``; within each factor the ``n`` sum to the total.
    ``trajectory``: one row per turn with ``turn, mean_emotion`` (carried forward),
    ``mean_emotion_alive``, ``n_alive``.
    """

    n: int
    n_success: int
    n_failure: int
    sentient_score: Estimate
    success_rate: Estimate
    failure_rate: Estimate
    mean_turns: Estimate
    breakdown: pd.DataFrame = field(repr=False)
    trajectory: pd.DataFrame = field(repr=False)
    n_error: int = 0
    n_scenarios: int = 0
    error_rate: float = 0.0
    score_errors_at_last: float = float("nan")
    score_errors_as_zero: float = float("nan")
    score_errors_as_100: float = float("nan")
    terminations: dict[str, int] = field(default_factory=dict)
    protocol_observed: dict[str, Any] = field(default_factory=dict)

    @property
    def n_context_limit(self) -> int:
        """Dialogues the policy's context budget stopped (termination ``context_limit``)."""
        return self.terminations.get("context_limit", 0)

    def to_dict(self) -> dict[str, Any]:
        """The headline figures as plain JSON-able data (what ``summary.json`` holds)."""
        out: dict[str, Any] = {"n": self.n, "n_success": self.n_success, "n_failure": self.n_failure,
                               "n_error": self.n_error, "n_scenarios": self.n_scenarios,
                               "n_context_limit": self.n_context_limit, "error_rate": self.error_rate,
                               "score_errors_at_last": self.score_errors_at_last,
                               "score_errors_as_zero": self.score_errors_as_zero,
                               "score_errors_as_100": self.score_errors_as_100,
                               "terminations": dict(self.terminations),
                               "protocol_observed": dict(self.protocol_observed)}
        for name in ("sentient_score", "success_rate", "failure_rate", "mean_turns"):
            out[name] = asdict(getattr(self, name))
        return out


def _group_figures(views: list[DialogueView], boot: dict[str, Any]) -> dict[str, float]:
    final = np.array([v.final_emotion for v in views])
    score = cluster_bootstrap_ci(final, [v.scenario_id for v in views], **boot)
    return {
        "n": len(views),
        "n_scenarios": len({v.scenario_id for v in views}),
        "sentient_score": score.value,
        "sentient_low": score.low,
        "sentient_high": score.high,
        "success_rate": float((final >= SUCCESS_EMOTION).mean()),
        "failure_rate": float((final < FAILURE_EMOTION).mean()),
        "mean_turns": float(np.mean([v.n_turns for v in views])),
    }


BREAKDOWN_COLUMNS = ["factor", "level", "n", "n_scenarios", "sentient_score", "sentient_low",
                     "sentient_high", "success_rate", "failure_rate", "mean_turns"]


def breakdown_table(views: list[DialogueView], *, n_boot: int = 1000, confidence: float = 0.95,
                    seed: int = 0) -> pd.DataFrame:
    """Per-level figures for each factor of :data:`BREAKDOWN_FACTORS` (levels sorted), the
    Sentient score with an interval that resamples the level's scenarios.  Reports grey
    or drop intervals of levels with fewer than :data:`rlver_lib.stats.MIN_N` scenarios."""
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    rows = []
    for factor in BREAKDOWN_FACTORS:
        levels = sorted({getattr(v, factor) for v in views})
        for level in levels:
            group = [v for v in views if getattr(v, factor) == level]
            rows.append({"factor": factor, "level": level, **_group_figures(group, boot)})
    return pd.DataFrame(rows, columns=BREAKDOWN_COLUMNS)


def trajectory_table(views: list[DialogueView]) -> pd.DataFrame:
    """Mean emotion per turn; ended dialogues carry their final emotion forward."""
    horizon = max(len(v.emotions) for v in views)
    padded = np.array([list(v.emotions) + [v.emotions[-1]] * (horizon - len(v.emotions))
                       for v in views])
    alive = np.array([[t < len(v.emotions) for t in range(horizon)] for v in views])
    alive_sum = np.where(alive, padded, 0.0).sum(axis=0)
    n_alive = alive.sum(axis=0)
    return pd.DataFrame({
        "turn": np.arange(horizon),
        "mean_emotion": padded.mean(axis=0),
        "mean_emotion_alive": alive_sum / n_alive,
        "n_alive": n_alive,
    })


def summarize(
    records: Iterable[dict[str, Any]],
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> BenchmarkSummary:
    """Benchmark figures with scenario-resampled intervals, breakdowns and the mean trajectory.

    ``records`` are our dialogue records or SAGE result records (mixed is fine).
    Every interval is :func:`rlver_lib.stats.cluster_bootstrap_ci` over scenarios with
    the same ``seed`` (with one dialogue per scenario, the plain bootstrap).  Dialogues
    that ended in ``error`` are excluded from the figures and counted in ``n_error``,
    with the error rate and the bounds on the Sentient score with them counted at 0
    and at 100 (see :class:`BenchmarkSummary`).
    Raises ``ValueError`` when no scored record remains, :class:`RecordError` on a bad one.
    """
    records = list(records)
    if not records:
        raise ValueError("summarize needs at least one dialogue record")
    every = [dialogue_view(r) for r in records]
    views = [v for v in every if v.termination != "error"]
    if not views:
        raise ValueError(f"summarize needs at least one scored dialogue record (got {len(records)}, "
                         "all ended in error)")
    final = np.array([v.final_emotion for v in views])
    clusters = [v.scenario_id for v in views]
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    last = np.array([v.final_emotion for v in every])
    errored = np.array([v.termination == "error" for v in every])
    terminations: dict[str, int] = {}
    for v in every:
        if v.termination is not None:
            terminations[v.termination] = terminations.get(v.termination, 0) + 1
    return BenchmarkSummary(
        n=len(views),
        n_success=int((final >= SUCCESS_EMOTION).sum()),
        n_failure=int((final < FAILURE_EMOTION).sum()),
        sentient_score=cluster_bootstrap_ci(final, clusters, **boot),
        success_rate=cluster_bootstrap_ci((final >= SUCCESS_EMOTION).astype(float), clusters, **boot),
        failure_rate=cluster_bootstrap_ci((final < FAILURE_EMOTION).astype(float), clusters, **boot),
        mean_turns=cluster_bootstrap_ci([v.n_turns for v in views], clusters, **boot),
        breakdown=breakdown_table(views, **boot),
        trajectory=trajectory_table(views),
        n_error=len(every) - len(views),
        n_scenarios=len(set(clusters)),
        error_rate=(len(every) - len(views)) / len(every),
        score_errors_at_last=float(last.mean()),
        score_errors_as_zero=float(np.where(errored, 0.0, last).mean()),
        score_errors_as_100=float(np.where(errored, 100.0, last).mean()),
        terminations=dict(sorted(terminations.items())),
        protocol_observed=transcript_protocol(every),
    )


# --------------------------------------------------------------------------- benchmark


@dataclass
class BenchmarkResult:
    """What :func:`run_benchmark` produced: records, summary and the folder written."""

    label: str
    records: list[dict[str, Any]]
    summary: BenchmarkSummary
    out_dir: Path


def _scenario_fields(scenario: Any) -> dict[str, Any]:
    return {
        "hidden_intention": scenario.hidden_intention,
        "personality": scenario.personality,
        "language": scenario.language,
    }


def write_summary(summary: BenchmarkSummary, out_dir: str | Path, label: str,
                  extra: dict[str, Any] | None = None) -> None:
    """Write the :class:`~rlver_lib.files.EvalFolder` ``out_dir``'s ``summary.json`` (label,
    ``extra`` such as judge and protocol, figures), ``breakdown.csv`` and ``trajectory.csv``
    atomically."""
    folder = EvalFolder(out_dir)
    atomic_write_json(folder.summary, {"label": label, **(extra or {}), **summary.to_dict()})
    atomic_write_text(folder.breakdown, summary.breakdown.to_csv(index=False))
    atomic_write_text(folder.trajectory, summary.trajectory.to_csv(index=False))


def _reseeded(simulator: Any, seed: int) -> Any:
    """A shallow copy of an LLM simulator sampling with ``seed`` (same backend); a
    simulator without a seed (the rule simulator) is returned as is."""
    if not hasattr(simulator, "seed"):
        return simulator
    clone = copy.copy(simulator)
    clone.seed = seed
    return clone


def _visible_history(turns: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": t["role"], "content": t["content"]} for t in turns if isinstance(t.get("content"), str)]


def _add_unappraised_reply(policy_backend: ChatBackend, trajectories: list[Any], scenarios: dict[str, Any],
                           *, appraised_turns: int, think: bool, sampling: SamplingParams, seed: int,
                           max_context_tokens: int | None) -> None:
    """SAGE's turn rule: dialogues still running after ``appraised_turns`` appraised
    replies get one more policy reply, recorded (``"appraised": False``) but never
    appraised, so the final emotion is the one after the last appraisal."""
    capped = [t for t in trajectories if t.termination == "max_turns"
              and sum(x["role"] == "assistant" for x in t.transcript) == appraised_turns]
    count = getattr(policy_backend, "prompt_ids", None)
    convs, keep = [], []
    for t in capped:
        conv = policy_messages(scenarios[t.scenario_id], _visible_history(t.transcript), think)
        if max_context_tokens is not None and count is not None \
                and len(count(conv)) + sampling.max_new_tokens > max_context_tokens:
            continue  # the unappraised reply cannot change the score; skip it
        convs.append(conv)
        keep.append(t)
    if not convs:
        return
    generations = policy_backend.generate(convs, replace(sampling, seed=derive_seed(seed, "policy", appraised_turns)))
    for t, g in zip(keep, generations):
        parsed = parse_think(g.text) if think else None
        t.transcript.append({"role": "assistant", "content": parsed.reply if parsed else g.text.strip(),
                        "thought": parsed.thought if parsed else "", "format_ok": parsed.ok if parsed else True,
                        "format_problem": parsed.problem if parsed else None, "raw": g.text,
                        "cut": g.finish_reason == "length", "appraised": False})


def run_benchmark(
    policy_backend: ChatBackend,
    simulator: Any,
    scenarios: Sequence[Any],
    eval_cfg: EvaluationConfig,
    *,
    sampling: SamplingParams,
    think: bool,
    seed: int,
    out_dir: str | Path,
    label: str,
    max_context_tokens: int | None = None,
    format_violation: str = "keep_reply",
    judge: dict[str, Any] | None = None,
    progress: bool = True,
) -> BenchmarkResult:
    """Run the Sentient benchmark and write the :class:`~rlver_lib.files.EvalFolder`
    ``out_dir``'s ``dialogues.jsonl``, ``summary.json``, ``breakdown.csv`` and
    ``trajectory.csv`` atomically.

    ``simulator`` is the judge's simulated user (:attr:`rlver_lib.evaluation.judge.Judge.simulator`);
    ``judge`` its :attr:`~rlver_lib.evaluation.judge.Judge.description`, recorded in
    ``summary.json`` with the protocol.
    Scenarios: all of ``scenarios`` (the caller cuts them to ``scenarios.n_test_scenarios``).  Each of
    ``eval_cfg.repeats`` repeats plays one dialogue per scenario with its own seed
    (repeat 0: ``seed``; repeat k: ``derive_seed(seed, "repeat", k)``, for the policy
    and the judge alike), so a baseline and a trained run see the same seeds.
    Dialogues start at ``eval_cfg.initial_emotion``; protocol ``full`` caps them at
    ``eval_cfg.max_turns`` appraised policy turns, protocol ``sage`` appraises at most
    ``max_turns - 1`` and then records one unappraised reply (SAGE's turn rule).
    Each record is the trajectory's ``to_record()`` plus ``label``, ``repeat``,
    ``seed``, ``protocol`` and the scenario's hidden intention, personality type and
    language; dialogue ids are ``<scenario_id>#<repeat>``.  ``max_context_tokens`` and
    ``format_violation`` are passed to the rollout (``policy`` settings of the same
    names).  Raises ``ValueError`` when no scenarios are given, ``RuntimeError`` when
    the judge's backend died during the run.
    """
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("run_benchmark needs at least one scenario")
    protocol = protocol_description(eval_cfg)
    appraised_turns = protocol["appraised_turns"]
    if appraised_turns < 1:
        raise ValueError("the sage protocol needs max_turns >= 2 (one reply is never appraised)")
    by_id = {s.id: s for s in scenarios}
    folder = EvalFolder(out_dir)
    records: list[dict[str, Any]] = []
    for k in range(protocol["repeats"]):
        seed_k = seed if k == 0 else derive_seed(seed, "repeat", k)
        judge_k = simulator if k == 0 else _reseeded(simulator, derive_seed(getattr(simulator, "seed", 0),
                                                                             "repeat", k))
        trajectories = run_rollouts(
            policy_backend, judge_k, scenarios,
            n_per_scenario=1, max_turns=appraised_turns,
            initial_emotion=eval_cfg.initial_emotion, think=think,
            sampling=sampling, seed=seed_k, max_context_tokens=max_context_tokens,
            format_violation=format_violation, progress=progress,
            final_reply=protocol["name"] == "sage",  # SAGE's unappraised reply answers the user's last message
        )
        fatal = getattr(judge_k, "fatal_error", None)
        if fatal:  # keep what was played (the dialogues in flight end with `error`), then stop
            write_jsonl(folder.dialogues, records + [
                {**t.to_record(), "label": label, "repeat": k, "seed": seed_k, "protocol": protocol["name"],
                 **_scenario_fields(by_id[t.scenario_id])} for t in trajectories])
            raise RuntimeError(f"the judge's backend died during the benchmark: {fatal}; the dialogues played "
                               f"so far are in {folder.dialogues}")
        if protocol["name"] == "sage":
            _add_unappraised_reply(policy_backend, trajectories, by_id, appraised_turns=appraised_turns,
                                   think=think, sampling=sampling, seed=seed_k,
                                   max_context_tokens=max_context_tokens)
        for t in trajectories:
            record = t.to_record()
            record["dialogue_id"] = f"{t.scenario_id}#{k}"
            records.append({**record, "label": label, "repeat": k, "seed": seed_k, "protocol": protocol["name"],
                            **_scenario_fields(by_id[t.scenario_id])})
    summary = summarize(records, n_boot=eval_cfg.n_boot, confidence=eval_cfg.confidence, seed=seed)
    write_jsonl(folder.dialogues, records)
    write_summary(summary, folder.root, label, {"judge": judge or {"backend": type(simulator).__name__},
                                            "protocol": protocol, "character": character.summarize(records)})
    return BenchmarkResult(label, records, summary, folder.root)


def protocol_description(eval_cfg: EvaluationConfig) -> dict[str, Any]:
    """The protocol a benchmark follows: ``name``, ``initial_emotion``, ``max_policy_turns``,
    ``appraised_turns`` (per capped dialogue) and ``repeats``."""
    name = eval_cfg.protocol
    return {"name": name, "initial_emotion": int(eval_cfg.initial_emotion),
            "max_policy_turns": int(eval_cfg.max_turns),
            "appraised_turns": int(eval_cfg.max_turns) - (1 if name == "sage" else 0),
            "repeats": eval_cfg.repeats}
