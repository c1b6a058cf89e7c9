"""Does the simulated user stay in character? Counts of four breaks, per dialogue.

The simulated user (paper §3.1: a persona with a hidden intention it never states)
breaks character when it **leaks** its hidden wish (a wish sentence naming the wish's
key idea, :data:`WISH_CUES`), speaks in the **assistant's voice**
(:data:`ASSISTANT_VOICE`), **repeats** an earlier message verbatim, or **leaves
mid-range** (says goodbye with its emotion neither at success nor at failure: counted,
not judged).

These are lexical detectors: they catch explicit breaks, not paraphrases, so their
counts are lower bounds. :func:`character_breaks` counts them in one transcript;
:func:`summarize` totals them over dialogue records.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.records import record_transcript

_WISH_EN = re.compile(r"\bi\s+(really\s+|just\s+|only\s+)?(want|need|wish|would like|hope)\b"
                      r"|\bi['’]d\s+(really\s+|just\s+)?(like|love)\b"
                      r"|\bi['’]m\s+(really\s+|just\s+|only\s+)?(looking for|hoping)\b", re.IGNORECASE)
_WISH_ZH = re.compile(r"我(真的|只是|就)?(想要|想|希望|需要)")

#: The key idea of each hidden intention, as words a leaking sentence would use.
WISH_CUES: dict[str, dict[str, tuple[str, ...]]] = {
    "analyse_problem": {"en": ("several sides", "all sides", "both sides", "every side", "analy", "weigh",
                               "blind spot", "perspectives"),
                        "zh": ("辩证", "分析", "各个角度", "多角度")},
    "practical_advice": {"en": ("advice", "practical", "what to do", "concrete steps", "solution"),
                         "zh": ("建议", "办法", "怎么办", "解决")},
    "understand_others": {"en": ("why they", "why he", "why she", "why people", "their reasons", "understand why"),
                          "zh": ("为什么他", "为什么她", "原因", "为什么这么做")},
    "reflect_grow": {"en": ("reflect", "grow", "learn from"), "zh": ("反思", "成长")},
    "specific_praise": {"en": ("praise", "recogni", "acknowledge what i did", "credit", "tell me i did well"),
                        "zh": ("夸", "表扬", "认可")},
    "be_heard": {"en": ("listen", "vent", "hear me out", "be heard"), "zh": ("倾听", "听我说", "发泄")},
    "deep_empathy": {"en": ("empath", "really understand how i feel", "not just comfort", "shallow"),
                     "zh": ("共情", "感同身受", "不是简单的安慰")},
    "not_at_fault": {"en": ("not my fault", "wasn't my fault", "not at fault", "i did nothing wrong",
                            "agree that i", "tell me i'm right", "no responsibility"),
                     "zh": ("不是我的错", "没有错", "没有责任", "认同我")},
}

#: Phrases a user in character does not say: they belong to the assistant's side.
ASSISTANT_VOICE: dict[str, tuple[str, ...]] = {
    "en": ("how can i help", "how may i help", "how can i assist", "i'm here to help", "i am here to help",
           "as an ai", "feel free to", "let me know if", "is there anything else", "i'd be happy to help",
           "what are some of the main points", "what would you like to discuss", "here are some tips",
           "i hope this helps", "what can i do for you"),
    "zh": ("我能帮你什么", "有什么可以帮你", "作为一个ai", "作为ai", "希望对你有帮助", "随时告诉我", "还有什么需要"),
}

_SENTENCE = re.compile(r"(?<=[.!?。！？])\s*")


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def states_wish(message: str, intention: str, language: str = "en") -> bool:
    """True when one sentence of ``message`` both states a wish and names ``intention``'s key idea."""
    cues = WISH_CUES.get(intention, {}).get(language, ())
    wish = _WISH_ZH if language == "zh" else _WISH_EN
    for sentence in _SENTENCE.split(message):
        low = sentence.lower()
        if wish.search(sentence) and any(cue in low for cue in cues):
            return True
    return False


def assistant_voice(message: str, language: str = "en") -> bool:
    """True when ``message`` uses a phrase of the assistant's side (:data:`ASSISTANT_VOICE`)."""
    low = _normal(message)
    return any(phrase in low for phrase in ASSISTANT_VOICE.get(language, ASSISTANT_VOICE["en"]))


def character_breaks(transcript: Sequence[dict[str, Any]], intention: str, language: str = "en") -> dict[str, int]:
    """Counts of in-character breaks in one dialogue's transcript.

    ``transcript``: the dialogue's entries in order (``role`` user/assistant,
    ``content``; user turns after the opening may carry ``emotion`` and ``goodbye``).
    ``intention``: the scenario's hidden-intention key. Returns
    ``{"user_messages", "wish_leaks", "assistant_voice", "verbatim_repeats",
    "midrange_goodbyes"}`` (a user message can count in several).
    """
    seen: set[str] = set()
    counts = dict(user_messages=0, wish_leaks=0, assistant_voice=0, verbatim_repeats=0, midrange_goodbyes=0)
    for entry in transcript:
        if entry.get("role") != "user" or not entry.get("content"):
            continue
        text = entry["content"]
        counts["user_messages"] += 1
        counts["wish_leaks"] += states_wish(text, intention, language)
        counts["assistant_voice"] += assistant_voice(text, language)
        key = _normal(text)
        counts["verbatim_repeats"] += key in seen
        seen.add(key)
        emotion = entry.get("emotion")
        if entry.get("goodbye") and emotion is not None and FAILURE_EMOTION <= emotion < SUCCESS_EMOTION:
            counts["midrange_goodbyes"] += 1
    return counts


def summarize(records: Iterable[dict[str, Any]], scenarios: dict[str, Any] | None = None) -> dict[str, int]:
    """Totals of :func:`character_breaks` over dialogue records (``scenario_id`` and
    ``transcript``/``turns`` as written to ``dialogues.jsonl``). A record's scenario is
    looked up in ``scenarios`` (scenario id -> scenario) unless the record carries its
    own ``hidden_intention`` (and ``language``), as benchmark records do. Adds
    ``dialogues``. Raises ``KeyError`` for a scenario id missing from ``scenarios``."""
    total = dict(dialogues=0, user_messages=0, wish_leaks=0, assistant_voice=0, verbatim_repeats=0,
                 midrange_goodbyes=0)
    for record in records:
        if "hidden_intention" in record:
            intention, language = record["hidden_intention"], record.get("language", "en")
        else:
            scenario = (scenarios or {})[record["scenario_id"]]
            intention, language = scenario.hidden_intention, getattr(scenario, "language", "en")
        counts = character_breaks(record_transcript(record), intention, language)
        total["dialogues"] += 1
        for key, value in counts.items():
            total[key] += value
    return total
