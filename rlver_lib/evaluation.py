"""The Sentient benchmark, SAGE transcript scoring and capability retention
(the RLVER paper's evaluation, §4.1; docs/ARCHITECTURE.md "evaluation").

Held-out scenarios are played against the **judge** (``evaluation.judge``): a simulated
user configured on its own, never the training simulator, so that every cell of a
comparison is scored by the same judge. Protocols ``full`` (every reply appraised) and
``sage`` (SAGE's stored runs: the 10th reply unappraised). Figures, over the dialogues
that did not end in a judge error: Sentient score (mean final emotion, points
[0, 100]), success and failure rates (final >= 100, < 10) and mean turns, with
percentile bootstrap intervals that resample scenarios. Baseline against trained
(:func:`paired_comparison`) pairs the same scenarios, repeats and seeds.

Reads our dialogue records and SAGE result records (detected per record); the record
formats, error bounds and trajectory definitions are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from rlver_lib import character
from rlver_lib.backends import ChatBackend, SamplingParams, derive_seed
from rlver_lib.io import atomic_write_json, atomic_write_text, iter_jsonl, write_jsonl
from rlver_lib.rollout import record_transcript
from rlver_lib.simulator import FAILURE_EMOTION, SUCCESS_EMOTION, build_simulator
from rlver_lib.stats import MIN_N, Estimate, bootstrap_ci, cluster_bootstrap_ci, paired_difference

__all__ = [
    "BREAKDOWN_FACTORS", "BenchmarkResult", "BenchmarkSummary", "DialogueView", "Estimate",
    "JudgeMismatchError", "RecordError", "bootstrap_ci", "build_judge",
    "check_same_judge", "describe_paired", "dialogue_view", "error_statement", "headline_markdown",
    "headline_table", "judge_description", "styled_breakdown",
    "load_records", "paired_comparison", "run_benchmark", "sage_score", "served_model_identity", "summarize",
    "transcript_protocol",
    "write_paired",
]

BREAKDOWN_FACTORS = ("hidden_intention", "personality", "language")
UNKNOWN = "unknown"
PROTOCOLS = ("full", "sage")


class RecordError(ValueError):
    """A dialogue record that is neither one of ours nor a SAGE result record."""


class JudgeMismatchError(ValueError):
    """Benchmarks that were scored by different judges or protocols cannot be compared."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DialogueView:
    """The benchmark-relevant view of one dialogue record, whatever its format.

    ``emotions``: [initial, after turn 1, ..., after turn k] in emotion points.
    ``scenario_id``: the cluster for resampling (SAGE: the record ``id``);
    ``repeat``: which repeat of its scenario (0 for SAGE records).
    ``n_appraised``: policy replies followed by an emotion update;
    ``last_unappraised``: the transcript ends with a policy reply that was never
    appraised (SAGE's 10th reply), not counting a reply ended by a format violation.
    ``termination``: ours, or ``None`` for SAGE records.
    """

    final_emotion: float
    n_turns: int
    emotions: tuple[float, ...]
    hidden_intention: str
    personality: str
    language: str
    scenario_id: str = UNKNOWN
    repeat: int = 0
    n_appraised: int = 0
    last_unappraised: bool = False
    termination: str | None = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _our_view(record: dict[str, Any]) -> DialogueView:
    turns = record_transcript(record)
    final = float(record["final_emotion"])
    start = record.get("initial_emotion")
    path = [float(start)] if _number(start) else []
    path += [float(t["emotion"]) for t in turns
             if t.get("role") == "user" and _number(t.get("emotion")) and _number(t.get("change"))]
    if not path or path[-1] != final:
        path.append(final)
    termination = record.get("termination")
    return DialogueView(
        final_emotion=final,
        n_turns=sum(t.get("role") == "assistant" for t in turns),
        emotions=tuple(path),
        hidden_intention=str(record.get("hidden_intention") or UNKNOWN),
        personality=str(record.get("personality") or UNKNOWN),
        language=str(record.get("language") or UNKNOWN),
        scenario_id=str(record.get("scenario_id") or record.get("dialogue_id") or UNKNOWN),
        repeat=int(record.get("repeat") or 0),
        n_appraised=sum(t.get("role") == "user" and _number(t.get("change")) for t in turns),
        last_unappraised=bool(turns) and turns[-1].get("role") == "assistant" and termination != "format_violation",
        termination=termination,
    )


def _sage_view(record: dict[str, Any]) -> DialogueView:
    from rlver_lib.scenarios import INTENTION_BY_ZH, PERSONALITY_BY_ZH, detect_language

    history = record.get("history") or []
    final = float(record["emo_point"])
    path = [float(m["emotion-point"]) for m in history
            if m.get("role") == "user" and _number(m.get("emotion-point"))]
    if not path or path[-1] != final:
        path.append(final)
    task = str(record.get("task") or UNKNOWN)
    intention = INTENTION_BY_ZH.get(task, task)
    character = str(record.get("character") or UNKNOWN)
    personality = PERSONALITY_BY_ZH.get(character, character)
    appraised = sum(m.get("role") == "user" and _number(m.get("emotion-point"))
                    and i > 0 and history[i - 1].get("role") == "assistant" for i, m in enumerate(history))
    return DialogueView(
        final_emotion=final,
        n_turns=sum(m.get("role") == "assistant" for m in history),
        emotions=tuple(path),
        hidden_intention=intention,
        personality=personality,
        language=detect_language(task),
        scenario_id=str(record.get("id") or UNKNOWN),
        n_appraised=appraised,
        last_unappraised=bool(history) and history[-1].get("role") == "assistant",
    )


