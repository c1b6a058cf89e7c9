"""The affective simulated user (the RLVER paper's SAGE-style "sentient agent"; docs/ARCHITECTURE.md "simulator").

The user holds an emotion score ``e`` in [0, 100] and a mood letter (:func:`mood_for`).
After each policy reply it makes two structured calls: *appraise* (in character: what
the reply meant, how it fits the hidden intention, the inner reaction, and an integer
``change`` in [-10, 10]) and *reply* (the next user message, given the appraisal and
the new mood, with an ``end_conversation`` flag). Between the two, the update rule runs
in code (:func:`apply_change`): ``e = clamp(e + clamp(change, -10, 10), 0, 100)``.

Each structured call is retried at most ``sim_cfg.max_retries`` times on unusable
output (:func:`~rlver_lib.backends.structured_batch`); every raw output is recorded, and
a turn that still fails carries ``error`` and no invented score. Only ``reply`` is
meant for the policy. Every batched call is seeded from (simulator seed, stage, turn,
attempt), whichever dialogues share the batch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from string import Template
from typing import Any, Callable, Literal, Sequence

from rlver_lib.backends import BackendError as BackendError  # re-exported: what a failed simulator call raises
from rlver_lib.backends import (
    ChatBackend,
    Conversation,
    SamplingParams,
    StructuredResult,
    UnusableOutput,
    derive_seed,
    structured_batch,
)
from rlver_lib.config import SimulatorConfig

Mood = Literal["S", "A", "B", "C", "F"]
Difficulty = Literal["easy", "moderate", "hard"]

MIN_CHANGE, MAX_CHANGE = -10, 10
MIN_EMOTION, MAX_EMOTION = 0, 100
SUCCESS_EMOTION, FAILURE_EMOTION = 100, 10

APPRAISAL_FIELDS = ("reply_meaning", "intention_fit", "inner_reaction")
#: Default length caps (characters) on the free-text fields (``simulator.appraisal_chars``
#: and ``simulator.message_chars``): a grammar-constrained model then always closes the
#: object within its token budget, where unbounded reasoning ran past it and left
#: unusable, truncated JSON (measured with the embedded 1.5B simulator: 4 of 24
#: appraisals at 200 tokens). Strong judges get larger caps in the paper recipes.
APPRAISAL_FIELD_CHARS = 200
REPLY_REASONING_CHARS, MESSAGE_CHARS = 200, 400


def appraisal_schema(field_chars: int = APPRAISAL_FIELD_CHARS) -> dict[str, Any]:
    """JSON schema of the appraise output; text fields capped at ``field_chars`` characters."""
    return {
        "type": "object",
        "properties": {
            **{name: {"type": "string", "maxLength": field_chars} for name in APPRAISAL_FIELDS},
            # an enum, not minimum/maximum: some schema-to-grammar converters ignore integer bounds
            "change": {"type": "integer", "enum": list(range(MIN_CHANGE, MAX_CHANGE + 1))},
        },
        "required": [*APPRAISAL_FIELDS, "change"],
        "additionalProperties": False,
    }


def reply_schema(field_chars: int = REPLY_REASONING_CHARS, message_chars: int = MESSAGE_CHARS) -> dict[str, Any]:
    """JSON schema of the reply output (``reasoning``, ``message``, ``end_conversation``)."""
    return {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "maxLength": field_chars},
            "message": {"type": "string", "maxLength": message_chars},
            "end_conversation": {"type": "boolean"},
        },
        "required": ["reasoning", "message", "end_conversation"],
        "additionalProperties": False,
    }


APPRAISAL_SCHEMA: dict[str, Any] = appraisal_schema()
REPLY_SCHEMA: dict[str, Any] = reply_schema()
OPENING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"message": {"type": "string", "maxLength": MESSAGE_CHARS}},
    "required": ["message"],
    "additionalProperties": False,
}


class SimulatorError(UnusableOutput):
    """A structured simulator output that cannot be used (the message says why)."""


# ---------------------------------------------------------------------------
# update rule


def mood_for(e: float) -> Mood:
    """Mood letter of emotion score ``e`` (the SAGE / RLVER emotion labels).

    S: e >= 100, A: e >= 70, B: e >= 40, C: e >= 10, F: e < 10.
    """
    if e >= SUCCESS_EMOTION:
        return "S"
    if e >= 70:
        return "A"
    if e >= 40:
        return "B"
    if e >= FAILURE_EMOTION:
        return "C"
    return "F"


def apply_change(e: int, change: int) -> tuple[int, int]:
    """The emotion update rule of the RLVER paper's simulated user: returns ``(clamped_change, new_e)``.

    ``clamped_change`` = ``change`` clamped to [-10, 10]; ``new_e`` =
    ``e + clamped_change`` clamped to [0, 100]. Raises ``TypeError`` when either
    argument is not an integer (``bool`` included).
    """
    for name, value in (("e", e), ("change", change)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    clamped = max(MIN_CHANGE, min(MAX_CHANGE, change))
    return clamped, max(MIN_EMOTION, min(MAX_EMOTION, e + clamped))


# ---------------------------------------------------------------------------
# requests and results


@dataclass
class SimulatorRequest:
    """One dialogue waiting for the simulated user's reaction.

    ``history``: the visible conversation (``role`` user/assistant, ``content``),
    ending with the policy reply to appraise. ``emotion``: score before this
    turn (0-100). ``turn``: 0-based policy-turn index.
    """

    dialogue_id: str
    scenario: Any
    history: list[dict[str, str]]
    emotion: int
    turn: int


@dataclass
class SimulatorTurn:
    """The simulated user's reaction to one policy reply.

    ``raw_change``: the change the model (or rule) gave; ``change``: after the
    clamp; ``emotion_before``/``emotion``: score before/after (0-100);
    ``appraisal``: private fields (never shown to the policy); ``reply``: the
    user's next message (``None`` when the turn failed); ``goodbye``: the user
    ended the conversation (structured flag); ``raw_outputs``: every raw model
    output of this turn, in call order; ``attempts``: number of model calls;
    ``failures``: why each failed attempt was unusable; ``error``: set when the
    turn could not be completed within the retry budget.
    """

    dialogue_id: str
    change: int | None
    raw_change: int | None
    emotion_before: int
    emotion: int
    mood: Mood
    appraisal: dict[str, Any]
    reply: str | None
    goodbye: bool
    raw_outputs: list[str] = field(default_factory=list)
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    error: str | None = None


# ---------------------------------------------------------------------------
# prompts


@lru_cache(maxsize=None)
def prompt_text(name: str) -> str:
    """The text of ``rlver_lib/prompts/<name>`` (UTF-8). Raises ``FileNotFoundError``."""
    return resources.files("rlver_lib").joinpath("prompts", name).read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _vocab(language: str) -> dict[str, Any]:
    return json.loads(prompt_text(f"sim_vocab_{language}.json"))


def scenario_language(scenario: Any) -> str:
    """The scenario's ``language`` (default ``"en"``); ``ValueError`` unless it is ``en`` or ``zh``,
    the languages the prompts are written in."""
    language = getattr(scenario, "language", "en")
    if language not in ("en", "zh"):
        raise ValueError(f"scenario {getattr(scenario, 'id', '?')}: unsupported language {language!r}")
    return language


def _render(value: Any) -> str:
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return "\n".join(f"- {k}: {_render(v)}" for k, v in value.items() if v not in (None, ""))
    if isinstance(value, (list, tuple)):
        return ", ".join(_render(v) for v in value)
    return str(value)


def _fill(name: str, **values: Any) -> str:
    return Template(prompt_text(name)).substitute({k: _render(v) for k, v in values.items()}).strip()


def _system_prompt(scenario: Any) -> str:
    """The static part of every simulator prompt: persona, situation, personality,
    hidden intention. It never changes within a dialogue (no score, no mood), so a
    server's prompt cache reuses it, and the transcript after it, from call to call."""
    language = scenario_language(scenario)
    personality = getattr(scenario, "personality", "")
    return _fill(
        f"sim_system_{language}.txt",
        persona=scenario.persona,
        situation=getattr(scenario, "situation_text", None) or scenario.situation,
        personality=personality,
        personality_text=_vocab(language)["personalities"].get(personality, ""),
        intention=scenario.intention_text,
    )


