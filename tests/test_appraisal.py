"""The appraisal modes (:mod:`rlver_lib.appraisal`): one class per mode, one registry,
one look-up by name, and no other place that reads the name."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import get_args

import pytest
from source_support import literal_comparisons

from rlver_lib import appraisal, user_prompts
from rlver_lib.config import JudgeConfig, SimulatorConfig, UserModelConfig


def test_the_registry_has_one_class_per_configured_mode_and_the_lookup_reads_the_name():
    names = set(get_args(UserModelConfig.model_fields["appraisal"].annotation))
    assert set(appraisal.APPRAISAL_MODES) == names
    for name, mode in appraisal.APPRAISAL_MODES.items():
        assert issubclass(mode, appraisal.AppraisalMode) and mode.name == name
        made = appraisal.appraisal_mode(name)
        assert type(made) is mode and made is not appraisal.appraisal_mode(name)  # a fresh one each time
    assert isinstance(appraisal.appraisal_mode("sage"), appraisal.SageMode)


def test_an_unknown_mode_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="unknown appraisal mode 'third_person'") as err:
        appraisal.appraisal_mode("third_person")
    for name in appraisal.APPRAISAL_MODES:
        assert name in str(err.value)


def test_no_library_module_compares_an_appraisal_to_a_mode_name():
    """The mode is decided in one place (``appraisal_mode``): nothing compares an
    appraisal value (``cfg.appraisal``, ``mode``, a description's ``"appraisal"``) with
    ``"sage"``, ``"expected"``... (``protocol == "sage"`` is another setting)."""
    found = literal_comparisons(appraisal.APPRAISAL_MODES, subject=r"appraisal|\bmode\b")
    assert found == []


def test_the_scan_finds_each_form_of_comparison(tmp_path):
    (tmp_path / "m.py").write_text(
        'if cfg.appraisal == "sage": pass\n'
        'ok = mode not in ("expected", "learned")\n'
        'x = "_sage" if fields["appraisal"] != "sage" else ""\n'
        'y = protocol == "sage"\n', encoding="utf-8")
    assert literal_comparisons(appraisal.APPRAISAL_MODES, subject=r"appraisal|\bmode\b",
                               package_dir=tmp_path) == ["m.py:1", "m.py:2", "m.py:3"]
    assert literal_comparisons({"sage"}, package_dir=tmp_path) == ["m.py:1", "m.py:3", "m.py:4"]


def test_each_mode_says_what_it_samples_and_whether_the_reply_reasons():
    cfg = SimulatorConfig(appraisal_chars=50, message_chars=300)
    modes = {name: appraisal.appraisal_mode(name) for name in appraisal.APPRAISAL_MODES}
    assert {n: m.reasoning for n, m in modes.items()} == {
        "first_person": True, "sage": True, "expected": False, "learned": False}
    assert {n: m.scale for n, m in modes.items()} == {
        "first_person": tuple(range(-10, 11)), "sage": (-10, -5, 0, 5, 10), "expected": None, "learned": None}
    assert appraisal.SCALES == {"first_person": tuple(range(-10, 11)), "sage": (-10, -5, 0, 5, 10)}
    assert {n: m.needs for n, m in modes.items()} == {
        "first_person": None, "sage": None, "expected": "next_token_logprobs", "learned": None}
    for name, mode in modes.items():
        schemas = mode.schemas(cfg)
        assert schemas == appraisal.structured_schemas(cfg.model_copy(update={"appraisal": name}))
        assert ("reasoning" in schemas["reply"]["properties"]) == mode.reasoning
        assert ("appraise" in schemas) == (mode.scale is not None)
        if mode.scale is not None:
            assert schemas["appraise"] == appraisal.appraisal_schema(50, name)
            assert schemas["appraise"]["properties"]["change"]["enum"] == list(mode.scale)
    with pytest.raises(KeyError):
        appraisal.appraisal_schema(50, "learned")


def test_a_sampled_mode_parses_on_its_own_scale():
    text = ('{"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r", "change": 3}')
    assert appraisal.appraisal_mode("first_person").parse(text)["change"] == 3
    with pytest.raises(appraisal.SimulatorError, match="not on the scale"):
        appraisal.appraisal_mode("sage").parse(text)
    assert appraisal.SageMode().appraise_files("zh", "hard") == ("sim_appraise_sage_zh.txt",
                                                                   "sim_difficulty_hard_sage_zh.txt")
    assert appraisal.FirstPersonMode().appraise_files("en", "easy") == ("sim_appraise_en.txt",
                                                                          "sim_difficulty_easy_en.txt")


def test_the_expected_fields_belong_to_the_expected_mode_alone():
    owned = {f for mode in appraisal.APPRAISAL_MODES.values() for f in mode.config_fields}
    assert owned == {f for f in UserModelConfig.model_fields if f.startswith("expected_")}
    expected, sage = appraisal.ExpectedMode(), appraisal.SageMode()
    assert expected.keeps_field("expected_center") and not sage.keeps_field("expected_center")
    assert sage.keeps_field("difficulty") and expected.keeps_field("difficulty")
    cfg = JudgeConfig(appraisal="expected", difficulty="hard")
    assert expected.identity_constants(cfg) == {"expected_difficulty_shift": 0.05, "expected_top_logprobs": 20}
    assert sage.identity_constants(cfg) == {}
    assert sage.describes({"appraisal": "sage"}) and not sage.describes({"appraisal": "expected"})
    assert not sage.describes({})  # a description without a mode names none


def test_the_expected_read_out_is_the_checklist_rule():
    cfg = SimulatorConfig(appraisal="expected", expected_center=0.5, expected_scale=20.0)
    questions = [SimpleNamespace(key="a", text="A?", guard=False), SimpleNamespace(key="g", text="G?", guard=True)]
    answers = {("a", "yes_no"): {"yes": math.log(0.75), "no": math.log(0.25)},
               ("g", "yes_no"): {"Yes": math.log(0.9), "No": math.log(0.1)}}
    record = appraisal.ExpectedMode().read_out(questions, ("yes_no",), answers, cfg)
    assert record["mode"] == "expected" and record["guard"] == pytest.approx(0.9)
    assert record["change"] == pytest.approx(appraisal.expected_change([0.75], 0.9, center=0.5, scale=20.0))
    assert [row["key"] for row in record["checklist"]] == ["a", "g"]
    assert appraisal.ExpectedMode().answer_orders(cfg.model_copy(update={"expected_answer_order": "both"})) == (
        "yes_no", "no_yes")


def test_a_mode_without_a_backend_method_it_needs_is_refused():
    with pytest.raises(TypeError, match="'expected' needs a backend with next_token_logprobs"):
        appraisal.ExpectedMode().prepare(object())
    appraisal.SageMode().prepare(object())


def test_each_mode_names_its_own_prompt_files():
    def files(name: str) -> set[str]:
        return set(user_prompts.prompt_files(SimpleNamespace(appraisal=name, difficulty="moderate")))

    shared = {"sim_system_en.txt", "sim_vocab_zh.json", "sim_reply_en.txt", "sim_opening_zh.txt"}
    learned = files("learned")
    assert shared <= learned
    assert not {n for n in learned if n.startswith(("sim_appraise_", "sim_difficulty_", "sim_checklist_"))}
    assert {"sim_appraise_en.txt", "sim_difficulty_moderate_zh.txt"} <= files("first_person")
    assert {"sim_appraise_sage_en.txt", "sim_difficulty_moderate_sage_zh.txt"} <= files("sage")
    assert {"sim_checklist_en.json", "sim_checklist_zh.json"} <= files("expected")
    assert files("first_person") - files("learned") == {"sim_appraise_en.txt", "sim_appraise_zh.txt",
                                                         "sim_difficulty_moderate_en.txt",
                                                         "sim_difficulty_moderate_zh.txt"}