def dialogue_view(record: dict[str, Any]) -> DialogueView:
    """Read one record of either format (detected by ``final_emotion`` / ``emo_point``).

    Raises :class:`RecordError` when the record has neither field or it is not a number.
    """
    if _number(record.get("final_emotion")):
        return _our_view(record)
    if _number(record.get("emo_point")):
        return _sage_view(record)
    raise RecordError("record has neither a numeric 'final_emotion' (ours) nor 'emo_point' (SAGE)")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON Lines dialogue file (ours or SAGE), validated.

    Raises :class:`rlver_lib.io.JsonlError` on a bad line and :class:`RecordError`
    naming file and line for a record of neither format.
    """
    records = []
    for line, record in iter_jsonl(path):
        try:
            dialogue_view(record if isinstance(record, dict) else {})
        except RecordError as err:
            raise RecordError(f"{path}:{line}: {err}") from None
        records.append(record)
    return records


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


# --------------------------------------------------------------------------- judge


#: Judge settings that do not change what the judge answers (how often it retries, how
#: long it waits, how many dialogues it serves at once, where its API key lives), the
#: start emotion (the benchmark sets its own) and the seed (recorded as the seed it
#: samples with).  Every other field of a judge config is part of its identity.
_JUDGE_OPERATIONAL = frozenset({"max_retries", "timeout_s", "concurrency", "n_threads", "api_key_env",
                                "initial_emotion", "seed"})
#: How a judge reads first in reports and summaries; the other fields follow sorted.
_JUDGE_FIRST = ("backend", "model", "base_url", "difficulty", "appraisal", "temperature", "top_p", "top_k",
                "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "max_new_tokens",
                "n_ctx", "appraisal_chars", "message_chars")
#: Settings read with a default, so a config written before the field existed is still
#: described (the values a field-less config meant: no sampling cut, no penalty, the
#: first-person appraisal).
_JUDGE_DEFAULTS: dict[str, Any] = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                                   "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                   "appraisal": "first_person"}
#: Per served model, the fields of ``GET /v1/models`` that identify it (``created`` and
#: ``permission`` change from call to call and are left out).
_SERVED_MODEL_FIELDS = ("id", "owned_by", "root", "parent", "max_model_len", "meta")
#: At most this many models are recorded when the judge's alias is not among them (a
#: hosted API lists all of its models); ``models_total`` then says how many there were.
_MAX_LISTED_MODELS = 20
#: Of ``default_generation_settings`` in llama.cpp's ``GET /props``, per-slot state that
#: changes from call to call.
_VOLATILE_SLOT_FIELDS = frozenset({"id", "id_slot", "id_task", "is_processing", "next_token", "prompt",
                                   "tokens", "n_past", "n_decoded", "t_start"})
#: What :func:`build_judge` learnt from each judge's server in this process, keyed by
#: :func:`_served_key`; :func:`judge_description` records it.
_SERVED: dict[tuple[Any, ...], dict[str, Any]] = {}


def _prompt_fingerprint(files: Sequence[str]) -> str:
    """SHA-256 over prompt files (names in ``rlver_lib/prompts``): each enters as its name,
    a NUL byte, its bytes and a NUL byte, in name order."""
    folder = resources.files("rlver_lib").joinpath("prompts")
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + folder.joinpath(name).read_bytes() + b"\0")
    return digest.hexdigest()


def _schema_fingerprint(schemas: dict[str, Any]) -> str:
    """SHA-256 of ``schemas`` as canonical JSON (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(schemas, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _served_key(judge_cfg: Any) -> tuple[Any, ...]:
    return (judge_cfg.backend, getattr(judge_cfg, "base_url", None), judge_cfg.model)


def _get_json(client: Any, url: str) -> tuple[Any, str | None]:
    """``(body, None)`` for an HTTP 200 JSON answer, else ``(None, why)`` (a short,
    stable reason: ``HTTP 404``, ``not JSON``, the exception's class name)."""
    import httpx

    try:
        response = client.get(url)
    except httpx.HTTPError as err:
        return None, type(err).__name__
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}"
    try:
        return response.json(), None
    except ValueError:
        return None, "not JSON"


def served_model_identity(base_url: str, timeout_s: float = 10.0, *, model: str | None = None,
                          api_key: str | None = None) -> dict[str, Any]:
    """What an OpenAI-compatible server says it serves: ``GET /v1/models`` and, on
    llama.cpp's ``llama-server``, ``GET /props``.

    ``base_url``: the server root or its ``/v1`` root; ``timeout_s`` per request;
    ``model``: the alias the judge asks for; ``api_key``: sent as a bearer token.
    Returns a dict with, when the server answered:

    - ``models``: per listed model (only ``model`` when it is listed, else the first
      :data:`_MAX_LISTED_MODELS`, with ``models_total`` when there were more), its
      ``id``, ``owned_by``, ``root`` and ``parent`` (vLLM: the weights behind a
      ``--served-model-name``), ``max_model_len`` and ``meta`` (llama.cpp: parameter
      count, file size, vocabulary, training context), where given;
      ``model_listed``: whether ``model`` is among them (with ``model`` only);
    - ``props``: ``model_path``, ``model_alias``, ``model_ftype`` (quantisation),
      ``build_info``, ``chat_template_sha256`` and ``default_generation_settings`` (the
      server's own sampling defaults, which a judge overrides by sending every setting;
      per-slot state left out), where given;

    and ``models_error`` / ``props_error`` (``HTTP 404``, ``ConnectError``, ...) for
    what it did not answer.  Never raises for an HTTP or connection failure.
    """
    import httpx

    root = base_url.rstrip("/")
    root = root[: -len("/v1")] if root.endswith("/v1") else root
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out: dict[str, Any] = {}
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers) as client:
        listing, why = _get_json(client, f"{root}/v1/models")
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list):
            entries = [{k: e[k] for k in _SERVED_MODEL_FIELDS if k in e} for e in data if isinstance(e, dict)]
            matched = [e for e in entries if model is not None and e.get("id") == model]
            out["models"] = matched or entries[:_MAX_LISTED_MODELS]
            if not matched and len(entries) > _MAX_LISTED_MODELS:
                out["models_total"] = len(entries)
            if model is not None:
                out["model_listed"] = bool(matched)
        else:
            out["models_error"] = why or "no model list"
        props, why = _get_json(client, f"{root}/props")
        if isinstance(props, dict):
            kept: dict[str, Any] = {k: props[k] for k in ("model_path", "model_alias", "model_ftype", "build_info")
                                    if k in props}
            if isinstance(props.get("chat_template"), str):
                kept["chat_template_sha256"] = hashlib.sha256(props["chat_template"].encode("utf-8")).hexdigest()
            settings = props.get("default_generation_settings")
            if isinstance(settings, dict):
                kept["default_generation_settings"] = {k: v for k, v in settings.items()
                                                       if k not in _VOLATILE_SLOT_FIELDS}
            out["props"] = kept
        else:
            out["props_error"] = why or "not an object"
    return out


