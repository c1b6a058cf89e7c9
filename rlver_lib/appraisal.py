"""The simulated user's emotion scale and appraisal modes (the RLVER paper's emotion
rules; docs/ARCHITECTURE.md "Code map").

The constants of the emotion score (points in [0, 100]) and of a change (at most 10
points a turn), the mood letters (:func:`mood_for`), the update rule
(:func:`apply_change`), the ``expected`` mode's real-valued change
(:func:`expected_change`), each sampled mode's scale (:data:`SCALES`), the JSON schemas
of the user's outputs (:func:`structured_schemas`) and their parsers, which refuse what
cannot be used (:class:`SimulatorError`) instead of repairing it.

The appraisal modes (``simulator.appraisal``): one :class:`AppraisalMode` class each
(:class:`FirstPersonMode`, :class:`SageMode`, :class:`ExpectedMode`,
:class:`LearnedMode`), registered by name in :data:`APPRAISAL_MODES` and chosen by
:func:`appraisal_mode`, the one place the name is read. A mode holds its prompt files
or feature recipe, its schema and parse or read-out into a change, what it needs of
the backend, whether the reply step writes reasoning, the config fields that belong to
it and the change scale it records. Adding a mode is one subclass and one line of
:data:`APPRAISAL_MODES` (and its name in ``config.UserModelConfig.appraisal``, which a
test checks against the registry).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal, Protocol, Sequence

from rlver_lib.appraiser import SHIPPED, LearnedAppraisal
from rlver_lib.backends import StructuredResult, UnusableOutput, answer_probability
from rlver_lib.config import UserModelConfig

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


#: Every integer change in [-10, 10]: the first-person mode's scale.
FULL_SCALE: tuple[int, ...] = tuple(range(MIN_CHANGE, MAX_CHANGE + 1))
#: SAGE's stored judgements use only -10, -5, 0, +5 and +10 (a polite reply that misses
#: the hidden need is -5): the ``sage`` mode's scale.
SAGE_SCALE: tuple[int, ...] = (-10, -5, 0, 5, 10)
#: Shift of ``expected_center`` (on the P(yes) scale) by difficulty: a harsh user needs a
#: clearer "yes" for the same change, a lenient one less.
DIFFICULTY_SHIFT: dict[str, float] = {"easy": -0.05, "moderate": 0.0, "hard": 0.05}
#: Below this P(yes) of the natural-language guard an expected-value change slides to -10.
GUARD_FLOOR = 0.5


def _appraisal_schema(field_chars: int, scale: Sequence[int]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            **{name: {"type": "string", "maxLength": field_chars} for name in APPRAISAL_FIELDS},
            # an enum, not minimum/maximum: some schema-to-grammar converters ignore integer bounds
            "change": {"type": "integer", "enum": list(scale)},
        },
        "required": [*APPRAISAL_FIELDS, "change"],
        "additionalProperties": False,
    }


def appraisal_schema(field_chars: int = APPRAISAL_FIELD_CHARS, mode: str = "first_person") -> dict[str, Any]:
    """JSON schema of a sampled appraise output: the text fields capped at ``field_chars``
    characters, ``change`` one of ``SCALES[mode]``. Raises ``KeyError`` for a mode that
    samples no JSON (``expected``, ``learned``)."""
    return _appraisal_schema(field_chars, SCALES[mode])


def reply_schema(field_chars: int = REPLY_REASONING_CHARS, message_chars: int = MESSAGE_CHARS,
                 *, reasoning: bool = True) -> dict[str, Any]:
    """JSON schema of the reply output: ``reasoning`` (private notes, left out when
    ``reasoning`` is false: after a checklist appraisal the notes add tokens, not
    direction), ``message`` (at most ``message_chars`` characters), ``end_conversation``."""
    fields = {"reasoning": {"type": "string", "maxLength": field_chars}} if reasoning else {}
    fields |= {"message": {"type": "string", "maxLength": message_chars}, "end_conversation": {"type": "boolean"}}
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


APPRAISAL_SCHEMA: dict[str, Any] = _appraisal_schema(APPRAISAL_FIELD_CHARS, FULL_SCALE)
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


def apply_change(e: float, change: float) -> tuple[float, float]:
    """The emotion update rule of the RLVER paper's simulated user: returns ``(clamped_change, new_e)``.

    ``clamped_change`` = ``change`` clamped to [-10, 10]; ``new_e`` =
    ``e + clamped_change`` clamped to [0, 100]. Real numbers (an expected-value change is
    one); integers in give integers out. Raises ``TypeError`` when either argument is not
    a real number (``bool`` included), ``ValueError`` when it is NaN.
    """
    for name, value in (("e", e), ("change", change)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a real number, got {value!r}")
        if math.isnan(value):
            raise ValueError(f"{name} is NaN")
    clamped = max(MIN_CHANGE, min(MAX_CHANGE, change))
    return clamped, max(MIN_EMOTION, min(MAX_EMOTION, e + clamped))


def expected_change(p_content: Sequence[float], p_guard: float, *, center: float, scale: float) -> float:
    """The change of an expected-value (checklist) appraisal, before the update rule's clamp.

    ``p_content``: P(yes) of each content question (shape (k,), each in [0, 1]);
    ``p_guard``: P(yes) of "is this natural language addressed to you?". The content score
    ``s = mean(p_content)`` moves the emotion by ``scale * (s - center)`` clamped to
    [-10, 10]; below :data:`GUARD_FLOOR` the guard slides that towards -10:
    ``w * content + (1 - w) * (-10)`` with ``w = min(1, p_guard / GUARD_FLOOR)``, so a
    reply the model more likely than not finds unnatural loses up to the whole scale,
    and the guard's own bias on natural replies (the embedded 1.5B model answers it
    with P(yes) 0.55-0.65, docs/MEASURED.md) moves nothing. Raises ``ValueError`` on an
    empty ``p_content`` or a probability outside [0, 1]. This project's design
    (docs/ARCHITECTURE.md "Code map").
    """
    probs = [*p_content, p_guard]
    if not p_content or any(not 0.0 <= p <= 1.0 for p in probs):
        raise ValueError(f"need at least one content probability, all in [0, 1]; got {probs}")
    content = max(MIN_CHANGE, min(MAX_CHANGE, scale * (sum(p_content) / len(p_content) - center)))
    weight = min(1.0, p_guard / GUARD_FLOOR)
    return weight * content + (1.0 - weight) * MIN_CHANGE


# ---------------------------------------------------------------------------
# the outputs' schemas and parsers


def structured_schemas(sim_cfg: UserModelConfig) -> dict[str, dict[str, Any]]:
    """The JSON schemas a simulator of this config sends, by call: ``reply`` (without
    ``reasoning`` after a mode whose reply writes none), ``opening`` and, for a sampled
    mode, ``appraise`` (:meth:`AppraisalMode.schemas`)."""
    return appraisal_mode(sim_cfg.appraisal).schemas(sim_cfg)


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


def parse_appraisal(text: str, scale: Sequence[int] = FULL_SCALE) -> dict[str, Any]:
    """Parse a sampled appraise output: the three text fields and an integer ``change``
    that is one of ``scale`` (default: any integer in [-10, 10]).

    Raises :class:`SimulatorError` on invalid JSON, a missing or mistyped field, or a
    change off the scale (unusable, never rounded or clamped).
    """
    obj = _json_object(text)
    appraisal: dict[str, Any] = {name: _string_field(obj, name) for name in APPRAISAL_FIELDS}
    change = obj.get("change")
    if isinstance(change, bool) or not isinstance(change, int):
        raise SimulatorError(f"field 'change' missing or not an integer: {change!r}")
    if change not in scale:
        raise SimulatorError(f"field 'change' not on the scale {list(scale)}: {change}")
    appraisal["change"] = change
    return appraisal


def parse_reply(text: str, *, reasoning: bool = True) -> dict[str, Any]:
    """Parse a reply output: ``reasoning`` (private; only when ``reasoning``), ``message``
    (non-empty), ``end_conversation`` (bool).

    Raises :class:`SimulatorError`; a missing ``message`` is never replaced by other text.
    """
    obj = _json_object(text)
    end = obj.get("end_conversation")
    if not isinstance(end, bool):
        raise SimulatorError(f"field 'end_conversation' missing or not a boolean: {end!r}")
    reply = {"message": _string_field(obj, "message", allow_empty=False), "end_conversation": end}
    if reasoning:
        reply["reasoning"] = _string_field(obj, "reasoning")
    return reply


def parse_opening(text: str) -> str:
    """Parse an opening output; returns the non-empty ``message``. Raises :class:`SimulatorError`."""
    return _string_field(_json_object(text), "message", allow_empty=False)


# ---------------------------------------------------------------------------
# the appraisal modes

#: What a mode's :meth:`~AppraisalMode.appraise` returns, aligned with its requests: the
#: requests as appraised (histories shortened to fit the context), the messages left
#: out of each, one appraisal record each (``None``: unusable after retries, the turn
#: fails) and one call log each (:class:`~rlver_lib.backends.StructuredResult`).
Appraised = tuple[list[Any], list[int], list[Any], list[StructuredResult]]


class AppraisingUser(Protocol):
    """What a mode may ask of the simulated user it appraises for
    (:class:`~rlver_lib.simulator.UserSimulator`): its config and the two ways of asking
    its backend, each rendering the mode's own prompts and fitting them to the context."""

    cfg: UserModelConfig

    def sampled_appraisals(self, requests: Sequence[Any], mode: SampledMode) -> Appraised:
        """A sampled JSON appraisal of each request (the mode's prompt files, schema and parse)."""
        ...

    def checklist_appraisals(self, requests: Sequence[Any], mode: ExpectedMode) -> Appraised:
        """The mode's yes/no questions about each request, read from next-token log-probs."""
        ...