def render_transcript(history: Sequence[dict[str, str]], language: str) -> str:
    """The visible conversation as ``Speaker: text`` lines, from the user's side."""
    vocab = _vocab(language)
    lines = []
    for message in history:
        text = message["content"].strip() or vocab["empty_reply"]
        lines.append(f"{vocab['speakers'][message['role']]}: {text}")
    return "\n".join(lines)


def appraise_messages(request: SimulatorRequest, difficulty: Difficulty) -> Conversation:
    """Chat messages of the appraise step for one request.

    Layout for prefix reuse: the static system prompt, then the transcript, then the
    per-call instruction with the current score, so this turn's prompt up to the end
    of the transcript is a prefix of the next turn's and of this turn's reply call.
    """
    language = scenario_language(request.scenario)
    mood = mood_for(request.emotion)
    user = _fill(
        f"sim_appraise_{language}.txt",
        transcript=render_transcript(request.history, language),
        emotion=request.emotion,
        mood=mood,
        mood_meaning=_vocab(language)["moods"][mood]["meaning"],
        guidance=prompt_text(f"sim_difficulty_{difficulty}_{language}.txt").strip(),
    )
    return [
        {"role": "system", "content": _system_prompt(request.scenario)},
        {"role": "user", "content": user},
    ]


def reply_messages(request: SimulatorRequest, appraisal: dict[str, Any], emotion: int) -> Conversation:
    """Chat messages of the reply step, given the appraisal and the updated emotion
    (same layout as :func:`appraise_messages`)."""
    language = scenario_language(request.scenario)
    mood = mood_for(emotion)
    vocab = _vocab(language)
    user = _fill(
        f"sim_reply_{language}.txt",
        transcript=render_transcript(request.history, language),
        **{name: appraisal[name] for name in APPRAISAL_FIELDS},
        emotion=emotion,
        mood=mood,
        mood_meaning=vocab["moods"][mood]["meaning"],
        mood_instruction=vocab["moods"][mood]["instruction"],
        personality_rule=vocab["personality_rules"].get(
            getattr(request.scenario, "personality", ""), vocab["personality_rule_default"]),
    )
    return [
        {"role": "system", "content": _system_prompt(request.scenario)},
        {"role": "user", "content": user},
    ]