def _served_base_url(backend: Any) -> str | None:
    """The HTTP root of a judge's backend: a ``llama-server`` it started (``port``), an
    OpenAI-compatible client (``root``, else ``url`` less its path); ``None`` otherwise."""
    port = getattr(backend, "port", None)
    if isinstance(port, int):
        return f"http://127.0.0.1:{port}"
    root = getattr(backend, "root", None)
    if isinstance(root, str):
        return root
    url = getattr(backend, "url", None)
    if isinstance(url, str) and url.endswith("/chat/completions"):
        return url[: -len("/chat/completions")]
    return None


def judge_description(judge_cfg: Any, seed: int, served: dict[str, Any] | None = None) -> dict[str, Any]:
    """What identifies a judge, as recorded in ``summary.json`` and the report header.

    ``judge_cfg``: an ``evaluation.judge`` (or any simulator config); ``seed``: the
    seed the judge samples with.  The rule backend is described by its change function
    alone.  An LLM judge by every config field that shapes its answers (all but
    :data:`_JUDGE_OPERATIONAL`): backend, model, base URL, difficulty, appraisal mode,
    every sampling setting (temperature, ``top_p``, ``top_k``, ``min_p``, the
    repetition, presence and frequency penalties; read with the defaults of
    :data:`_JUDGE_DEFAULTS` where a config lacks them), token budget, ``n_ctx``, the
    field caps, the ``expected_*`` settings of an ``expected`` appraisal (with the code's
    ``expected_difficulty_shift`` and ``expected_top_logprobs``); plus ``seed``,
    ``prompt_files`` and ``prompts_sha256`` (the prompt files it reads, so an edited
    prompt is a different judge), ``schemas_sha256`` (the JSON schemas built in code)
    and ``served``: what its server answered (:func:`served_model_identity`; default:
    what :func:`build_judge` recorded in this process for a judge of this backend,
    base URL and model, absent when nothing was asked).
    """
    if judge_cfg.backend == "rule":
        return {"backend": "rule", "change_function": "default_change_fn"}
    fields = dict(judge_cfg.model_dump()) if hasattr(judge_cfg, "model_dump") else dict(vars(judge_cfg))
    if "repetition_penalty" not in fields and "repeat_penalty" in fields:
        fields["repetition_penalty"] = fields.pop("repeat_penalty")
    fields = {**_JUDGE_DEFAULTS, **fields}
    appraisal = str(fields["appraisal"])
    kept = {k: v for k, v in fields.items()
            if k not in _JUDGE_OPERATIONAL and (appraisal == "expected" or not k.startswith("expected_"))}
    described = {k: kept.pop(k) for k in _JUDGE_FIRST if k in kept}
    described.update(sorted(kept.items()))
    if appraisal == "expected":  # the code's constants of a checklist appraisal
        from rlver_lib.simulator import DIFFICULTY_SHIFT, UserSimulator

        described.update(expected_difficulty_shift=DIFFICULTY_SHIFT[judge_cfg.difficulty],
                         expected_top_logprobs=UserSimulator.TOP_N)
    from rlver_lib import simulator

    files = simulator.prompt_files(judge_cfg)
    described.update(seed=int(seed), prompt_files=files, prompts_sha256=_prompt_fingerprint(files),
                     schemas_sha256=_schema_fingerprint(simulator.structured_schemas(judge_cfg)))
    if served is None:
        served = _SERVED.get(_served_key(judge_cfg))
    if served is not None:
        described["served"] = copy.deepcopy(served)
    return described


def judge_seed(eval_cfg: Any, run_seed: int) -> int:
    """The judge's seed: ``evaluation.judge.seed``, else the run's seed."""
    seed = getattr(eval_cfg.judge, "seed", None)
    return run_seed if seed is None else int(seed)


def _served_name(served: dict[str, Any] | None) -> str | None:
    """The weights behind a served alias, as its server named them: vLLM's ``root``
    when it differs from the alias, else the file of llama.cpp's ``model_path``."""
    if not served:
        return None
    for entry in served.get("models") or []:
        if entry.get("root") and entry.get("root") != entry.get("id"):
            return str(entry["root"])
    path = (served.get("props") or {}).get("model_path")
    return Path(str(path)).name if path else None


def judge_name(judge: dict[str, Any]) -> str:
    """A one-line name of a :func:`judge_description` for reports."""
    if judge.get("backend") == "rule":
        return "the rule simulator (no language model)"
    where = f" at {judge['base_url']}" if judge.get("base_url") else ""
    behind = _served_name(judge.get("served"))
    serving = f" (serving `{behind}`)" if behind else ""
    if judge.get("served", {}).get("model_listed") is False:
        serving += " (not listed by its server)"
    sampling = ", ".join(f"{k} {judge[k]}" for k in ("top_p", "top_k", "min_p", "repetition_penalty",
                                                     "presence_penalty", "frequency_penalty") if k in judge)
    appraisal = f", {judge['appraisal']} appraisal" if judge.get("appraisal") else ""
    return (f"`{judge.get('model')}`{serving} through `{judge.get('backend')}`{where}, {judge.get('difficulty')} "
            f"difficulty{appraisal}, temperature {judge.get('temperature')}"
            + (f", {sampling}" if sampling else "") + f", seed {judge.get('seed')}")


