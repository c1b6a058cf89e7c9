"""The affective simulated user (the RLVER paper's SAGE-style "sentient agent"; docs/ARCHITECTURE.md "Code map").

The user holds an emotion score ``e`` in [0, 100] and a mood letter (:func:`mood_for`).
After each policy reply it *appraises* the reply, the update rule runs in code
(:func:`apply_change`: ``e = clamp(e + clamp(change, -10, 10), 0, 100)``, over real
numbers), and it *replies* (the next user message, given the appraisal and the new
mood, with an ``end_conversation`` flag). Three appraisal modes (``simulator.appraisal``):

- ``expected``: a checklist of yes/no questions tied to the scenario's hidden
  intention (:func:`checklist`), each answered by reading P(yes) from the model's
  next-token distribution (one prefill, no sampling), combined into a real-valued change
  (:func:`expected_change`). G-Eval (Liu et al., 2023) reads probabilities instead of a
  sampled score for the same reason: a smooth, low-noise number;
- ``sage``: a sampled JSON appraisal by a third-person analyser that looks first for
  what does not fit the hidden intention, on SAGE's scale (-10, -5, 0, +5, +10);
- ``first_person`` (default): the older sampled first-person JSON appraisal, an integer
  in [-10, 10].

Each sampled call is retried at most ``sim_cfg.max_retries`` times on unusable output
(:func:`~rlver_lib.backends.structured_batch`); every raw output is recorded, and a turn
that still fails carries ``error`` and no invented score. A prompt that would not fit the
model's context is shortened by a stated rule (:func:`fit_history`) and the turn records
how many messages were left out. Only ``reply`` is meant for the policy. Every batched
call is seeded from (simulator seed, stage, turn, attempt), whichever dialogues share it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from string import Template
from typing import Any, Callable, Literal, Sequence

from rlver_lib.backends import (
    BackendDied,
    BackendError,
    ChatBackend,
    Closing,
    Conversation,
    StructuredResult,
    UnusableOutput,
    answer_probability,
    close_backend,
    derive_seed,
    structured_batch,
)
from rlver_lib.config import SimulatorConfig, UserModelConfig

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
    emotion: float
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
    turn could not be completed within the retry budget; ``history_dropped``: messages
    left out of the simulator's prompt to fit its context (:func:`fit_history`).
    Changes and emotions are real numbers with the expected-value appraisal, integers
    with the sampled ones.
    """

    dialogue_id: str
    change: float | None
    raw_change: float | None
    emotion_before: float
    emotion: float
    mood: Mood
    appraisal: dict[str, Any]
    reply: str | None
    goodbye: bool
    raw_outputs: list[str] = field(default_factory=list)
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    history_dropped: int = 0


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
    """The visible conversation as ``Speaker: text`` lines, from the user's side
    (a ``note`` message, which :func:`fit_history` inserts, is shown as it is)."""
    vocab = _vocab(language)
    lines = []
    for message in history:
        if message["role"] == "note":
            lines.append(message["content"])
            continue
        text = message["content"].strip() or vocab["empty_reply"]
        lines.append(f"{vocab['speakers'][message['role']]}: {text}")
    return "\n".join(lines)


def shorten_history(history: Sequence[dict[str, str]], dropped: int, language: str) -> list[dict[str, str]]:
    """``history`` with ``dropped`` messages after the first one left out and replaced by a
    note saying how many: the opening message (the user's situation) and the latest
    exchanges stay. ``dropped`` 0 returns a copy; ``ValueError`` when it would reach the
    reply being appraised (the last message)."""
    if dropped == 0:
        return list(history)
    if not 0 < dropped <= len(history) - 2:
        raise ValueError(f"cannot leave out {dropped} of {len(history)} messages")
    note = Template(_vocab(language)["omitted"]).substitute(n=dropped)
    return [history[0], {"role": "note", "content": note}, *history[1 + dropped:]]


def _exchange(user: str, scenario: Any) -> Conversation:
    return [{"role": "system", "content": _system_prompt(scenario)}, {"role": "user", "content": user}]