def opening_messages(scenario: Any, emotion: int) -> Conversation:
    """Chat messages asking the user for a first message (no opening line given).

    ``emotion`` is the starting score; the opening instruction does not use it.
    """
    return [
        {"role": "system", "content": _system_prompt(scenario)},
        {"role": "user", "content": _fill(f"sim_opening_{scenario_language(scenario)}.txt")},
    ]


# ---------------------------------------------------------------------------
# parsing structured outputs

_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def _json_object(text: str) -> dict[str, Any]:
    try:
        # strict=False: llama.cpp grammars let raw newlines into strings
        obj = json.loads(_FENCE.sub("", text.strip()), strict=False)
    except json.JSONDecodeError as err:
        raise SimulatorError(f"invalid JSON: {err.msg} at column {err.colno}") from None
    if not isinstance(obj, dict):
        raise SimulatorError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _string_field(obj: dict[str, Any], name: str, *, allow_empty: bool = True) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise SimulatorError(f"field {name!r} missing or not a string")
    if not allow_empty and not value.strip():
        raise SimulatorError(f"field {name!r} is empty")
    return value.strip()


def parse_appraisal(text: str) -> dict[str, Any]:
    """Parse an appraise output: the three text fields and an integer ``change``.

    Raises :class:`SimulatorError` on invalid JSON, a missing or mistyped field,
    or a change outside [-10, 10] (an out-of-range change is unusable, not clamped).
    """
    obj = _json_object(text)
    appraisal: dict[str, Any] = {name: _string_field(obj, name) for name in APPRAISAL_FIELDS}
    change = obj.get("change")
    if isinstance(change, bool) or not isinstance(change, int):
        raise SimulatorError(f"field 'change' missing or not an integer: {change!r}")
    if not MIN_CHANGE <= change <= MAX_CHANGE:
        raise SimulatorError(f"field 'change' out of range [-10, 10]: {change}")
    appraisal["change"] = change
    return appraisal


def parse_reply(text: str) -> dict[str, Any]:
    """Parse a reply output: ``reasoning`` (private), ``message`` (non-empty), ``end_conversation`` (bool).

    Raises :class:`SimulatorError`; a missing ``message`` is never replaced by other text.
    """
    obj = _json_object(text)
    end = obj.get("end_conversation")
    if not isinstance(end, bool):
        raise SimulatorError(f"field 'end_conversation' missing or not a boolean: {end!r}")
    return {
        "reasoning": _string_field(obj, "reasoning"),
        "message": _string_field(obj, "message", allow_empty=False),
        "end_conversation": end,
    }


def parse_opening(text: str) -> str:
    """Parse an opening output; returns the non-empty ``message``. Raises :class:`SimulatorError`."""
    return _string_field(_json_object(text), "message", allow_empty=False)


def _turn_index(requests: Sequence[SimulatorRequest]) -> int:
    """The turn used for seeding: requests of one batched call share their turn."""
    return max((r.turn for r in requests), default=0)


# ---------------------------------------------------------------------------
# the LLM simulator


