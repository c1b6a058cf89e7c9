"""What the simulated user is asked: one :class:`SimulatorRequest` per dialogue and the
chat messages of each call (appraise, checklist question, reply, opening), rendered from
the texts in ``rlver_lib/prompts`` (docs/ARCHITECTURE.md "Code map").

Every prompt starts with the same static system prompt (persona, situation,
personality, hidden intention) and then the transcript, so a server's prompt cache
reuses it from call to call; the per-call instruction with the current score comes last.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from string import Template
from typing import Any, Sequence

from rlver_lib.appraisal import APPRAISAL_MODES, AppraisalMode, Difficulty, appraisal_mode, mood_for
from rlver_lib.backends import Conversation
from rlver_lib.config import UserModelConfig


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
    (a ``note`` message, which :func:`~rlver_lib.simulator.fit_history` inserts, is shown as it is)."""
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


def appraise_messages(request: SimulatorRequest, difficulty: Difficulty,
                      mode: str | AppraisalMode = "first_person") -> Conversation:
    """Chat messages of a sampled appraise step (``mode``: a sampled mode or its name,
    ``first_person`` or ``sage``; the files it names,
    :meth:`~rlver_lib.appraisal.SampledMode.appraise_files`).

    Layout for prefix reuse: the static system prompt, then the transcript, then the
    per-call instruction with the current score, so this turn's prompt up to the end
    of the transcript is a prefix of the next turn's and of this turn's reply call.
    """
    language = scenario_language(request.scenario)
    mood = mood_for(request.emotion)
    sampled = appraisal_mode(mode) if isinstance(mode, str) else mode
    appraise_file, rubric_file = sampled.appraise_files(language, difficulty)
    user = _fill(
        appraise_file,
        transcript=render_transcript(request.history, language),
        emotion=_shown(request.emotion),
        mood=mood,
        mood_meaning=_vocab(language)["moods"][mood]["meaning"],
        guidance=prompt_text(rubric_file).strip(),
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


def reply_messages(request: SimulatorRequest, appraisal: dict[str, Any], emotion: float, *,
                   reasoning: bool | None = None) -> Conversation:
    """Chat messages of the reply step, given the appraisal and the updated emotion
    (same layout as :func:`appraise_messages`; the output fields named are those of
    :func:`~rlver_lib.appraisal.reply_schema`: with ``reasoning`` when ``reasoning`` is
    true, the appraisal mode's :attr:`~rlver_lib.appraisal.AppraisalMode.reasoning`;
    ``None``: unless the appraisal is a checklist)."""
    if reasoning is None:
        reasoning = "checklist" not in appraisal
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
        reply_fields=vocab["reply_fields"]["with_reasoning" if reasoning else "plain"],
    )
    return _exchange(user, request.scenario)


def opening_messages(scenario: Any) -> Conversation:
    """Chat messages asking the user for a first message (no opening line given); the
    start emotion does not enter them."""
    return [
        {"role": "system", "content": _system_prompt(scenario)},
        {"role": "user", "content": _fill(f"sim_opening_{scenario_language(scenario)}.txt")},
    ]


def prompt_files(sim_cfg: UserModelConfig) -> list[str]:
    """The prompt files (names in ``rlver_lib/prompts``) a simulator of this config reads,
    sorted: its appraisal mode's own files
    (:meth:`~rlver_lib.appraisal.AppraisalMode.own_prompt_files`: a sampled mode's
    appraise text and rubric, ``sim_appraise[_sage]_<lang>.txt`` and
    ``sim_difficulty_<difficulty>[_sage]_<lang>.txt``; the ``expected`` mode's checklist,
    ``sim_checklist_<lang>.json``; none for ``learned``), and every other ``sim_*`` file
    (system, vocabulary, reply, opening, and any added later), in both languages; no
    other mode's or difficulty's texts. A judge's identity fingerprints them
    (:attr:`rlver_lib.evaluation.judge.Judge.description`)."""
    own = appraisal_mode(sim_cfg.appraisal).own_prompt_files(sim_cfg.difficulty)
    kinds = sorted({kind for mode in APPRAISAL_MODES.values() for kind in mode.prompt_patterns})
    names = sorted(e.name for e in resources.files("rlver_lib").joinpath("prompts").iterdir()
                   if e.name.startswith("sim_"))
    kept = []
    for name in names:
        kind = next((k for k in kinds if name.startswith(f"sim_{k}_")), None)
        if kind is None or (kind in own and re.fullmatch(own[kind], name)):
            kept.append(name)
    return kept