class AppraisalMode(ABC):
    """How the simulated user turns a policy reply into an emotion change
    (``simulator.appraisal``); one subclass per mode, registered in :data:`APPRAISAL_MODES`.

    Class attributes: ``name`` (the config's value); ``scale``, the changes it records
    (a sampled integer on this scale; ``None``: a real number in [-10, 10]);
    ``reasoning``, whether the reply step after it writes private reasoning (the reply
    schema's ``reasoning`` field); ``needs``, the backend method it calls beyond
    ``generate`` (``None``: none); ``config_fields``, the ``UserModelConfig`` fields that
    belong to it (a judge's identity keeps them only under this mode); ``prompt_patterns``,
    its own prompt files by kind (regular expressions over the names in
    ``rlver_lib/prompts``, ``{difficulty}`` filled in). An instance may hold state for
    one simulator (:meth:`prepare`); :func:`appraisal_mode` makes a fresh one.
    """

    name: ClassVar[str]
    scale: ClassVar[tuple[int, ...] | None] = None
    reasoning: ClassVar[bool] = True
    needs: ClassVar[str | None] = None
    config_fields: ClassVar[tuple[str, ...]] = ()
    prompt_patterns: ClassVar[dict[str, str]] = {}

    def prepare(self, backend: Any) -> None:
        """Ready this mode for a simulator over ``backend``, before any dialogue. Raises
        ``TypeError`` when the backend lacks the method the mode ``needs``."""
        if self.needs and not hasattr(backend, self.needs):
            raise TypeError(f"simulator.appraisal {self.name!r} needs a backend with {self.needs}; "
                            f"{type(backend).__name__} has none (use appraisal 'sage')")

    @abstractmethod
    def appraise(self, user: AppraisingUser, requests: Sequence[Any]) -> Appraised:
        """Appraise each request's last reply (histories end with it); see :data:`Appraised`."""

    def appraise_schema(self, cfg: UserModelConfig) -> dict[str, Any] | None:
        """The JSON schema of its sampled appraise output (``None``: it samples none)."""
        return None

    def schemas(self, cfg: UserModelConfig) -> dict[str, dict[str, Any]]:
        """The JSON schemas a simulator of ``cfg`` sends in this mode, by call: ``reply``,
        ``opening`` and, when it samples one, ``appraise``."""
        schemas = {"reply": reply_schema(cfg.appraisal_chars, cfg.message_chars, reasoning=self.reasoning),
                   "opening": OPENING_SCHEMA}
        own = self.appraise_schema(cfg)
        if own is not None:
            schemas["appraise"] = own
        return schemas

    def own_prompt_files(self, difficulty: str) -> dict[str, str]:
        """Its prompt files by kind, as regular expressions over file names, for ``difficulty``."""
        return {kind: pattern.format(difficulty=re.escape(difficulty))
                for kind, pattern in self.prompt_patterns.items()}

    def keeps_field(self, name: str) -> bool:
        """Whether config field ``name`` is part of a judge's identity under this mode:
        every field but those that belong to another mode."""
        return name in self.config_fields or not any(
            name in mode.config_fields for mode in APPRAISAL_MODES.values())

    def identity_constants(self, cfg: UserModelConfig) -> dict[str, Any]:
        """Constants of the code that shape this mode's answers, recorded in a judge's identity."""
        return {}

    def describes(self, judge: dict[str, Any]) -> bool:
        """Whether a judge description (``Judge.description``) appraises in this mode."""
        return judge.get("appraisal") == self.name