def appraise_messages(request: SimulatorRequest, difficulty: Difficulty, mode: str = "first_person") -> Conversation:
    """Chat messages of a sampled appraise step (``mode`` ``sage`` or ``first_person``).

    Layout for prefix reuse: the static system prompt, then the transcript, then the
    per-call instruction with the current score, so this turn's prompt up to the end
    of the transcript is a prefix of the next turn's and of this turn's reply call.
    """
    language = scenario_language(request.scenario)
    mood = mood_for(request.emotion)
    variant = "_sage" if mode == "sage" else ""
    user = _fill(
        f"sim_appraise{variant}_{language}.txt",
        transcript=render_transcript(request.history, language),
        emotion=_shown(request.emotion),
        mood=mood,
        mood_meaning=_vocab(language)["moods"][mood]["meaning"],
        guidance=prompt_text(f"sim_difficulty_{difficulty}{variant}_{language}.txt").strip(),
    )
    return _exchange(user, request.scenario)


def _shown(emotion: float) -> str:
    """An emotion as a prompt shows it: a whole number."""
    return str(int(round(emotion)))


@dataclass(frozen=True)
class ChecklistQuestion:
    """One yes/no question of the expected-value appraisal: ``key`` (``on_situation``,
    ``understood``, ``intention`` or ``guard``), ``text`` in the scenario's language, and
    ``guard`` (True for the natural-language check)."""

    key: str
    text: str
    guard: bool = False


def checklist(scenario: Any, keys: Sequence[str] = ("on_situation", "understood", "intention")
              ) -> list[ChecklistQuestion]:
    """The questions asked about every reply in this scenario: the content questions named
    by ``keys`` (``on_situation``, ``understood``, ``intention``: the one tied to its
    hidden intention), in that order, then the natural-language guard
    (``rlver_lib/prompts/sim_checklist_<language>.json``). Raises ``KeyError`` for an
    unknown key or a ``hidden_intention`` without a question."""
    items = _checklist(scenario_language(scenario))
    texts = {**items["content"], "intention": items["intention"][scenario.hidden_intention]}
    content = [ChecklistQuestion(key, texts[key]) for key in keys]
    return [*content, ChecklistQuestion("guard", items["guard"], guard=True)]


@lru_cache(maxsize=None)
def _checklist(language: str) -> dict[str, Any]:
    return json.loads(prompt_text(f"sim_checklist_{language}.json"))


def checklist_messages(request: SimulatorRequest, question: ChecklistQuestion,
                       order: str = "yes_no") -> Conversation:
    """Chat messages asking one checklist question about the request's latest reply:
    the system prompt, the transcript, the question and the answer instruction (the two
    answers named in ``order``, ``yes_no`` or ``no_yes``). The transcript comes first, so
    the questions of one turn share their prompt up to it (and with the reply call)."""
    language = scenario_language(request.scenario)
    items = _checklist(language)
    transcript = render_transcript(request.history, language)
    user = (f"{_vocab(language)['transcript_intro']}\n{transcript}\n\n"
            f"{items['header']}\n{question.text}\n{items['answer'][order]}")
    return _exchange(user, request.scenario)


def appraisal_notes(appraisal: dict[str, Any], language: str) -> str:
    """The private appraisal as the reply step reads it: the sampled text fields, or each
    checklist question with its probability of "yes"."""
    vocab = _vocab(language)
    if "checklist" in appraisal:
        answers = vocab["answers"]
        return "\n".join(f"- {q['question']} {answers['yes'] if q['p_yes'] >= 0.5 else answers['no']} "
                         f"({q['p_yes']:.2f})" for q in appraisal["checklist"])
    return "\n".join(f"- {label}: {appraisal[name]}" for name, label in vocab["appraisal_notes"].items())


