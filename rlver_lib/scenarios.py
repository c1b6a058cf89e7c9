"""Scenarios: who the simulated user is and what they secretly want (docs/ARCHITECTURE.md "Code map").

A :class:`Scenario` is a persona card, a situation, a personality type
(``negative`` / ``passive`` / ``avoidant``) and one of the paper's eight **hidden
intentions** (RLVER §3.1; the same eight "hidden themes" as the SAGE profiles), plus an
optional opening line and the language (``en`` / ``zh``).

Two file formats are read, detected per file: **our format** (JSONL or YAML, a
structured ``situation``) and **RLVER/SAGE profiles** (JSONL with ``player``,
``scene``, ``main_cha``, ``task``); their fields are listed in docs/ARCHITECTURE.md.
Every problem found by :func:`validate_file` names the file, the line and the field;
loaders raise :class:`ScenarioFileError` carrying those issues. Also here: the
persona-disjoint split of a run (:func:`split_for_run`) and scenario generation
(:func:`generate_scenarios`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import random
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Sequence

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from rlver_lib.backends import ChatBackend, structured_batch
from rlver_lib.config import SamplingParams, ScenarioConfig
from rlver_lib.files import JsonlError, iter_jsonl

log = logging.getLogger(__name__)

BUILTIN_FILE = Path(__file__).resolve().parent / "data" / "scenarios_en.jsonl"


@dataclass(frozen=True)
class HiddenIntention:
    """One hidden intention: ``kind`` is ``rational`` or ``emotional``; ``en``/``zh`` are its texts
    (``zh`` is the exact ``task`` sentence of the RLVER/SAGE profiles)."""

    key: str
    kind: Literal["rational", "emotional"]
    en: str
    zh: str


@dataclass(frozen=True)
class PersonalityType:
    """One personality type: ``en`` describes it; ``zh`` is the RLVER ``main_cha`` label."""

    key: str
    en: str
    zh: str


HIDDEN_INTENTIONS: dict[str, HiddenIntention] = {
    h.key: h
    for h in (
        HiddenIntention("analyse_problem", "rational",
                        "You want the other person to analyse the problem in the events from several sides.",
                        "你希望对方辩证地分析事件中的问题"),
        HiddenIntention("practical_advice", "rational",
                        "You want advice that really helps you out of your current difficulty.",
                        "你想获得能真实帮助你解决当下困境的建议"),
        HiddenIntention("understand_others", "rational",
                        "You want to understand why the other people in the events acted as they did.",
                        "你想分析事件中其他人物这么做的原因"),
        HiddenIntention("reflect_grow", "rational",
                        "You want the other person to guide you to reflect on the events and grow from them.",
                        "你希望对方引导你针对事件进行自我反思，收获自我成长"),
        HiddenIntention("specific_praise", "emotional",
                        "You want the other person to sincerely praise specific things you did.",
                        "你希望对方真诚地夸奖你在事件中的具体行为"),
        HiddenIntention("be_heard", "emotional",
                        "You want the other person to listen attentively while you vent your feelings.",
                        "你希望对方用心倾听你的情绪宣泄"),
        HiddenIntention("deep_empathy", "emotional",
                        "You want the other person to deeply empathise with your feelings, not offer shallow comfort.",
                        "你希望对方深刻共情你的感受，而不是简单的安慰"),
        HiddenIntention("not_at_fault", "emotional",
                        "You believe you bear no responsibility or fault in the events"
                        " and want the other person to agree.",
                        "你认为自己在事件中没有任何责任和错误，你想要对方也认同你没有错"),
    )
}

PERSONALITY_TYPES: dict[str, PersonalityType] = {
    p.key: p
    for p in (
        PersonalityType("negative", "Negative: quick to complain, irritable, expects the worst.", "负面型"),
        PersonalityType("passive", "Passive: says little, waits to be drawn out, gives in easily.", "被动型"),
        PersonalityType("avoidant", "Avoidant: deflects, changes the subject, keeps the hard part hidden.", "回避型"),
    )
}

#: The Chinese wording of RLVER/SAGE files (``task``, ``main_cha`` / ``character``) -> our key.
INTENTION_BY_ZH = {h.zh: h.key for h in HIDDEN_INTENTIONS.values()}
PERSONALITY_BY_ZH = {p.zh: p.key for p in PERSONALITY_TYPES.values()}

IntentionKey = Literal["analyse_problem", "practical_advice", "understand_others", "reflect_grow",
                       "specific_praise", "be_heard", "deep_empathy", "not_at_fault"]
PersonalityKey = Literal["negative", "passive", "avoidant"]
Language = Literal["en", "zh"]
Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]

#: Two scenarios whose :func:`scenario_similarity` is at least this are duplicates.
#: Character-trigram Jaccard: the 48 distinct scenarios of the shipped set score at
#: most 0.40 pairwise; a light rewording of one scenario scores above 0.7.
DUPLICATE_THRESHOLD = 0.6


class Situation(BaseModel):
    """What happened and how the person reacts (a SAGE / RLVER scenario): the background story, the
    conflict, the current state, how they speak at high / low / normal mood, and how
    they react to replies that fit or miss their hidden intention."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    background: Text
    conflict: Text
    current_state: Text
    mood_high: Text
    mood_low: Text
    mood_normal: Text
    reply_fit: Text
    reply_miss: Text

    def to_text(self, language: Language = "en") -> str:
        """Render as labelled paragraphs in ``language`` (for simulator prompts)."""
        labels = _SITUATION_LABELS[language]
        return "\n".join(f"{labels[name]}: {getattr(self, name)}" for name in type(self).model_fields)