class UserSimulator:
    """The LLM-played user of the RLVER paper (appraise, then reply) over any :class:`ChatBackend`.

    ``sim_cfg`` gives difficulty (easy / moderate / hard prompt texts),
    temperature, ``max_new_tokens`` and ``max_retries``; ``seed`` seeds every call.

    When the backend's process dies (:class:`~rlver_lib.backends.BackendDied`), the
    turns in flight fail at once without retries and ``fatal_error`` holds the
    reason; callers (trainer, benchmark) check it after a rollout and stop.
    """

    def __init__(self, backend: ChatBackend, sim_cfg: SimulatorConfig | None = None, *, seed: int = 0):
        self.backend = backend
        self.cfg = sim_cfg or SimulatorConfig()
        self.seed = seed
        self.fatal_error: str | None = None

    def _structured(
        self,
        conversations: list[Conversation],
        schema: dict[str, Any],
        parse: Callable[[str], Any],
        stage: str,
        turn: int,
    ) -> tuple[list[Any], list[StructuredResult]]:
        """Batched structured calls with bounded retries of the unusable ones
        (:func:`~rlver_lib.backends.structured_batch`, seeds from (seed, stage, turn, attempt)).

        Returns one parsed value (``None`` if every attempt failed) and one log per conversation.
        """
        sampling = SamplingParams(temperature=self.cfg.temperature, top_p=1.0,
                                  max_new_tokens=self.cfg.max_new_tokens)
        results, self.fatal_error = structured_batch(
            self.backend, conversations, schema, lambda text, _: parse(text), sampling,
            max_retries=self.cfg.max_retries, attempt_seed=lambda attempt: derive_seed(self.seed, stage, turn, attempt),
            name=stage, tolerate_errors=True, died=self.fatal_error)
        return [r.value for r in results], results

    def opening_lines(self, scenarios: Sequence[Any]) -> list[str | None]:
        """The first user message per scenario: its ``opening_line``, else generated.

        Generated lines use one batched structured call (bounded retries);
        ``None`` marks a scenario whose opening could not be generated.
        """
        missing = [i for i, s in enumerate(scenarios) if not getattr(s, "opening_line", None)]
        lines: list[str | None] = [getattr(s, "opening_line", None) for s in scenarios]
        if missing:
            convs = [opening_messages(scenarios[i], self.cfg.initial_emotion) for i in missing]
            generated, _ = self._structured(convs, OPENING_SCHEMA, parse_opening, "opening", -1)
            for i, line in zip(missing, generated):
                lines[i] = line
        return lines

    def _appraise(self, requests: Sequence[SimulatorRequest]):
        for request in requests:
            if not request.history or request.history[-1]["role"] != "assistant":
                raise ValueError(f"{request.dialogue_id}: history must end with the policy reply")
        appraisals, logs = self._structured(
            [appraise_messages(r, self.cfg.difficulty) for r in requests],
            appraisal_schema(self.cfg.appraisal_chars), parse_appraisal, "appraise", _turn_index(requests),
        )
        updated = [
            apply_change(r.emotion, a["change"]) if a is not None else (None, r.emotion)
            for r, a in zip(requests, appraisals)
        ]
        return appraisals, updated, logs

    def appraise(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """The appraise call and the update rule only (``reply=None``, ``goodbye`` False).

        Same seeding as :meth:`step`, so its changes equal the ones ``step`` gives.
        Raises ``ValueError`` if a history does not end with an assistant message.
        """
        appraisals, updated, logs = self._appraise(requests)
        return [
            self._turn(r, a, u, None, log, StructuredResult(), need_reply=False)
            for r, a, u, log in zip(requests, appraisals, updated, logs)
        ]

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """React to the latest policy reply of each request: appraise, update, reply.

        One batched appraise call (plus retries), the update rule in code, one
        batched reply call (plus retries). Returns one :class:`SimulatorTurn` per
        request, in order. Raises ``ValueError`` if a history does not end with
        an assistant message.
        """
        appraisals, updated, appraise_logs = self._appraise(requests)
        ok = [i for i, a in enumerate(appraisals) if a is not None]
        replies: list[Any] = [None] * len(requests)
        reply_logs = [StructuredResult() for _ in requests]
        if ok:
            got, logs = self._structured(
                [reply_messages(requests[i], appraisals[i], updated[i][1]) for i in ok],
                reply_schema(self.cfg.appraisal_chars, self.cfg.message_chars), parse_reply, "reply",
                _turn_index(requests),
            )
            for i, reply, log in zip(ok, got, logs):
                replies[i], reply_logs[i] = reply, log
        return [
            self._turn(r, a, u, rep, alog, rlog)
            for r, a, u, rep, alog, rlog in zip(requests, appraisals, updated, replies, appraise_logs, reply_logs)
        ]

    @staticmethod
    def _turn(request, appraisal, updated, reply, appraise_log, reply_log, *, need_reply=True) -> SimulatorTurn:
        change, emotion = updated
        error = None
        if appraisal is None:
            error = "appraisal unusable after retries: " + "; ".join(appraise_log.failures)
        elif reply is None and need_reply:
            error = "reply unusable after retries: " + "; ".join(reply_log.failures)
        private = dict(appraisal or {})
        if reply is not None:
            private["reply_reasoning"] = reply["reasoning"]
        return SimulatorTurn(
            dialogue_id=request.dialogue_id,
            change=change,
            raw_change=appraisal["change"] if appraisal else None,
            emotion_before=request.emotion,
            emotion=emotion,
            mood=mood_for(emotion),
            appraisal=private,
            reply=reply["message"] if reply else None,
            goodbye=bool(reply and reply["end_conversation"]),
            raw_outputs=appraise_log.raw_outputs + reply_log.raw_outputs,
            attempts=appraise_log.attempts + reply_log.attempts,
            failures=appraise_log.failures + reply_log.failures,
            error=error,
        )


# ---------------------------------------------------------------------------
# the deterministic rule simulator

DEFAULT_OPENING = {"en": "Hi. I have something on my mind and I need to talk.",
                   "zh": "你好，我心里有点事，想找人聊聊。"}
RULE_REPLIES = {
    "en": {"S": "Thank you, I feel much better. Goodbye!", "F": "Forget it. Goodbye.", "other": "Okay. Tell me more."},
    "zh": {"S": "谢谢你，我好多了。再见！", "F": "算了，再见。", "other": "嗯，然后呢？"},
}


def default_change_fn(policy_reply: str) -> int:
    """The rule simulator's default change: +10 if the reply ends with a question mark, else -5."""
    return 10 if policy_reply.rstrip().endswith(("?", "？")) else -5


class RuleSimulator:
    """A deterministic stand-in with the simulator interface (tests, learning checks).

    ``change_fn(policy_reply) -> int`` gives the raw change (clamped by the update
    rule). ``reply_fn(request, emotion) -> (message, goodbye)`` optionally scripts
    the user's message and goodbye flag; by default the message depends on the
    mood and the user never says goodbye (success/failure still end a dialogue).
    """

    def __init__(
        self,
        change_fn: Callable[[str], int] = default_change_fn,
        reply_fn: Callable[[SimulatorRequest, int], tuple[str, bool]] | None = None,
    ):
        self.change_fn = change_fn
        self.reply_fn = reply_fn

    def opening_lines(self, scenarios: Sequence[Any]) -> list[str | None]:
        """The scenario's opening line, else a fixed greeting in its language."""
        return [getattr(s, "opening_line", None) or DEFAULT_OPENING[scenario_language(s)] for s in scenarios]

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """Apply ``change_fn`` to each latest policy reply, then the update rule."""
        turns = []
        for request in requests:
            raw = self.change_fn(request.history[-1]["content"])
            change, emotion = apply_change(request.emotion, raw)
            mood = mood_for(emotion)
            if self.reply_fn is not None:
                message, goodbye = self.reply_fn(request, emotion)
            else:
                replies = RULE_REPLIES[scenario_language(request.scenario)]
                message, goodbye = replies.get(mood, replies["other"]), False
            turns.append(
                SimulatorTurn(
                    dialogue_id=request.dialogue_id, change=change, raw_change=raw,
                    emotion_before=request.emotion, emotion=emotion, mood=mood,
                    appraisal={"rule": getattr(self.change_fn, "__name__", "change_fn")},
                    reply=message, goodbye=goodbye,
                )
            )
        return turns


def build_simulator(sim_cfg: SimulatorConfig, seed: int) -> UserSimulator | RuleSimulator:
    """The simulated user a config asks for: :class:`RuleSimulator` (default change
    function, no model) when ``sim_cfg.backend == "rule"``, else a :class:`UserSimulator`
    over :func:`rlver_lib.models.make_simulator_backend` (which may start a server
    process: close it with ``simulator.backend.close()``)."""
    if sim_cfg.backend == "rule":
        return RuleSimulator()
    from rlver_lib.models import make_simulator_backend

    return UserSimulator(make_simulator_backend(sim_cfg, seed), sim_cfg, seed=seed)
