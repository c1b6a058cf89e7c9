"""The run config (rlver_lib.config): the dotted getter beside the overrides' setter."""

from __future__ import annotations

import pytest

from rlver_lib.config import PAPER_AXES, ConfigError, build_config, get_dotted, load_config


def test_get_dotted_reads_what_an_override_sets():
    cfg = build_config({}, ["training.learning_rate=3e-5", "policy.think=true"])
    assert get_dotted(cfg, "training.learning_rate") == pytest.approx(3e-5)
    assert get_dotted(cfg, "policy.think") is True
    assert get_dotted(cfg.model_dump(), "training.learning_rate") == pytest.approx(3e-5)
    assert [get_dotted(cfg, axis) is not None for axis in PAPER_AXES] == [True] * 3


def test_get_dotted_names_the_missing_key():
    cfg = build_config({})
    with pytest.raises(ConfigError, match=r"training\.nope: no 'nope'"):
        get_dotted(cfg, "training.nope")


def test_a_removed_key_names_the_key_that_replaced_it():
    with pytest.raises(ConfigError, match=r"evaluation\.n_scenarios: .*\(removed: use scenarios\.limit_test\)"):
        build_config({"evaluation": {"n_scenarios": 3}})


def test_an_unknown_override_key_names_the_override_and_the_sections_keys(tmp_path):
    params = tmp_path / "x.yaml"
    params.write_text("training:\n  steps: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(params, ["training.stepz=1"])
    message = str(info.value)
    assert message.startswith("--set training.stepz=1: unknown key 'stepz' in training")
    assert "did you mean steps?" in message and "valid keys: algorithm, steps," in message
    assert "Extra inputs" not in message and str(params) not in message  # the file is not to blame
    with pytest.raises(ConfigError, match=r"^--set nosuch\.key=1: unknown key 'nosuch' at the top level; "
                                          r"valid keys: run_name,"):
        load_config(params, ["nosuch.key=1"])
    with pytest.raises(ConfigError, match=r"^--set analysis\.judge\.modle=x: .*did you mean model\?"):
        load_config(params, ["analysis.judge.modle=x"])  # a section that may be None
    with pytest.raises(ConfigError, match=r"^--set training\.steps=-1: training\.steps: .*greater than"):
        load_config(params, ["training.steps=-1"])
    removed = r"^--set evaluation\.n_scenarios=3: .*\(removed: use scenarios\.limit_test\)$"
    with pytest.raises(ConfigError, match=removed):
        load_config(params, ["evaluation.n_scenarios=3"])


def test_an_unknown_key_of_the_params_file_keeps_naming_the_file(tmp_path):
    params = tmp_path / "x.yaml"
    params.write_text("training:\n  stepz: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(params, ["training.steps=3"])  # a good override beside the file's bad key
    assert str(info.value) == f"{params}: training.stepz: Extra inputs are not permitted"