_SITUATION_LABELS: dict[str, dict[str, str]] = {
    "en": {"background": "Background", "conflict": "Conflict", "current_state": "Current state",
           "mood_high": "When their mood is high", "mood_low": "When their mood is low",
           "mood_normal": "When their mood is middling",
           "reply_fit": "Replies that fit their hidden need", "reply_miss": "Replies that miss it"},
    "zh": {"background": "背景", "conflict": "冲突", "current_state": "当前状态",
           "mood_high": "情绪高时", "mood_low": "情绪低时", "mood_normal": "情绪一般时",
           "reply_fit": "贴合隐藏主题的回复", "reply_miss": "偏离隐藏主题的回复"},
}


class Scenario(BaseModel):
    """One simulated-user scenario.

    ``situation`` is a :class:`Situation` for our format, or the free Markdown scene
    of an imported RLVER/SAGE profile. ``source`` records where it came from
    (``file:line``, ``generated``). ``split`` is set in the shipped set.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Text
    persona: Text
    situation: Situation | Text
    personality: PersonalityKey
    hidden_intention: IntentionKey
    opening_line: Text | None = None
    language: Language
    traits: tuple[str, ...] = ()
    split: Literal["train", "test"] | None = None
    source: str | None = None

    @property
    def intention_text(self) -> str:
        """The hidden intention in the scenario's language."""
        return getattr(HIDDEN_INTENTIONS[self.hidden_intention], self.language)

    @property
    def situation_text(self) -> str:
        """The situation as prompt text in the scenario's language."""
        if isinstance(self.situation, Situation):
            return self.situation.to_text(self.language)
        return self.situation

    @property
    def persona_key(self) -> str:
        """The persona card with whitespace collapsed and case folded: scenarios sharing
        it share a persona (used by :func:`persona_disjoint_split`)."""
        return " ".join(self.persona.split()).casefold()

    def to_record(self) -> dict[str, Any]:
        """Our-format JSON record (round-trips through :func:`load_scenarios`)."""
        return self.model_dump(mode="json", exclude_none=True, exclude_defaults=True) | {
            "language": self.language}


class _ScenarioRecord(BaseModel):
    """Our file format (structured ``situation``; ``language`` may be omitted)."""

    model_config = ConfigDict(extra="forbid")

    id: Text
    persona: Text
    situation: Situation
    personality: PersonalityKey
    hidden_intention: IntentionKey
    opening_line: Text | None = None
    language: Language | None = None
    traits: list[Text] = Field(default_factory=list)
    split: Literal["train", "test"] | None = None
    source: str | None = None


class _FreeTextRecord(_ScenarioRecord):
    """Our format with a free-text ``situation``: how imported profiles are written
    back by :meth:`Scenario.to_record`, so every scenario round-trips."""

    situation: Text