def protocol_description(eval_cfg: Any) -> dict[str, Any]:
    """The protocol a benchmark follows: ``name``, ``initial_emotion``, ``max_policy_turns``,
    ``appraised_turns`` (per capped dialogue) and ``repeats``."""
    name = getattr(eval_cfg, "protocol", "full")
    if name not in PROTOCOLS:
        raise ValueError(f"unknown evaluation protocol {name!r}; expected one of {PROTOCOLS}")
    return {"name": name, "initial_emotion": int(eval_cfg.initial_emotion),
            "max_policy_turns": int(eval_cfg.max_turns),
            "appraised_turns": int(eval_cfg.max_turns) - (1 if name == "sage" else 0),
            "repeats": int(getattr(eval_cfg, "repeats", 1))}


def build_judge(eval_cfg: Any, run_seed: int) -> Any:
    """The benchmark's judge from ``evaluation.judge`` (never ``cfg.simulator``).

    Built as a plain simulator config with the benchmark's start emotion (for generated
    opening lines) and seeded with :func:`judge_seed`.  A judge behind an HTTP server
    (``openai``, ``llamacpp``) is asked once what it serves
    (:func:`served_model_identity`, API key from ``api_key_env``); the answer is kept as
    the simulator's ``served_model`` and recorded by :func:`judge_description`.  Close an
    LLM judge's backend after use (:func:`close_simulator`).
    """
    import os

    from rlver_lib.config import SimulatorConfig

    data = eval_cfg.judge.model_dump()
    data.pop("seed", None)
    sim_cfg = SimulatorConfig(**{**data, "initial_emotion": eval_cfg.initial_emotion})
    simulator = build_simulator(sim_cfg, judge_seed(eval_cfg, run_seed))
    url = _served_base_url(getattr(simulator, "backend", None)) if sim_cfg.backend in ("openai", "llamacpp") else None
    if url is not None:
        api_key = os.environ.get(sim_cfg.api_key_env) if sim_cfg.backend == "openai" else None
        backend = simulator.backend
        alias = getattr(backend, "model", None) or getattr(getattr(backend, "client", None), "model", None)
        served = served_model_identity(url, min(float(sim_cfg.timeout_s), 30.0), model=alias, api_key=api_key)
        simulator.served_model = served
        _SERVED[_served_key(eval_cfg.judge)] = served
    return simulator


def close_simulator(simulator: Any) -> None:
    """Close the backend of an LLM simulator (a server it started, an HTTP client), if any."""
    close = getattr(getattr(simulator, "backend", None), "close", None)
    if callable(close):
        close()


def _comparison_key(summary: dict[str, Any]) -> tuple[str, str]:
    judge = summary.get("judge")
    protocol = summary.get("protocol")
    return (json.dumps(judge, sort_keys=True), json.dumps(protocol, sort_keys=True))


def _dotted(value: Any, prefix: str) -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (lists are leaves)."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_dotted(item, f"{prefix}.{key}"))
    return out


def check_same_judge(summaries: dict[str, dict[str, Any]]) -> None:
    """Refuse to compare benchmarks scored differently.

    ``summaries`` maps a name (a run or cell) to its ``summary.json`` content.  Raises
    :class:`JudgeMismatchError` naming the runs and the differing judge or protocol
    fields (nested ones dotted, e.g. ``judge.served.props.model_path``) when they were
    not all scored by the same judge under the same protocol (every recorded field of
    :func:`judge_description` counts: sampling settings, caps, prompts, schemas and the
    model its server said it serves), or when a summary does not record its judge
    (written before judges were recorded).
    """
    missing = [name for name, s in summaries.items() if "judge" not in s or "protocol" not in s]
    if missing:
        raise JudgeMismatchError(f"cannot compare: no judge and protocol recorded for {', '.join(missing)} "
                                 "(evaluated before judges were recorded); re-run its evaluation")
    groups: dict[tuple[str, str], list[str]] = {}
    for name, s in summaries.items():
        groups.setdefault(_comparison_key(s), []).append(name)
    if len(groups) <= 1:
        return
    items = list(summaries.items())
    ref_name, ref = items[0]
    lines = []
    for name, s in items[1:]:
        for part in ("judge", "protocol"):
            a, b = _dotted(ref.get(part) or {}, part), _dotted(s.get(part) or {}, part)
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    lines.append(f"{key}: {ref_name}={a.get(key)!r} vs {name}={b.get(key)!r}")
    raise JudgeMismatchError("cannot compare runs judged differently (a score depends on its judge and protocol; "
                             "set one evaluation.judge and evaluation.protocol for all of them):\n  "
                             + "\n  ".join(dict.fromkeys(lines)))


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
    """Write ``summary.json`` (label, ``extra`` such as judge and protocol, figures),
    ``breakdown.csv`` and ``trajectory.csv`` atomically."""
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "summary.json", {"label": label, **(extra or {}), **summary.to_dict()})
    atomic_write_text(out_dir / "breakdown.csv", summary.breakdown.to_csv(index=False))
    atomic_write_text(out_dir / "trajectory.csv", summary.trajectory.to_csv(index=False))


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
    from rlver_lib.rollout import parse_think, policy_messages

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
                        "format_problem": parsed.problem if parsed else None, "raw": g.text, "appraised": False})


