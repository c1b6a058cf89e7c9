"""The SAGE-faithful appraisal texts (issue 21, point 3): the same placeholders and output
fields as the first-person texts, SAGE's five-value scale, the misfit-first order, the
natural-language guard, and a rubric per difficulty in both languages."""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

import pytest

PROMPTS = Path(__file__).resolve().parents[1] / "rlver_lib" / "prompts"
LANGUAGES = ("en", "zh")
DIFFICULTIES = ("easy", "moderate", "hard")
FIELDS = ("reply_meaning", "intention_fit", "inner_reaction", "change")


def _placeholders(text: str) -> set[str]:
    return {m.group("named") or m.group("braced") for m in Template.pattern.finditer(text)
            if m.group("named") or m.group("braced")}


@pytest.mark.parametrize("language", LANGUAGES)
def test_sage_appraisal_text_keeps_the_placeholders_and_fields_of_the_first_person_one(language):
    sage = (PROMPTS / f"sim_appraise_sage_{language}.txt").read_text(encoding="utf-8")
    first = (PROMPTS / f"sim_appraise_{language}.txt").read_text(encoding="utf-8")
    assert _placeholders(sage) == _placeholders(first) == {"transcript", "emotion", "mood", "mood_meaning",
                                                           "guidance"}
    filled = Template(sage).substitute(transcript="T", emotion="40", mood="B", mood_meaning="M", guidance="G")
    assert "$" not in filled
    # the output fields, named in the order they are to be written
    positions = [filled.index(f'"{name}"') for name in FIELDS]
    assert positions == sorted(positions)
    # SAGE's scale, and nothing of the old -10..10 integer range
    for value in ("-10", "-5", "0", "5", "10"):
        assert re.search(rf"(?<![\d-]){re.escape(value)}(?!\d)", filled), value
    body = re.sub(r"^\d\. ", "", filled, flags=re.MULTILINE)  # the analysis steps' numbers
    assert set(re.findall(r"-?\d+", body)) <= {"-10", "-5", "0", "5", "10", "100", "40"}


def test_sage_appraisal_looks_for_the_misfit_first_in_the_third_person():
    en = (PROMPTS / "sim_appraise_sage_en.txt").read_text(encoding="utf-8")
    assert en.index("First look for what in the latest reply does not fit") < en.index("Then look for what fits")
    assert "third person" in en and "their hidden intention" in en
    zh = (PROMPTS / "sim_appraise_sage_zh.txt").read_text(encoding="utf-8")
    assert zh.index("先找回复中不符合") < zh.index("再找符合的地方")
    assert "第三人称" in zh and "隐藏意图" in zh
    fit_en = next(line for line in en.splitlines() if line.startswith('- "intention_fit"'))
    assert fit_en.index("does not fit") < fit_en.index("then what fits")
    fit_zh = next(line for line in zh.splitlines() if line.startswith('- "intention_fit"'))
    assert fit_zh.index("不符合") < fit_zh.index("再写符合")


@pytest.mark.parametrize("language", LANGUAGES)
def test_sage_appraisal_keeps_the_natural_language_guard(language):
    text = (PROMPTS / f"sim_appraise_sage_{language}.txt").read_text(encoding="utf-8")
    guard = next(line for line in text.splitlines() if ("gibberish" in line or "乱码" in line))
    assert "-10" in guard
    assert ("scoring system" in guard) if language == "en" else ("评分系统" in guard)


@pytest.mark.parametrize("language", LANGUAGES)
@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_sage_difficulty_rubric_uses_the_five_values_only(language, difficulty):
    text = (PROMPTS / f"sim_difficulty_{difficulty}_sage_{language}.txt").read_text(encoding="utf-8")
    assert not _placeholders(text)
    values = re.findall(r"^- (-?\d+)[:：]", text, flags=re.MULTILINE)
    assert values == ["10", "5", "0", "-5", "-10"]


@pytest.mark.parametrize("language", LANGUAGES)
def test_a_polite_miss_is_minus_five_at_moderate_and_hard(language):
    polite = "polite" if language == "en" else "礼貌"
    for difficulty in ("moderate", "hard"):
        text = (PROMPTS / f"sim_difficulty_{difficulty}_sage_{language}.txt").read_text(encoding="utf-8")
        minus_five = next(line for line in text.splitlines() if line.startswith("- -5"))
        assert polite in minus_five, (difficulty, minus_five)