class _ProfileRecord(BaseModel):
    """An RLVER/SAGE profile line. SAGE result files name ``main_cha`` ``character``;
    their other keys (``history``, ``emo_point``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    id: Text
    player: Text
    scene: Text
    main_cha: Text = Field(validation_alias=AliasChoices("main_cha", "character"))
    task: Text
    cha_group: list[Text] = Field(default_factory=list)
    first_talk: Text | None = None


@dataclass(frozen=True)
class ScenarioIssue:
    """One problem in a scenario file: ``line`` is 1-based (0 when the file as a whole
    is at fault); ``field`` is a dotted path such as ``situation.conflict`` or None."""

    file: str
    line: int
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class ScenarioFileError(ValueError):
    """A scenario file that cannot be used. ``issues`` lists every problem found;
    ``unreadable`` is True when the file could not be read or decoded at all."""

    def __init__(self, issues: Sequence[ScenarioIssue], *, unreadable: bool = False):
        self.issues = list(issues)
        self.unreadable = unreadable
        shown = "\n".join(str(i) for i in self.issues[:10])
        more = f"\n... and {len(self.issues) - 10} more" if len(self.issues) > 10 else ""
        super().__init__(f"{len(self.issues)} problem(s) in scenario file:\n{shown}{more}")


# --------------------------------------------------------------------------- reading


@dataclass
class _RawRecord:
    obj: Any
    line: int
    field_lines: dict[str, int]  # dotted field path -> line (YAML); empty for JSONL


def _read_raw(path: Path) -> tuple[list[_RawRecord], list[ScenarioIssue]]:
    """Parse the file into raw objects with line numbers; syntax problems become issues.

    Raises :class:`ScenarioFileError` (``unreadable``) when the file cannot be read
    or is not UTF-8.
    """
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise ScenarioFileError([ScenarioIssue(str(path), 0, None, f"cannot read file: {err}")],
                                unreadable=True) from err
    if path.suffix.lower() in {".yaml", ".yml"}:
        return _read_yaml(path, text)
    records: list[_RawRecord] = []
    try:
        for line, obj in iter_jsonl(path):
            records.append(_RawRecord(obj, line, {}))
    except JsonlError as err:
        message = str(err).split(": ", 1)[1] if ": " in str(err) else str(err)
        return records, [ScenarioIssue(str(path), err.line, None,
                                       f"{message}; lines after it were not checked")]
    return records, []


def _read_yaml(path: Path, text: str) -> tuple[list[_RawRecord], list[ScenarioIssue]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 0
        return [], [ScenarioIssue(str(path), line, None, f"invalid YAML: {getattr(err, 'problem', err)}")]
    if root is None:
        return [], []
    items_node, items = root, data
    if isinstance(data, dict) and "scenarios" in data:
        items_node = next(v for k, v in root.value if k.value == "scenarios")
        items = data["scenarios"]
    if not isinstance(items, list):
        return [], [ScenarioIssue(str(path), root.start_mark.line + 1, None,
                                  "expected a list of scenarios or a mapping with a 'scenarios' list")]
    return [_RawRecord(obj, node.start_mark.line + 1, _yaml_field_lines(node))
            for obj, node in zip(items, items_node.value)], []


def _yaml_field_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            name = f"{prefix}{key.value}"
            lines[name] = key.start_mark.line + 1
            lines.update(_yaml_field_lines(value, name + "."))
    return lines


def _is_profile(obj: Any) -> bool:
    return isinstance(obj, dict) and ("player" in obj or "scene" in obj) and "persona" not in obj


def detect_language(text: str) -> Language:
    """``"zh"`` when CJK ideographs make up at least 30 % of the letters of ``text``
    (each ideograph counted against Latin letters), else ``"en"``."""
    cjk = sum(1 for ch in text if "\u4e00" <= ch <= "\u9fff" or "\u3400" <= ch <= "\u4dbf")
    latin = sum(1 for ch in text if ch.isascii() and ch.isalpha())
    return "zh" if cjk and cjk >= 0.3 * (cjk + latin) else "en"


#: The closing hidden-theme trailer of an RLVER/SAGE scene: a ``####隐藏主题:`` heading
#: line at the very end, followed by at most one line (the ``task`` sentence, often
#: behind ``***``).  Headings inside the scene that merely mention the hidden theme
#: (``**NPC贴合隐藏主题的回复：**``) are not headings of this form and are kept.
_HIDDEN_THEME_TRAILER = re.compile(r"\s*^#+[ \t]*隐藏主题[ \t]*[:：][^\n]*(?:\n[^\n]*)?\s*\Z", re.M)


def _issues_from_validation(path: Path, raw: _RawRecord, err: ValidationError,
                            rename: dict[str, str] | None = None) -> list[ScenarioIssue]:
    issues = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"] if not str(p).isdigit()]
        field = ".".join(loc) or None
        if field is not None and rename:
            field = rename.get(field, field)
        kind = e["type"]
        if kind == "missing":
            message = "missing field"
        elif kind == "string_too_short":
            message = "empty field"
        elif kind == "extra_forbidden":
            message = "unknown field"
        elif kind == "literal_error" and loc and loc[-1] in {"hidden_intention", "personality", "language", "split"}:
            what = {"hidden_intention": "unknown intention", "personality": "unknown personality"}.get(
                loc[-1], f"unknown {loc[-1]}")
            message = f"{what} {e['input']!r}; expected one of {e['ctx']['expected']}"
        elif kind.endswith("_type") or kind == "model_type":
            message = f"wrong type: expected {kind.removesuffix('_type').replace('model', 'object')}, " \
                      f"got {type(e['input']).__name__}"
        else:
            message = e["msg"]
        line = raw.field_lines.get(field or "", raw.line) if field else raw.line
        issues.append(ScenarioIssue(str(path), line, field, message))
    return issues


def _convert_ours(path: Path, raw: _RawRecord) -> tuple[Scenario | None, list[ScenarioIssue]]:
    free_text = isinstance(raw.obj, dict) and isinstance(raw.obj.get("situation"), str)
    try:
        rec = (_FreeTextRecord if free_text else _ScenarioRecord).model_validate(raw.obj)
    except ValidationError as err:
        return None, _issues_from_validation(path, raw, err)
    situation = rec.situation if free_text else rec.situation.background
    detected = detect_language(rec.persona + " " + situation)
    if rec.language is not None and rec.language != detected:
        line = raw.field_lines.get("language", raw.line)
        return None, [ScenarioIssue(str(path), line, "language",
                                    f"declared {rec.language!r} but the text reads as {detected!r}")]
    data = rec.model_dump(exclude_none=True) | {"language": detected, "traits": tuple(rec.traits),
                                                "situation": rec.situation}
    data.setdefault("source", f"{path.name}:{raw.line}")
    return Scenario(**data), []


def _convert_profile(path: Path, raw: _RawRecord) -> tuple[Scenario | None, list[ScenarioIssue]]:
    try:
        rec = _ProfileRecord.model_validate(raw.obj)
    except ValidationError as err:
        return None, _issues_from_validation(path, raw, err)
    issues = []
    intention = INTENTION_BY_ZH.get(rec.task.strip())
    if intention is None:
        issues.append(ScenarioIssue(str(path), raw.line, "task", f"unknown intention {rec.task!r}"))
    personality = PERSONALITY_BY_ZH.get(rec.main_cha.strip())
    if personality is None:
        issues.append(ScenarioIssue(str(path), raw.line, "main_cha", f"unknown personality {rec.main_cha!r}; "
                                    f"expected one of {sorted(PERSONALITY_BY_ZH)}"))
    if issues:
        return None, issues
    scene = _HIDDEN_THEME_TRAILER.sub("", rec.scene).strip()
    return Scenario(id=rec.id, persona=rec.player, situation=scene, personality=personality,
                    hidden_intention=intention, opening_line=rec.first_talk,
                    language=detect_language(rec.player + scene), traits=tuple(rec.cha_group),
                    source=f"{path.name}:{raw.line}"), []


def _parse_file(path: str | Path) -> tuple[list[Scenario], list[ScenarioIssue]]:
    path = Path(path)
    raws, issues = _read_raw(path)
    if not raws and not issues:
        return [], [ScenarioIssue(str(path), 0, None, "empty file: no scenarios")]
    scenarios: list[Scenario] = []
    first_line_of_id: dict[str, int] = {}
    profile_format = bool(raws) and _is_profile(raws[0].obj)
    for raw in raws:
        if not isinstance(raw.obj, dict):
            issues.append(ScenarioIssue(str(path), raw.line, None,
                                        f"wrong type: expected an object, got {type(raw.obj).__name__}"))
            continue
        scenario, found = (_convert_profile if profile_format else _convert_ours)(path, raw)
        issues.extend(found)
        if scenario is None:
            continue
        if scenario.id in first_line_of_id:
            issues.append(ScenarioIssue(str(path), raw.field_lines.get("id", raw.line), "id",
                                        f"duplicate id {scenario.id!r} "
                                        f"(first on line {first_line_of_id[scenario.id]})"))
            continue
        first_line_of_id[scenario.id] = raw.line
        scenarios.append(scenario)
    return scenarios, issues


def validate_file(path: str | Path) -> list[ScenarioIssue]:
    """Check a scenario file (our JSONL/YAML or RLVER/SAGE profiles) without raising on content.

    Returns every issue found, each naming file, line and field: bad JSON/YAML
    (checking stops at the first unparseable JSONL line), missing or empty field,
    wrong type, unknown intention or personality, language mismatch, empty file,
    duplicate id. Raises :class:`ScenarioFileError` with ``unreadable=True`` when the
    file cannot be read or is not UTF-8.
    """
    return _parse_file(path)[1]


_MAX_PRINTED_ISSUES = 50


def validate_command(path: str | Path) -> int:
    """``rlver scenarios validate FILE``: print a readable verdict.

    Returns the exit code: 0 valid, 1 invalid (each issue printed as
    ``file:line: field: message``), 2 unreadable.
    """
    try:
        scenarios, issues = _parse_file(path)
    except ScenarioFileError as err:
        print(err.issues[0])
        return 2
    if issues:
        for issue in issues[:_MAX_PRINTED_ISSUES]:
            print(issue)
        if len(issues) > _MAX_PRINTED_ISSUES:
            print(f"... and {len(issues) - _MAX_PRINTED_ISSUES} more")
        print(f"{path}: INVALID ({len(issues)} problem(s))")
        return 1
    languages = sorted({s.language for s in scenarios})
    print(f"{path}: OK: {len(scenarios)} scenarios, language {'/'.join(languages)}, "
          f"{len({s.hidden_intention for s in scenarios})} hidden intentions, "
          f"{len({s.personality for s in scenarios})} personality types")
    return 0


def load_scenarios(spec: str | Path) -> list[Scenario]:
    """Load scenarios from ``builtin:train`` / ``builtin:test`` / ``builtin:all`` (the
    shipped English set and its fixed persona-disjoint split) or a file path (format
    detected). Raises :class:`ScenarioFileError` listing every issue, ``ValueError`` on
    an unknown ``builtin:`` name."""
    spec = str(spec)
    if spec.startswith("builtin:"):
        which = spec.removeprefix("builtin:")
        if which not in {"train", "test", "all"}:
            raise ValueError(f"unknown builtin scenario set {spec!r}; use builtin:train, builtin:test or builtin:all")
        scenarios = load_scenarios(BUILTIN_FILE)
        return scenarios if which == "all" else [s for s in scenarios if s.split == which]
    scenarios, issues = _parse_file(spec)
    if issues:
        raise ScenarioFileError(issues)
    return scenarios


# --------------------------------------------------------------------------- splits and similarity


def persona_disjoint_split(scenarios: Sequence[Scenario], test_fraction: float = 1 / 3,
                           seed: int = 0) -> tuple[list[Scenario], list[Scenario]]:
    """Split into ``(train, test)`` so that no persona card (:attr:`Scenario.persona_key`)
    is in both. ``round(test_fraction * n_personas)`` personas (at least one, at most
    all but one), chosen by a ``seed``-ed shuffle, go to test; input order is kept.
    Raises ``ValueError`` for a fraction outside (0, 1) or fewer than two personas."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    personas = sorted({s.persona_key for s in scenarios})
    if len(personas) < 2:
        raise ValueError(f"need at least two distinct personas to split, got {len(personas)}")
    random.Random(seed).shuffle(personas)
    n_test = min(len(personas) - 1, max(1, round(test_fraction * len(personas))))
    test_personas = set(personas[:n_test])
    return ([s for s in scenarios if s.persona_key not in test_personas],
            [s for s in scenarios if s.persona_key in test_personas])