def run_benchmark(
    policy_backend: ChatBackend,
    simulator: Any,
    scenarios: Sequence[Any],
    eval_cfg: Any,
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
    """Run the Sentient benchmark and write ``out_dir/{dialogues.jsonl, summary.json,
    breakdown.csv, trajectory.csv}`` atomically.

    ``simulator`` is the judge (:func:`build_judge`); ``judge`` its
    :func:`judge_description`, recorded in ``summary.json`` with the protocol.
    Scenarios: the first ``eval_cfg.n_scenarios`` when set.  Each of
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
    from rlver_lib.rollout import run_rollouts

    scenarios = list(scenarios)[: eval_cfg.n_scenarios]
    if not scenarios:
        raise ValueError("run_benchmark needs at least one scenario")
    protocol = protocol_description(eval_cfg)
    appraised_turns = protocol["appraised_turns"]
    if appraised_turns < 1:
        raise ValueError("the sage protocol needs max_turns >= 2 (one reply is never appraised)")
    by_id = {s.id: s for s in scenarios}
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
            write_jsonl(Path(out_dir) / "dialogues.jsonl", records + [
                {**t.to_record(), "label": label, "repeat": k, "seed": seed_k, "protocol": protocol["name"],
                 **_scenario_fields(by_id[t.scenario_id])} for t in trajectories])
            raise RuntimeError(f"the judge's backend died during the benchmark: {fatal}; the dialogues played "
                               f"so far are in {Path(out_dir) / 'dialogues.jsonl'}")
        if protocol["name"] == "sage":
            _add_unappraised_reply(policy_backend, trajectories, by_id, appraised_turns=appraised_turns,
                                   think=think, sampling=sampling, seed=seed_k,
                                   max_context_tokens=max_context_tokens)
        for t in trajectories:
            record = t.to_record()
            record["dialogue_id"] = f"{t.scenario_id}#{k}"
            records.append({**record, "label": label, "repeat": k, "seed": seed_k, "protocol": protocol["name"],
                            **_scenario_fields(by_id[t.scenario_id])})
    summary = summarize(records, n_boot=eval_cfg.bootstrap_samples, confidence=eval_cfg.confidence, seed=seed)
    out_dir = Path(out_dir)
    write_jsonl(out_dir / "dialogues.jsonl", records)
    write_summary(summary, out_dir, label, {"judge": judge or {"backend": type(simulator).__name__},
                                            "protocol": protocol, "character": character.summarise(records)})
    return BenchmarkResult(label, records, summary, out_dir)


# --------------------------------------------------------------------------- paired comparison


def scenario_scores(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Dialogues as a table ``scenario_id, repeat, final_emotion, error`` (one row per
    dialogue; ``final_emotion`` in points [0, 100], for an errored dialogue its last
    recorded emotion; ``error`` True for termination ``error``).  Raises
    :class:`RecordError` on a record of neither format."""
    rows = []
    for r in records:
        v = dialogue_view(r)
        rows.append({"scenario_id": v.scenario_id, "repeat": v.repeat, "final_emotion": v.final_emotion,
                     "error": v.termination == "error"})
    return pd.DataFrame(rows, columns=["scenario_id", "repeat", "final_emotion", "error"])


ERROR_BOUND_RULE = ("errored dialogues counted at 0 and at 100 (the ends of the emotion scale): for the low bound "
                    "an errored trained dialogue is 0 and an errored baseline one 100, for the high bound the reverse")


@dataclass
class PairedComparison:
    """Trained against baseline on the same scenarios and seeds.

    ``difference``: :class:`rlver_lib.stats.PairedDifference` of the per-scenario
    means over the pairs scored on both sides (emotion points in [-100, 100];
    positive = trained higher; ``difference.p_method`` says whether its p-value is
    exact).  ``table``: one row per scenario with ``scenario_id, baseline, trained,
    diff, n_pairs``.  ``baseline_score`` / ``trained_score``: the mean over the
    table's scenarios of the per-scenario means (points), weighted like ``mean_diff``,
    so ``trained_score - baseline_score == difference.mean_diff`` up to float
    rounding.

    Pair counts: ``n_pairs`` (scenario, repeat) pairs scored on both sides;
    ``n_dropped`` = ``n_dropped_error + n_dropped_missing``, the pairs left out:
    ``n_dropped_error`` present on both sides but ended in a judge error on either
    (or both), ``n_dropped_missing`` present on one side only.  ``errors_low`` /
    ``errors_high``: the same comparison with the errored pairs put back at the bounds
    of :data:`ERROR_BOUND_RULE` (low: errored trained dialogues at 0, errored baseline
    ones at 100; high: the reverse), so the difference the errored pairs could have
    given lies between ``errors_low.mean_diff`` and ``errors_high.mean_diff``;
    ``None`` when no pair errored.
    """

    difference: Any
    table: pd.DataFrame = field(repr=False)
    n_pairs: int = 0
    n_dropped: int = 0
    baseline_score: float = float("nan")
    trained_score: float = float("nan")
    n_dropped_error: int = 0
    n_dropped_missing: int = 0
    errors_low: Any = None
    errors_high: Any = None

    def to_dict(self) -> dict[str, Any]:
        """What ``eval/paired.json`` holds: ``mean_diff, ci_low, ci_high, n_scenarios,
        p_value, p_method`` and the rest of the difference, the pair counts, both scores
        (means of per-scenario means over the paired scenarios), ``errors_low`` /
        ``errors_high`` (the difference's fields with errored pairs at the bounds, or
        ``None``), ``error_bound_rule`` and the per-scenario rows."""
        bounds = {name: (None if d is None else d.to_dict())
                  for name, d in (("errors_low", self.errors_low), ("errors_high", self.errors_high))}
        return {**self.difference.to_dict(), "n_pairs": self.n_pairs, "n_dropped": self.n_dropped,
                "n_dropped_error": self.n_dropped_error, "n_dropped_missing": self.n_dropped_missing,
                "baseline_score": self.baseline_score, "trained_score": self.trained_score,
                "scores_weighting": "mean over the paired scenarios of each scenario's mean over its pairs",
                **bounds, "error_bound_rule": ERROR_BOUND_RULE,
                "test": ("two-sided sign-flip permutation test of the mean per-scenario difference "
                         f"({self.difference.p_method})"),
                "scenarios": self.table.to_dict(orient="records")}


def _per_scenario(pairs: pd.DataFrame, baseline: pd.Series, trained: pd.Series) -> pd.DataFrame:
    table = (pd.DataFrame({"scenario_id": pairs["scenario_id"], "baseline": baseline, "trained": trained})
             .groupby("scenario_id", sort=False)
             .agg(baseline=("baseline", "mean"), trained=("trained", "mean"), n_pairs=("baseline", "size"))
             .reset_index())
    table["diff"] = table["trained"] - table["baseline"]
    return table[["scenario_id", "baseline", "trained", "diff", "n_pairs"]]


def paired_comparison(baseline: Iterable[dict[str, Any]], trained: Iterable[dict[str, Any]], *,
                      n_boot: int = 1000, confidence: float = 0.95, seed: int = 0,
                      n_resamples: int = 9999) -> PairedComparison:
    """Pair two benchmarks by (scenario, repeat) and compare them per scenario.

    Pairs where either side is missing or ended in a judge error are dropped (and
    counted apart); each scenario's difference is the mean over its remaining pairs of
    trained minus baseline final emotion (points); the mean difference over scenarios
    gets a bootstrap interval over scenarios and a sign-flip permutation p-value
    (:func:`rlver_lib.stats.paired_difference` with ``n_resamples``: exact only while
    2**n_scenarios <= n_resamples + 1).  The baseline and trained scores are the means
    of the same per-scenario means, so they subtract to ``mean_diff``.  When pairs
    errored, the comparison is repeated with them at both bounds
    (:data:`ERROR_BOUND_RULE`; see :class:`PairedComparison`).
    Raises ``ValueError`` when no pair is scored on both sides without an error.
    """
    a, b = scenario_scores(baseline), scenario_scores(trained)
    merged = a.merge(b, on=["scenario_id", "repeat"], how="outer", suffixes=("_baseline", "_trained"))
    both = merged["final_emotion_baseline"].notna() & merged["final_emotion_trained"].notna()
    err_a = merged["error_baseline"].astype("boolean").fillna(False).astype(bool)
    err_b = merged["error_trained"].astype("boolean").fillna(False).astype(bool)
    ok = both & ~err_a & ~err_b
    pairs = merged[ok]
    if pairs.empty:
        raise ValueError("paired_comparison: no scenario was scored in both benchmarks")
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed, n_resamples=n_resamples)
    table = _per_scenario(pairs, pairs["final_emotion_baseline"], pairs["final_emotion_trained"])
    diff = paired_difference(table["baseline"].to_numpy(), table["trained"].to_numpy(), **boot)
    n_error = int((both & (err_a | err_b)).sum())
    bounds: dict[str, Any] = {"errors_low": None, "errors_high": None}
    if n_error:
        present = merged[both]
        ea, eb = err_a[both], err_b[both]
        for name, (base_at, trained_at) in (("errors_low", (100.0, 0.0)), ("errors_high", (0.0, 100.0))):
            t = _per_scenario(present, present["final_emotion_baseline"].where(~ea, base_at),
                              present["final_emotion_trained"].where(~eb, trained_at))
            bounds[name] = paired_difference(t["baseline"].to_numpy(), t["trained"].to_numpy(), **boot)
    return PairedComparison(diff, table, n_pairs=int(len(pairs)), n_dropped=int(len(merged) - len(pairs)),
                            baseline_score=float(table["baseline"].mean()),
                            trained_score=float(table["trained"].mean()),
                            n_dropped_error=n_error, n_dropped_missing=int((~both).sum()), **bounds)