class SampledMode(AppraisalMode):
    """A sampled JSON appraisal (three private text fields and an integer ``change`` on
    ``scale``), from the files ``sim_appraise{prompt_variant}_<language>.txt`` and
    ``sim_difficulty_<difficulty>{prompt_variant}_<language>.txt``; the reply writes
    reasoning."""

    scale: ClassVar[tuple[int, ...]] = FULL_SCALE
    prompt_variant: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        v = re.escape(cls.prompt_variant)
        cls.prompt_patterns = {"appraise": rf"sim_appraise{v}_[a-z]+\.txt",
                               "difficulty": rf"sim_difficulty_{{difficulty}}{v}_[a-z]+\.txt"}

    def appraise(self, user: AppraisingUser, requests: Sequence[Any]) -> Appraised:
        return user.sampled_appraisals(requests, self)

    def appraise_schema(self, cfg: UserModelConfig) -> dict[str, Any]:
        return _appraisal_schema(cfg.appraisal_chars, self.scale)

    def parse(self, text: str) -> dict[str, Any]:
        """:func:`parse_appraisal` on this mode's scale (raises :class:`SimulatorError`)."""
        return parse_appraisal(text, self.scale)

    def appraise_files(self, language: str, difficulty: str) -> tuple[str, str]:
        """The appraise prompt and the difficulty rubric it reads in ``language``."""
        v = self.prompt_variant
        return f"sim_appraise{v}_{language}.txt", f"sim_difficulty_{difficulty}{v}_{language}.txt"


