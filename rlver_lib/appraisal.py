"""The simulated user's emotion scale and appraisal modes (the RLVER paper's emotion
rules; docs/ARCHITECTURE.md "Code map").

The constants of the emotion score (points in [0, 100]) and of a change (at most 10
points a turn), the mood letters (:func:`mood_for`), the update rule
(:func:`apply_change`), the ``expected`` mode's real-valued change
(:func:`expected_change`), each sampled mode's scale (:data:`SCALES`), the JSON schemas
of the user's outputs (:func:`structured_schemas`) and their parsers, which refuse what
cannot be used (:class:`SimulatorError`) instead of repairing it.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal, Sequence

from rlver_lib.backends import UnusableOutput

Mood = Literal["S", "A", "B", "C", "F"]
Difficulty = Literal["easy", "moderate", "hard"]
AppraisalMode = Literal["expected", "sage", "first_person"]

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


#: The changes each sampled appraisal mode may give: SAGE's stored judgements use only
#: -10, -5, 0, +5 and +10 (a polite reply that misses the hidden need is -5).
SCALES: dict[str, tuple[int, ...]] = {
    "sage": (-10, -5, 0, 5, 10),
    "first_person": tuple(range(MIN_CHANGE, MAX_CHANGE + 1)),
}
#: Shift of ``expected_center`` (on the P(yes) scale) by difficulty: a harsh user needs a
#: clearer "yes" for the same change, a lenient one less.
DIFFICULTY_SHIFT: dict[str, float] = {"easy": -0.05, "moderate": 0.0, "hard": 0.05}
#: Below this P(yes) of the natural-language guard an expected-value change slides to -10.
GUARD_FLOOR = 0.5


def appraisal_schema(field_chars: int = APPRAISAL_FIELD_CHARS, mode: str = "first_person") -> dict[str, Any]:
    """JSON schema of a sampled appraise output: the text fields capped at ``field_chars``
    characters, ``change`` one of ``SCALES[mode]``. Raises ``KeyError`` for ``expected``
    (it samples no JSON)."""
    return {
        "type": "object",
        "properties": {
            **{name: {"type": "string", "maxLength": field_chars} for name in APPRAISAL_FIELDS},
            # an enum, not minimum/maximum: some schema-to-grammar converters ignore integer bounds
            "change": {"type": "integer", "enum": list(SCALES[mode])},
        },
        "required": [*APPRAISAL_FIELDS, "change"],
        "additionalProperties": False,
    }


def reply_schema(field_chars: int = REPLY_REASONING_CHARS, message_chars: int = MESSAGE_CHARS,
                 *, reasoning: bool = True) -> dict[str, Any]:
    """JSON schema of the reply output: ``reasoning`` (private notes, left out when
    ``reasoning`` is false: after a checklist appraisal the notes add tokens, not
    direction), ``message`` (at most ``message_chars`` characters), ``end_conversation``."""
    fields = {"reasoning": {"type": "string", "maxLength": field_chars}} if reasoning else {}
    fields |= {"message": {"type": "string", "maxLength": message_chars}, "end_conversation": {"type": "boolean"}}
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


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


def structured_schemas(sim_cfg: Any) -> dict[str, dict[str, Any]]:
    """The JSON schemas a simulator of this config sends, by call: ``appraise`` (sampled
    modes only), ``reply`` (no ``reasoning`` after an ``expected`` appraisal), ``opening``."""
    mode = getattr(sim_cfg, "appraisal", "first_person")
    schemas = {"reply": reply_schema(sim_cfg.appraisal_chars, sim_cfg.message_chars, reasoning=mode != "expected"),
               "opening": OPENING_SCHEMA}
    if mode != "expected":
        schemas["appraise"] = appraisal_schema(sim_cfg.appraisal_chars, mode)
    return schemas


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


def parse_appraisal(text: str, scale: Sequence[int] = SCALES["first_person"]) -> dict[str, Any]:
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