def write_paired(run_dir: str | Path, *, baseline: str = "baseline", trained: str = "trained",
                 n_boot: int = 1000, confidence: float = 0.95, seed: int = 0) -> PairedComparison | None:
    """Write ``<run_dir>/eval/paired.json`` from ``eval/<baseline>`` and ``eval/<trained>``.

    Returns ``None`` (and writes nothing) unless both folders hold ``dialogues.jsonl``.
    Raises :class:`JudgeMismatchError` when the two were judged differently.
    """
    run_dir = Path(run_dir)
    folders = {name: run_dir / "eval" / name for name in (baseline, trained)}
    if not all((f / "dialogues.jsonl").is_file() for f in folders.values()):
        return None
    summaries = {name: json.loads((f / "summary.json").read_text(encoding="utf-8"))
                 for name, f in folders.items() if (f / "summary.json").is_file()}
    if len(summaries) == 2:
        check_same_judge(summaries)
    comparison = paired_comparison(load_records(folders[baseline] / "dialogues.jsonl"),
                                   load_records(folders[trained] / "dialogues.jsonl"),
                                   n_boot=n_boot, confidence=confidence, seed=seed)
    summary = summaries.get(trained, {})
    atomic_write_json(run_dir / "eval" / "paired.json",
                      {"baseline": baseline, "trained": trained, "judge": summary.get("judge"),
                       "protocol": summary.get("protocol"), **comparison.to_dict()})
    return comparison


def _grey(text: str) -> str:
    return f'<span style="color:#888">{text}</span>'


