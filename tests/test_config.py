"""The run config (rlver_lib.config): the dotted getter beside the overrides' setter."""

from __future__ import annotations

import pytest

from rlver_lib.config import PAPER_AXES, ConfigError, build_config, get_dotted


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