def reply_messages(request: SimulatorRequest, appraisal: dict[str, Any], emotion: float) -> Conversation:
    """Chat messages of the reply step, given the appraisal and the updated emotion
    (same layout as :func:`appraise_messages`; the output fields named are those of
    :func:`reply_schema`, without ``reasoning`` after a checklist appraisal)."""
    language = scenario_language(request.scenario)
    mood = mood_for(emotion)
    vocab = _vocab(language)
    user = _fill(
        f"sim_reply_{language}.txt",
        transcript=render_transcript(request.history, language),
        appraisal_notes=appraisal_notes(appraisal, language),
        emotion=_shown(emotion),
        mood=mood,
        mood_meaning=vocab["moods"][mood]["meaning"],
        mood_instruction=vocab["moods"][mood]["instruction"],
        personality_rule=vocab["personality_rules"].get(
            getattr(request.scenario, "personality", ""), vocab["personality_rule_default"]),
        reply_fields=vocab["reply_fields"]["plain" if "checklist" in appraisal else "with_reasoning"],
    )
    return _exchange(user, request.scenario)


def opening_messages(scenario: Any) -> Conversation:
    """Chat messages asking the user for a first message (no opening line given); the
    start emotion does not enter them."""
    return [
        {"role": "system", "content": _system_prompt(scenario)},
        {"role": "user", "content": _fill(f"sim_opening_{scenario_language(scenario)}.txt")},
    ]


def prompt_files(sim_cfg: Any) -> list[str]:
    """The prompt files (names in ``rlver_lib/prompts``) a simulator of this config reads,
    sorted: the appraise text and rubric of its sampled mode
    (``sim_appraise[_sage]_<lang>.txt``, ``sim_difficulty_<difficulty>[_sage]_<lang>.txt``),
    or the checklist of the ``expected`` mode (``sim_checklist_<lang>.json``), and every
    other ``sim_*`` file (system, vocabulary, reply, opening, and any added later), in
    both languages; no other mode's or difficulty's texts. A judge's identity
    fingerprints them (:func:`rlver_lib.evaluation.judge.judge_description`)."""
    mode = getattr(sim_cfg, "appraisal", "first_person")
    variant = "_sage" if mode == "sage" else ""
    own = {"appraise": rf"sim_appraise{variant}_[a-z]+\.txt",
           "difficulty": rf"sim_difficulty_{re.escape(sim_cfg.difficulty)}{variant}_[a-z]+\.txt",
           "checklist": r"sim_checklist_[a-z]+\.json"}
    wanted = ("checklist",) if mode == "expected" else ("appraise", "difficulty")
    names = sorted(e.name for e in resources.files("rlver_lib").joinpath("prompts").iterdir()
                   if e.name.startswith("sim_"))
    kept = []
    for name in names:
        kind = next((k for k in own if name.startswith(f"sim_{k}_")), None)
        if kind is None or (kind in wanted and re.fullmatch(own[kind], name)):
            kept.append(name)
    return kept


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


def _turn_index(requests: Sequence[SimulatorRequest]) -> int:
    """The turn used for seeding: requests of one batched call share their turn."""
    return max((r.turn for r in requests), default=0)


# ---------------------------------------------------------------------------
# the LLM simulator