def headline_markdown(run_dir: str | Path, wall_s: float | None = None) -> str:
    """The report's opening block: the answer first.

    Reads ``<run_dir>/eval/paired.json`` and ``eval/*/summary.json``: the paired
    trained-minus-baseline difference (emotion points) with its interval and p-value
    (named exact or Monte Carlo, as computed), the pairs used and dropped, the
    difference with errored pairs at both bounds, the baseline and trained scores
    weighted like the difference (they subtract to it), each benchmark's score with
    its error bounds (errored dialogues at 0 and at 100), the judge, the protocol and
    ``wall_s`` (the run's wall time, seconds).  An interval or p-value over fewer
    than :data:`rlver_lib.stats.MIN_N` scenarios is greyed with the reason.
    Returns ``""`` when the run has no benchmark summary with figures.
    """
    run_dir = Path(run_dir)
    summaries = {}
    for path in sorted((run_dir / "eval").glob("*/summary.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data.get("sentient_score"), dict):
            summaries[path.parent.name] = data
    if not summaries:
        return ""
    lines = ["## Headline"]
    paired_path = run_dir / "eval" / "paired.json"
    paired = json.loads(paired_path.read_text(encoding="utf-8")) if paired_path.is_file() else None
    if paired:
        n = paired["n_scenarios"]
        diff = f"**{paired['mean_diff']:+.1f} emotion points** (trained minus baseline, paired over {n} scenario(s)"
        diff += f", {paired['n_pairs']} dialogue pair(s); {_dropped_text(paired)})"
        method = f" ({paired['p_method']})" if paired.get("p_method") else ""
        stats = (f"{100 * paired['confidence']:.0f}% CI [{paired['ci_low']:+.1f}, {paired['ci_high']:+.1f}], "
                 f"sign-flip permutation p = {paired['p_value']:.3g}{method}")
        if n < MIN_N:
            stats = _grey(f"{stats} — not evidence: n = {n} scenarios < {MIN_N}")
        lines.append(f"- Sentient score change: {diff}; {stats}.")
        low, high = paired.get("errors_low"), paired.get("errors_high")
        if low and high:
            n_b = high["n_scenarios"]
            bound_stats = (f"low: CI [{low['ci_low']:+.1f}, {low['ci_high']:+.1f}], p = {low['p_value']:.3g}; "
                           f"high: CI [{high['ci_low']:+.1f}, {high['ci_high']:+.1f}], p = {high['p_value']:.3g}")
            if n_b < MIN_N:
                bound_stats = _grey(f"{bound_stats} — n = {n_b} scenarios < {MIN_N}")
            lines.append(f"- With the {paired.get('n_dropped_error', 0)} errored pair(s) put back at the bounds "
                         "(errored trained dialogues at 0 and baseline ones at 100, then the reverse): change "
                         f"between {low['mean_diff']:+.1f} and {high['mean_diff']:+.1f} over {n_b} scenario(s) "
                         f"({bound_stats}).")
        lines.append(f"- Baseline {paired['baseline_score']:.2f} → trained {paired['trained_score']:.2f}: means over "
                     f"the {n} paired scenario(s) of each scenario's mean over its pairs, weighted like the change "
                     f"(trained minus baseline = {paired['trained_score'] - paired['baseline_score']:+.2f}).")
    for label, s in summaries.items():
        score = s["sentient_score"]
        n_sc = s.get("n_scenarios", s.get("n", 0))
        ci = f"({100 * score.get('confidence', 0.95):.0f}% CI [{score['low']:.1f}, {score['high']:.1f}])"
        if n_sc < MIN_N:
            ci = _grey(f"{ci} — n = {n_sc} scenarios < {MIN_N}")
        errors = ""
        if s.get("n_error"):
            errors = (f"; errors {s['n_error']} ({100 * s.get('error_rate', 0):.0f}%), left out: with them the score "
                      f"over all {s.get('n', 0) + s['n_error']} dialogues lies in "
                      f"[{s.get('score_errors_as_zero', float('nan')):.1f}, "
                      f"{s.get('score_errors_as_100', float('nan')):.1f}] (errored ones at 0 / at 100)")
        ctx = f"; {s['n_context_limit']} stopped by the context budget" if s.get("n_context_limit") else ""
        lines.append(f"- `{label}`: Sentient score {score['value']:.1f} over {s.get('n')} dialogue(s) of {n_sc} "
                     f"scenario(s) {ci}; success {s.get('n_success')}, failure {s.get('n_failure')}{errors}{ctx}.")
    kept = {label: s["character"] for label, s in summaries.items() if s.get("character")}
    if kept:
        lines.append("- Simulated user in character (lexical detectors, lower bounds): "
                     + "; ".join(f"`{label}` {character.describe(c)}" for label, c in kept.items()) + ".")
    first = next(iter(summaries.values()))
    judge = first.get("judge")
    protocol = first.get("protocol") or {}
    if judge:
        lines.append(f"- Judge: {judge_name(judge)}.")
    if protocol:
        rule = ("every policy reply appraised" if protocol.get("name") == "full"
                else f"{protocol.get('max_policy_turns')} policy replies, the first "
                     f"{protocol.get('appraised_turns')} appraised (SAGE's turn rule)")
        parity = ""
        if protocol.get("name") == "sage" and first.get("n_scenarios", 0) != 100:
            parity = (f" Leaderboard parity also needs SAGE's 100 test profiles as `scenarios.test` "
                      f"(this run: {first.get('n_scenarios')} scenarios).")
        lines.append(f"- Protocol: `{protocol.get('name')}` — start emotion {protocol.get('initial_emotion')}, "
                     f"{rule}, {protocol.get('repeats', 1)} dialogue(s) per scenario.{parity}")
    if wall_s is not None:
        lines.append(f"- Wall time: {wall_s / 60:.1f} min ({wall_s:.0f} s).")
    return "\n".join(lines)


def headline_table(summary: BenchmarkSummary) -> pd.DataFrame:
    """The four headline figures with their intervals: index ``metric``, columns
    ``value, low, high``; intervals over fewer than :data:`rlver_lib.stats.MIN_N`
    scenarios are left out (NaN)."""
    rows = []
    for name in ("sentient_score", "success_rate", "failure_rate", "mean_turns"):
        est = getattr(summary, name)
        small = summary.n_scenarios < MIN_N
        rows.append({"metric": name, "value": est.value, "low": np.nan if small else est.low,
                     "high": np.nan if small else est.high})
    return pd.DataFrame(rows).set_index("metric")


def error_statement(summary: BenchmarkSummary) -> str:
    """One paragraph: dialogue and scenario counts, why intervals may be left out, the
    error rate with the bounds on the Sentient score (errored dialogues counted at 0
    and at 100, points), and the context-budget stops."""
    parts = [f"{summary.n} scored dialogue(s) over {summary.n_scenarios} scenario(s): {summary.n_success} reached "
             f"100, {summary.n_failure} ended below 10."]
    if summary.n_scenarios < MIN_N:
        parts.append(f"Intervals left out: n = {summary.n_scenarios} scenarios < {MIN_N}.")
    if summary.n_error:
        parts.append(f"{summary.n_error} dialogue(s) ({100 * summary.error_rate:.0f}%) ended in a judge error and are "
                     f"excluded; whatever they would have scored, the Sentient score over all "
                     f"{summary.n + summary.n_error} dialogues lies between {summary.score_errors_as_zero:.1f} "
                     f"(errored ones at 0) and {summary.score_errors_as_100:.1f} (at 100).")
    else:
        parts.append("No judge errors.")
    if summary.n_context_limit:
        parts.append(f"{summary.n_context_limit} dialogue(s) stopped because the policy's context budget ran out "
                     "(termination context_limit).")
    return " ".join(parts)


def styled_breakdown(breakdown: pd.DataFrame) -> Any:
    """The breakdown table as a pandas ``Styler``: rows of groups with fewer than
    :data:`rlver_lib.stats.MIN_N` scenarios greyed, numbers to one decimal (rates two)."""
    def grey(row: pd.Series) -> list[str]:
        return ["color: #999" if row["n_scenarios"] < MIN_N else ""] * len(row)

    formats = {c: "{:.1f}" for c in ("sentient_score", "sentient_low", "sentient_high", "mean_turns")}
    formats |= {c: "{:.2f}" for c in ("success_rate", "failure_rate")}
    return (breakdown.style.apply(grey, axis=1).format(formats).hide(axis="index")
            .set_caption(f"grey: fewer than {MIN_N} scenarios, the interval says little"))


def _dropped_text(counts: dict[str, Any]) -> str:
    n_error = counts.get("n_dropped_error")
    n_missing = counts.get("n_dropped_missing")
    if n_error is None or n_missing is None:  # a paired.json written before the split
        return f"{counts.get('n_dropped', 0)} dropped (errored or missing)"
    return f"{n_error} dropped as errored on either side, {n_missing} as missing on one side"


def describe_paired(paired: PairedComparison) -> str:
    """One sentence on a paired comparison (emotion points): the difference with its
    interval and p-values (the sign-flip one named exact or Monte Carlo as computed),
    the pairs used and dropped, and, when pairs errored, the difference with the
    errored pairs at both bounds (:data:`ERROR_BOUND_RULE`).  The interval and
    p-value are flagged as not evidence below :data:`rlver_lib.stats.MIN_N` scenarios."""
    d = paired.difference
    method = f" ({d.p_method})" if getattr(d, "p_method", "") else ""
    counts = {"n_dropped": paired.n_dropped, "n_dropped_error": paired.n_dropped_error,
              "n_dropped_missing": paired.n_dropped_missing}
    text = (f"trained minus baseline: {d.mean_diff:+.1f} emotion points over {d.n_scenarios} scenario(s) "
            f"({paired.n_pairs} pairs; {_dropped_text(counts)}), {100 * d.confidence:.0f}% CI "
            f"[{d.ci_low:+.1f}, {d.ci_high:+.1f}], sign-flip p = {d.p_value:.3g}{method}, "
            f"sign test p = {d.sign_test_p:.3g}; {d.n_positive} scenario(s) up, {d.n_negative} down, {d.n_zero} equal")
    if d.n_scenarios < MIN_N:
        text += f" (n = {d.n_scenarios} < {MIN_N}: not evidence either way)"
    if paired.errors_low is not None and paired.errors_high is not None:
        lo, hi = paired.errors_low, paired.errors_high
        text += (f"; with the {paired.n_dropped_error} errored pair(s) at the bounds (errored trained dialogues at 0 "
                 f"and baseline ones at 100, then the reverse) it lies between {lo.mean_diff:+.1f} "
                 f"[{lo.ci_low:+.1f}, {lo.ci_high:+.1f}] (p = {lo.p_value:.3g}) and {hi.mean_diff:+.1f} "
                 f"[{hi.ci_low:+.1f}, {hi.ci_high:+.1f}] (p = {hi.p_value:.3g})")
    return text


# --------------------------------------------------------------------------- SAGE scoring


def sage_score(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Score transcript files: SAGE result files or our ``dialogues.jsonl`` (detected).

    One row per file with ``file`` (name), ``model`` (name without ``_result`` /
    extension, or the parent folder for ``dialogues.jsonl``), ``n``,
    ``sentient_score`` (mean final emotion, 0-100), ``success`` (final >= 100) and
    ``failure`` (final < 10) counts, and the ``protocol`` the transcripts follow
    (:func:`transcript_protocol`: ``sage`` when capped dialogues end with an
    unappraised reply, else ``full``) with ``policy_replies`` / ``appraised_replies``.
    Files are read as JSON Lines (``\\n``-separated).
    Raises ``FileNotFoundError``, :class:`rlver_lib.io.JsonlError` or
    :class:`RecordError` (file and line named).
    """
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        views = [dialogue_view(r) for r in load_records(path)]
        if not views:
            raise RecordError(f"{path}: no dialogue records")
        final = np.array([v.final_emotion for v in views])
        protocol = transcript_protocol(views)
        model = path.parent.name if path.name == "dialogues.jsonl" else re.sub(r"_result$", "", path.stem)
        rows.append({
            "file": path.name, "model": model, "n": int(final.size),
            "sentient_score": float(final.mean()),
            "success": int((final >= SUCCESS_EMOTION).sum()),
            "failure": int((final < FAILURE_EMOTION).sum()),
            "protocol": protocol["protocol"],
            "policy_replies": protocol["policy_replies"],
            "appraised_replies": protocol["appraised_replies"],
        })
    return pd.DataFrame(rows, columns=["file", "model", "n", "sentient_score", "success", "failure",
                                       "protocol", "policy_replies", "appraised_replies"])


def sage_score_command(paths: Sequence[str | Path], as_json: bool = False) -> int:
    """``rlver sage-score FILE ... [--json]``: print the :func:`sage_score` table, then
    which protocol each file follows.

    Returns 0, or 2 after printing the error to stderr when a file is missing or bad.
    """
    from rlver_lib.io import JsonlError

    try:
        table = sage_score(paths)
    except (FileNotFoundError, JsonlError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(table.to_dict(orient="records"), ensure_ascii=False, indent=2))
        return 0
    print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    for row in table.itertuples():
        what = ("SAGE's turn rule: capped dialogues end with a reply that was never appraised"
                if row.protocol == "sage" else "every policy reply was appraised")
        print(f"{row.file}: protocol {row.protocol} ({what}; {row.appraised_replies} of "
              f"{row.policy_replies} replies appraised)")
    return 0