@lru_cache(maxsize=4096)
def _trigrams(scenario: Scenario) -> frozenset[str]:
    text = " ".join(re.sub(r"[^\w]+", " ", (scenario.persona + " " + scenario.situation_text).casefold()).split())
    return frozenset(text[i:i + 3] for i in range(max(1, len(text) - 2)))


def scenario_similarity(a: Scenario, b: Scenario) -> float:
    """Jaccard similarity in [0, 1] of the character trigrams of the normalised
    (case-folded, punctuation-free, whitespace-collapsed) persona + situation texts."""
    ta, tb = _trigrams(a), _trigrams(b)
    return len(ta & tb) / len(ta | tb)


# --------------------------------------------------------------------------- generation

_GEN_PROMPTS = {
    "en": {
        "system": "You write scenarios for training empathetic chat assistants. A scenario describes "
                  "one person who will talk to an assistant about a problem in their life. Write "
                  "original, concrete, believable text. Answer with one JSON object only.",
        "user": "Write a new scenario.\nPersonality type: {personality}\nHidden intention (what the person "
                "secretly wants from the conversation and never says outright): {intention}\n"
                "Fields: persona (a card of 2-4 sentences: name, age, job, habits, way of speaking); "
                "situation with background, conflict, current_state (1-3 sentences each), mood_high, "
                "mood_low, mood_normal (how they talk at that mood, one sentence each), reply_fit and "
                "reply_miss (how they react to replies that meet or miss the hidden intention, one "
                "sentence each); opening_line (their first message, in their own voice, without "
                "revealing the hidden intention). Make the person different from these: {avoid}.\n"
                "Write in English.",
    },
    "zh": {
        "system": "你为训练共情对话助手编写剧本。剧本描述一位将与助手谈论自己生活中某个问题的人。"
                  "文字要原创、具体、可信。只输出一个JSON对象。",
        "user": "写一个新剧本。\n性格类型：{personality}\n"
                "隐藏主题（此人希望从对话中得到、但从不直接说出的东西）：{intention}\n"
                "字段：persona（2-4句的人物卡：姓名、年龄、职业、习惯、说话方式）；situation，包含 background、"
                "conflict、current_state（各1-3句），mood_high、mood_low、mood_normal（此情绪下如何说话，各一句），"
                "reply_fit 和 reply_miss（对贴合或偏离隐藏主题的回复如何反应，各一句）；opening_line（此人的第一句话，"
                "用自己的口吻，不透露隐藏主题）。人物要与这些不同：{avoid}。\n用中文写。",
    },
}

GENERATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "persona": {"type": "string"},
        "situation": {
            "type": "object",
            "properties": {name: {"type": "string"} for name in Situation.model_fields},
            "required": list(Situation.model_fields),
            "additionalProperties": False,
        },
        "opening_line": {"type": "string"},
    },
    "required": ["persona", "situation", "opening_line"],
    "additionalProperties": False,
}


def _generation_prompt(intention: str, personality: str, language: Language,
                       avoid: Sequence[Scenario]) -> list[dict[str, str]]:
    texts = _GEN_PROMPTS[language]
    names = "; ".join(s.persona.split(".")[0][:60] for s in avoid[-8:]) or "-"
    user = texts["user"].format(personality=getattr(PERSONALITY_TYPES[personality], language),
                                intention=getattr(HIDDEN_INTENTIONS[intention], language), avoid=names)
    return [{"role": "system", "content": texts["system"]}, {"role": "user", "content": user}]


def _parse_generated(text: str, intention: str, personality: str, language: Language) -> Scenario | None:
    try:
        obj = json.loads(text.strip())
        rec = _ScenarioRecord.model_validate(obj | {"id": "pending", "personality": personality,
                                                    "hidden_intention": intention})
    except (json.JSONDecodeError, TypeError, ValidationError) as err:
        log.info("dropped generated scenario: %s", str(err).splitlines()[0])
        return None
    if detect_language(rec.persona + " " + rec.situation.background) != language:
        log.info("dropped generated scenario: not written in %s", language)
        return None
    digest = hashlib.sha1((rec.persona + rec.situation.model_dump_json()).encode()).hexdigest()[:12]
    return Scenario(id=f"gen-{digest}", persona=rec.persona, situation=rec.situation, personality=personality,
                    hidden_intention=intention, opening_line=rec.opening_line, language=language,
                    source="generated")