class UserSimulator(Closing):
    """The LLM-played user of the RLVER paper (appraise, then reply) over any :class:`ChatBackend`.

    ``sim_cfg`` gives the appraisal mode (see the module notes), difficulty, the
    sampling settings (all sent: :meth:`rlver_lib.config.EndpointConfig.sampling`),
    ``max_new_tokens``, ``max_retries`` and ``n_ctx``; ``seed`` seeds every sampled call.
    The ``expected`` mode needs a backend with ``next_token_logprobs``
    (:class:`~rlver_lib.backends.NextTokenScorer`); ``TypeError`` otherwise.

    When the backend's process dies (:class:`~rlver_lib.backends.BackendDied`), the
    turns in flight fail at once without retries and ``fatal_error`` holds the
    reason; callers (trainer, benchmark) check it after a rollout and stop.
    ``with simulator:`` (or :meth:`close`) stops the backend's server.
    """

    #: top log-probs read per checklist question
    TOP_N = 20

    def __init__(self, backend: ChatBackend, sim_cfg: UserModelConfig | None = None, *, seed: int = 0):
        self.backend = backend
        self.cfg = sim_cfg or SimulatorConfig()
        self.seed = seed
        self.fatal_error: str | None = None
        if self.cfg.appraisal == "expected" and not hasattr(backend, "next_token_logprobs"):
            raise TypeError(f"simulator.appraisal 'expected' needs a backend with next_token_logprobs; "
                            f"{type(backend).__name__} has none (use appraisal 'sage')")

    def close(self) -> None:
        """Close the backend (stops a server it started; see :func:`~rlver_lib.backends.close_backend`)."""
        close_backend(self.backend)

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
        results, self.fatal_error = structured_batch(
            self.backend, conversations, schema, lambda text, _: parse(text), self.cfg.sampling(),
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
            convs = [opening_messages(scenarios[i]) for i in missing]
            generated, _ = self._structured(convs, OPENING_SCHEMA, parse_opening, "opening", -1)
            for i, line in zip(missing, generated):
                lines[i] = line
        return lines

    def _fitted(self, requests: Sequence[SimulatorRequest], render: Callable[[SimulatorRequest], Conversation],
                new_tokens: int) -> tuple[list[SimulatorRequest], list[int], list[str | None]]:
        """The requests with their histories shortened to fit ``n_ctx`` (:func:`fit_history`),
        the messages dropped from each, and the reason a request cannot fit (else ``None``)."""
        fitted, dropped, problems = list(requests), [0] * len(requests), [None] * len(requests)
        counter = getattr(self.backend, "prompt_tokens", None)
        if counter is None:
            return fitted, dropped, problems
        budget = self.cfg.n_ctx - new_tokens
        for i, request in enumerate(requests):
            try:
                fitted[i], dropped[i] = fit_history(request, render, counter, budget)
            except ContextOverflow as err:
                problems[i] = str(err)
        return fitted, dropped, problems

    def _appraise(self, requests: Sequence[SimulatorRequest]):
        for request in requests:
            if not request.history or request.history[-1]["role"] != "assistant":
                raise ValueError(f"{request.dialogue_id}: history must end with the policy reply")
        mode = self.cfg.appraisal
        if mode == "expected":
            render = lambda r: checklist_messages(r, checklist(r.scenario)[-1])  # noqa: E731
            new_tokens = 64  # one answer token, and room for the longest question of the checklist
        else:
            render = lambda r: appraise_messages(r, self.cfg.difficulty, mode)  # noqa: E731
            new_tokens = self.cfg.max_new_tokens
        fitted, dropped, problems = self._fitted(requests, render, new_tokens)
        fits = [i for i, p in enumerate(problems) if p is None]
        appraisals: list[Any] = [None] * len(requests)
        logs = [StructuredResult(failures=[f"appraise: {p}"]) if p else StructuredResult() for p in problems]
        if fits:
            batch = [fitted[i] for i in fits]
            if mode == "expected":
                got, got_logs = self._checklist_appraisals(batch)
            else:
                got, got_logs = self._structured(
                    [render(r) for r in batch], appraisal_schema(self.cfg.appraisal_chars, mode),
                    lambda text: parse_appraisal(text, SCALES[mode]), "appraise", _turn_index(requests))
            for i, value, log in zip(fits, got, got_logs):
                appraisals[i], logs[i] = value, log
        updated = [
            apply_change(r.emotion, a["change"]) if a is not None else (None, r.emotion)
            for r, a in zip(requests, appraisals)
        ]
        return fitted, dropped, appraisals, updated, logs

    def _checklist_appraisals(self, requests: Sequence[SimulatorRequest]) -> tuple[list[Any], list[StructuredResult]]:
        """The expected-value appraisal of each request.

        One round per (question, answer order): each round sends that question about
        every request in one batched ``next_token_logprobs`` call, so a server that keeps
        one dialogue per slot re-reads only the question (the transcript before it is the
        slot's cached prefix). A failed request is asked again at most ``max_retries``
        times within its round; a request with a question still unanswered fails."""
        questions = [checklist(r.scenario, self.cfg.expected_questions) for r in requests]
        orders = ("yes_no", "no_yes") if self.cfg.expected_answer_order == "both" else (
            self.cfg.expected_answer_order,)
        logs = [StructuredResult() for _ in requests]
        answers: list[dict[tuple[str, str], dict[str, float]]] = [{} for _ in requests]
        for j in range(max(len(qs) for qs in questions)):
            for order in orders:
                asked = [i for i, qs in enumerate(questions) if j < len(qs)]
                convs = {i: checklist_messages(requests[i], questions[i][j], order) for i in asked}
                for i, top in self._score_round(convs, logs, f"{order}:{j}").items():
                    answers[i][(questions[i][j].key, order)] = top
        results: list[Any] = [None] * len(requests)
        for i in range(len(requests)):
            for (key, order), top in answers[i].items():
                logs[i].raw_outputs.append(json.dumps({"question": key, "order": order, "top_logprobs": top},
                                                      ensure_ascii=False))
            if len(answers[i]) < len(questions[i]) * len(orders):
                continue
            try:
                results[i] = self._expected(questions[i], orders, answers[i])
            except UnusableOutput as err:
                logs[i].failures.append(f"appraise: {err}")
        return results, logs

    def _score_round(self, convs: dict[int, Conversation], logs: list[StructuredResult],
                     name: str) -> dict[int, dict[str, float]]:
        """``next_token_logprobs`` of each conversation (keyed by request index), with
        bounded retries of the failed ones; failures are logged per request."""
        got: dict[int, dict[str, float]] = {}
        pending = list(convs)
        for attempt in range(self.cfg.max_retries + 1):
            if not pending or self.fatal_error:
                break
            try:
                tops = self.backend.next_token_logprobs([convs[i] for i in pending], self.TOP_N)
                errors: list[str | None] = [None] * len(pending)
            except BackendError as err:
                if isinstance(err, BackendDied):
                    self.fatal_error = str(err)
                complete = err.results is not None and len(err.results) == len(pending)
                tops = err.results if complete else [None] * len(pending)
                errors = err.errors if complete and err.errors else [str(err)] * len(pending)
            still = []
            for i, top, error in zip(pending, tops, errors):
                logs[i].attempts += 1
                if top is None:
                    logs[i].failures.append(f"appraise {name} attempt {attempt + 1}: {error}")
                    still.append(i)
                else:
                    got[i] = top
            pending = still
        return got

    def _expected(self, questions: list[ChecklistQuestion], orders: Sequence[str],
                  answers: dict[tuple[str, str], dict[str, float]]) -> dict[str, Any]:
        """The appraisal record of one request from its answered checklist: per question
        P(yes) in each answer order and their mean (the order's position bias cancels)."""
        rows = []
        for q in questions:
            by_order = {o: answer_probability(answers[(q.key, o)], ("yes", "是"), ("no", "否")) for o in orders}
            rows.append({"key": q.key, "question": q.text, "p_yes": sum(by_order.values()) / len(by_order),
                         "p_yes_by_order": by_order,
                         "top_logprobs": {o: answers[(q.key, o)] for o in orders}})
        content = [row["p_yes"] for row, q in zip(rows, questions) if not q.guard]
        guard = next(row["p_yes"] for row, q in zip(rows, questions) if q.guard)
        center = self.cfg.expected_center + DIFFICULTY_SHIFT[self.cfg.difficulty]
        change = expected_change(content, guard, center=center, scale=self.cfg.expected_scale)
        return {"mode": "expected", "checklist": rows, "content_score": sum(content) / len(content),
                "guard": guard, "center": center, "scale": self.cfg.expected_scale, "change": change}

    def appraise(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """The appraise call and the update rule only (``reply=None``, ``goodbye`` False).

        Same seeding as :meth:`step`, so its changes equal the ones ``step`` gives.
        Raises ``ValueError`` if a history does not end with an assistant message.
        """
        _, dropped, appraisals, updated, logs = self._appraise(requests)
        return [
            self._turn(r, a, u, None, log, StructuredResult(), need_reply=False, dropped=d)
            for r, a, u, log, d in zip(requests, appraisals, updated, logs, dropped)
        ]

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """React to the latest policy reply of each request: appraise, update, reply.

        One batched appraise call (plus retries), the update rule in code, one
        batched reply call (plus retries). Returns one :class:`SimulatorTurn` per
        request, in order. Raises ``ValueError`` if a history does not end with
        an assistant message.
        """
        fitted, dropped, appraisals, updated, appraise_logs = self._appraise(requests)
        ok = [i for i, a in enumerate(appraisals) if a is not None]
        replies: list[Any] = [None] * len(requests)
        reply_logs = [StructuredResult() for _ in requests]
        if ok:
            reasoning = self.cfg.appraisal != "expected"
            got, logs = self._structured(
                [reply_messages(fitted[i], appraisals[i], updated[i][1]) for i in ok],
                reply_schema(self.cfg.appraisal_chars, self.cfg.message_chars, reasoning=reasoning),
                lambda text: parse_reply(text, reasoning=reasoning), "reply", _turn_index(requests),
            )
            for i, reply, log in zip(ok, got, logs):
                replies[i], reply_logs[i] = reply, log
        return [
            self._turn(r, a, u, rep, alog, rlog, dropped=d)
            for r, a, u, rep, alog, rlog, d in zip(requests, appraisals, updated, replies, appraise_logs,
                                                   reply_logs, dropped)
        ]

    @staticmethod
    def _turn(request, appraisal, updated, reply, appraise_log, reply_log, *, need_reply=True,
              dropped: int = 0) -> SimulatorTurn:
        change, emotion = updated
        error = None
        if appraisal is None:
            error = "appraisal unusable after retries: " + "; ".join(appraise_log.failures)
        elif reply is None and need_reply:
            error = "reply unusable after retries: " + "; ".join(reply_log.failures)
        private = dict(appraisal or {})
        if reply is not None and "reasoning" in reply:
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
            history_dropped=dropped,
        )


class ContextOverflow(UnusableOutput):
    """A simulator prompt that does not fit the model's context even when shortened."""


def fit_history(request: SimulatorRequest, render: Callable[[SimulatorRequest], Conversation],
                count: Callable[[list[Conversation]], list[int] | None], budget: int) -> tuple[SimulatorRequest, int]:
    """The request with its history shortened until ``render(request)`` is at most ``budget``
    tokens (``count``: the backend's ``prompt_tokens``), and how many messages were left out.

    The rule (:func:`shorten_history`): keep the first message (the user's opening) and
    the reply being appraised; leave out the oldest messages after the opening, two at a
    time (one exchange), until the prompt fits. Unchanged when ``count`` returns ``None``
    (the server cannot count). Raises :class:`ContextOverflow` when even the opening and
    the reply being appraised do not fit.
    """
    language = scenario_language(request.scenario)
    history = request.history
    # a byte-level tokenizer never makes more tokens than UTF-8 bytes: short prompts need no count
    if sum(len(m["content"].encode("utf-8")) + 16 for m in render(request)) <= budget:
        return request, 0
    dropped = 0
    while True:
        candidate = request if dropped == 0 else SimulatorRequest(
            request.dialogue_id, request.scenario, shorten_history(history, dropped, language),
            request.emotion, request.turn)
        counted = count([render(candidate)])
        if counted is None or counted[0] <= budget:
            return candidate, dropped
        if dropped + 2 > len(history) - 2:
            raise ContextOverflow(f"context overflow: the prompt needs {counted[0]} tokens with "
                                  f"{dropped} message(s) left out; the budget is {budget} (raise n_ctx)")
        dropped += 2


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


class RuleSimulator(Closing):
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

    def close(self) -> None:
        """Nothing to stop (no model, no server)."""

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