class FirstPersonMode(SampledMode):
    """``first_person`` (default): the user's own sampled JSON appraisal, an integer in [-10, 10]."""

    name = "first_person"


class SageMode(SampledMode):
    """``sage``: a sampled JSON appraisal by a third-person analyser that looks first for
    what does not fit the hidden intention, on SAGE's scale (-10, -5, 0, +5, +10)."""

    name = "sage"
    scale = SAGE_SCALE
    prompt_variant = "_sage"


class ExpectedMode(AppraisalMode):
    """``expected``: a checklist of yes/no questions tied to the scenario's hidden intention
    (``rlver_lib/prompts/sim_checklist_<language>.json``), each answered by reading P(yes)
    from the model's next-token distribution (one prefill, no sampling), combined into a
    real-valued change (:func:`expected_change`). G-Eval (Liu et al., 2023) reads
    probabilities instead of a sampled score for the same reason: a smooth, low-noise
    number. Needs ``next_token_logprobs``; the reply writes no reasoning."""

    name = "expected"
    reasoning = False
    needs = "next_token_logprobs"
    config_fields = ("expected_questions", "expected_center", "expected_scale", "expected_answer_order")
    prompt_patterns = {"checklist": r"sim_checklist_[a-z]+\.json"}
    #: top log-probs read per checklist question
    top_logprobs = 20
    #: tokens a checklist prompt is fitted for: one answer token, and room for the longest question
    new_tokens = 64

    def appraise(self, user: AppraisingUser, requests: Sequence[Any]) -> Appraised:
        return user.checklist_appraisals(requests, self)

    def question_keys(self, cfg: UserModelConfig) -> list[str]:
        """The content questions asked (``expected_questions``; the guard is always asked)."""
        return list(cfg.expected_questions)

    def answer_orders(self, cfg: UserModelConfig) -> tuple[str, ...]:
        """The orders the two answers are named in (``expected_answer_order``; ``both``: two)."""
        return ("yes_no", "no_yes") if cfg.expected_answer_order == "both" else (cfg.expected_answer_order,)

    def read_out(self, questions: Sequence[Any], orders: Sequence[str],
                 answers: dict[tuple[str, str], dict[str, float]], cfg: UserModelConfig) -> dict[str, Any]:
        """The appraisal record of one request from its answered checklist (``questions``:
        ``ChecklistQuestion``; ``answers``: the top log-probs by (question key, order)):
        per question P(yes) in each answer order and their mean (the order's position bias
        cancels), the content score, the guard, and the change. Raises
        :class:`~rlver_lib.backends.UnusableOutput` when an answer has neither yes nor no."""
        rows = []
        for q in questions:
            by_order = {o: answer_probability(answers[(q.key, o)], ("yes", "是"), ("no", "否")) for o in orders}
            rows.append({"key": q.key, "question": q.text, "p_yes": sum(by_order.values()) / len(by_order),
                         "p_yes_by_order": by_order,
                         "top_logprobs": {o: answers[(q.key, o)] for o in orders}})
        content = [row["p_yes"] for row, q in zip(rows, questions) if not q.guard]
        guard = next(row["p_yes"] for row, q in zip(rows, questions) if q.guard)
        center = cfg.expected_center + DIFFICULTY_SHIFT[cfg.difficulty]
        change = expected_change(content, guard, center=center, scale=cfg.expected_scale)
        return {"mode": "expected", "checklist": rows, "content_score": sum(content) / len(content),
                "guard": guard, "center": center, "scale": cfg.expected_scale, "change": change}

    def identity_constants(self, cfg: UserModelConfig) -> dict[str, Any]:
        return {"expected_difficulty_shift": DIFFICULTY_SHIFT[cfg.difficulty],
                "expected_top_logprobs": self.top_logprobs}