def generate_scenarios(backend: ChatBackend, n: int, *, seed: int, existing: Iterable[Scenario] = (),
                       language: Language = "en", intentions: Sequence[str] | None = None,
                       personalities: Sequence[str] | None = None, max_rounds: int = 3,
                       sampling: SamplingParams | None = None,
                       duplicate_threshold: float = DUPLICATE_THRESHOLD) -> list[Scenario]:
    """Ask ``backend`` (one batched, JSON-schema constrained call per round) for ``n`` new scenarios.

    Targets cycle through the requested intention × personality cells (all 24 by
    default) in a ``seed``-ed order. Each output is parsed and validated; invalid ones
    (bad JSON, missing/empty fields, wrong language) are dropped, and so are
    duplicates (:func:`scenario_similarity` >= ``duplicate_threshold``) of ``existing``
    or of each other. Unfilled targets are asked again, for at most ``max_rounds``
    rounds; the result may then hold fewer than ``n`` (logged). Raises ``ValueError``
    on unknown intentions/personalities or ``n < 0``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    intentions = list(intentions or HIDDEN_INTENTIONS)
    personalities = list(personalities or PERSONALITY_TYPES)
    unknown = [x for x in intentions if x not in HIDDEN_INTENTIONS] + \
              [x for x in personalities if x not in PERSONALITY_TYPES]
    if unknown:
        raise ValueError(f"unknown intention/personality keys: {unknown}")
    cells = list(itertools.product(intentions, personalities))
    rng = random.Random(seed)
    rng.shuffle(cells)
    targets = [cells[i % len(cells)] for i in range(n)]
    sampling = sampling or SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=768)
    pool = list(existing)
    accepted: list[Scenario] = []

    def accept(text: str, target: tuple[str, str]) -> Scenario | None:
        scenario = _parse_generated(text, *target, language)
        if scenario is not None and any(scenario_similarity(scenario, other) >= duplicate_threshold
                                        for other in itertools.chain(pool, accepted)):
            log.info("dropped generated scenario %s: duplicate", scenario.id)
            return None
        if scenario is not None:
            accepted.append(scenario)
        return scenario

    if max_rounds > 0:
        results, _ = structured_batch(
            backend, targets, GENERATION_SCHEMA, accept, replace(sampling, seed=seed), max_retries=max_rounds - 1,
            render=lambda target: _generation_prompt(*target, language, pool + accepted))
        targets = [target for target, result in zip(targets, results) if result.value is None]
    if targets:
        log.warning("generate_scenarios: %d of %d scenarios not produced after %d rounds",
                    len(targets), n, max_rounds)
    return accepted


# --------------------------------------------------------------------------- a run's split


@dataclass(frozen=True)
class RunSplit:
    """A run's scenario sets: no persona card (:attr:`Scenario.persona_key`) is in both
    ``train`` and ``test``; ``dropped`` lists the training scenarios left out because
    their persona is in ``test`` (before the size limits)."""

    train: list[Scenario]
    test: list[Scenario]
    dropped: list[Scenario]


def split_for_run(train: Sequence[Scenario], test: Sequence[Scenario], section: ScenarioConfig,
                  *, seed: int = 0) -> RunSplit:
    """The persona-disjoint train/test sets of a run (what the scenarios stage writes).

    ``section`` is the run's ``scenarios`` config (:class:`rlver_lib.config.ScenarioConfig`:
    ``train``, ``test``, ``n_train_scenarios``, ``n_test_scenarios``). When ``section.train ==
    section.test`` (one source), ``train`` is split by persona with
    :func:`persona_disjoint_split` (``seed``) and ``test`` is not used; otherwise every
    training scenario whose persona is in ``test`` is dropped (the public RLVER/SAGE sets
    share 54 of their 100 test personas with training). The counts apply last. Input
    order is kept. Raises ``ValueError`` as :func:`persona_disjoint_split` does.
    """
    if section.train == section.test:
        train, test = persona_disjoint_split(train, seed=seed)
    test_personas = {s.persona_key for s in test}
    kept = [s for s in train if s.persona_key not in test_personas]
    dropped = [s for s in train if s.persona_key in test_personas]
    return RunSplit(kept[: section.n_train_scenarios], list(test)[: section.n_test_scenarios], dropped)