class LearnedMode(AppraisalMode):
    """``learned``: no model call; a logistic head on the simulator model's embeddings
    (:class:`~rlver_lib.appraiser.LearnedAppraisal`, its feature recipe
    :data:`~rlver_lib.appraiser.RECIPE`, the file read in :meth:`prepare`, so a missing,
    corrupt or foreign file fails before any dialogue). The reply writes no reasoning."""

    name = "learned"
    reasoning = False

    def __init__(self) -> None:
        self.appraiser: LearnedAppraisal | None = None

    def prepare(self, backend: Any) -> None:
        super().prepare(backend)
        self.appraiser = LearnedAppraisal()

    def appraise(self, user: AppraisingUser, requests: Sequence[Any]) -> Appraised:
        if self.appraiser is None:
            self.appraiser = LearnedAppraisal()
        return (list(requests), [0] * len(requests), self.appraiser(requests),
                [StructuredResult() for _ in requests])

    def identity_constants(self, cfg: UserModelConfig) -> dict[str, Any]:
        """The sha256 of the shipped appraiser file (``None`` when it is missing)."""
        try:
            return {"learned_appraiser_sha256": hashlib.sha256(SHIPPED.read_bytes()).hexdigest()}
        except OSError:
            return {"learned_appraiser_sha256": None}


APPRAISAL_MODES: dict[str, type[AppraisalMode]] = {
    "first_person": FirstPersonMode,
    "sage": SageMode,
    "expected": ExpectedMode,
    "learned": LearnedMode,
}
"""The appraisal modes by their ``simulator.appraisal`` name."""

#: The changes each sampled mode may give, by name.
SCALES: dict[str, tuple[int, ...]] = {name: mode.scale for name, mode in APPRAISAL_MODES.items()
                                      if mode.scale is not None}


def appraisal_mode(name: str) -> AppraisalMode:
    """A fresh :data:`APPRAISAL_MODES` object for ``name``: the one place the mode's name is
    read. Raises ``ValueError`` naming the valid modes for an unknown name."""
    try:
        mode = APPRAISAL_MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown appraisal mode {name!r}; valid: {', '.join(APPRAISAL_MODES)}") from None
    return mode()
