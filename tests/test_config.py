"""The run config (rlver_lib.config): the dotted getter beside the overrides' setter; the judge's and
the strategy annotator's sections, and old run folders' config.yaml."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rlver_lib.config import PAPER_AXES, AnnotatorConfig, ConfigError, JudgeConfig, get_dotted
from rlver_lib.params import build_config, dump_config, load_config, load_run_config

ROOT = Path(__file__).resolve().parents[1]


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
    with pytest.raises(ConfigError, match=r"evaluation\.n_scenarios: .*\(removed: use scenarios\.n_test_scenarios\)"):
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
    with pytest.raises(ConfigError, match=r"^--set analysis\.annotator\.modle=x: .*did you mean model\?"):
        load_config(params, ["analysis.annotator.modle=x"])  # a section that may be None
    with pytest.raises(ConfigError, match=r"^--set training\.steps=-1: training\.steps: .*greater than"):
        load_config(params, ["training.steps=-1"])
    removed = r"^--set evaluation\.n_scenarios=3: .*\(removed: use scenarios\.n_test_scenarios\)$"
    with pytest.raises(ConfigError, match=removed):
        load_config(params, ["evaluation.n_scenarios=3"])


def test_a_section_check_that_an_override_breaks_names_the_file_and_the_override(tmp_path):
    """A check of a whole section (``evaluation``'s SAGE protocol) or of the whole config
    (the learner's refusals) reports at the section, not at the key: the override set
    inside it is named beside the file, which alone is not to blame."""
    params = tmp_path / "x.yaml"
    params.write_text("evaluation:\n  max_turns: 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(params))} with --set evaluation\.protocol=sage: "
                                          r"evaluation: .*protocol 'sage' fixes"):
        load_config(params, ["evaluation.protocol=sage"])
    # the whole config's check cannot tell which override broke it: every one is named
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(params))} with --set policy\.lora\.dropout=0\.1, "
                                          r"--set run_name=r: \(top level\): .*dropout"):
        load_config(params, ["policy.lora.dropout=0.1", "run_name=r"])
    params.write_text("evaluation:\n  max_turns: 3\n  protocol: sage\n")  # the file's own: the file alone
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(params))}: evaluation: "):
        load_config(params, ["training.steps=2"])


def test_an_unknown_key_of_the_params_file_keeps_naming_the_file(tmp_path):
    params = tmp_path / "x.yaml"
    params.write_text("training:\n  stepz: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(params, ["training.steps=3"])  # a good override beside the file's bad key
    assert str(info.value).startswith(f"{params}: training.stepz: unknown key 'stepz' in training "
                                      "(did you mean steps?); valid keys: algorithm, ")
    params.write_text("trainng:\n  steps: 2\n")  # a misspelled section
    with pytest.raises(ConfigError, match=r": trainng: unknown key 'trainng' at the top level \(did you mean training"):
        load_config(params)


def test_a_judge_section_that_sets_a_field_it_never_used_is_refused(tmp_path):
    params = tmp_path / "x.yaml"
    params.write_text("evaluation:\n  judge:\n    initial_emotion: 30\n")
    with pytest.raises(ConfigError) as info:
        load_config(params)
    assert str(info.value) == (f"{params}: evaluation.judge.initial_emotion: unknown key 'initial_emotion' in "
                               "evaluation.judge (the judge never used it: the benchmark starts at "
                               "evaluation.initial_emotion)")
    with pytest.raises(ConfigError, match=r"^--set evaluation\.judge\.initial_emotion=30: unknown key "
                                          r"'initial_emotion' in evaluation\.judge \(.*evaluation\.initial_emotion\)$"):
        build_config({}, ["evaluation.judge.initial_emotion=30"])
    # the strategy annotator is an endpoint, no simulated user: no difficulty, start emotion or appraisal
    for key in ("difficulty", "initial_emotion", "appraisal", "expected_center"):
        with pytest.raises(ConfigError, match=rf"analysis\.annotator\.{key}: .*the strategy annotator never used it"):
            build_config({"analysis": {"annotator": {key: None}}})
    assert "initial_emotion" not in JudgeConfig.model_fields
    assert not {"difficulty", "initial_emotion", "appraisal"} & set(AnnotatorConfig.model_fields)


def test_a_params_file_naming_a_renamed_stage_is_told_the_new_name():
    with pytest.raises(ConfigError, match=r"stages: .*stage 'evaluate' is now called 'trained'"):
        build_config({"stages": ["scenarios", "baseline", "train", "evaluate"]})


def _old_run_config(cfg) -> dict:
    """``cfg`` as an earlier version saved it: the judge and the strategy annotator were whole
    simulator configs, so their dumps carried the start emotion and the user's settings."""
    data = cfg.model_dump(mode="json")
    data["evaluation"]["judge"]["initial_emotion"] = 50
    data["stages"] = [{"trained": "evaluate"}.get(name, name) for name in data["stages"]]
    data["analysis"]["annotator"].update(difficulty="moderate", initial_emotion=50, appraisal="first_person",
                                         appraisal_chars=200, message_chars=400, expected_center=0.83)
    return data


def test_ppo_keys_moved_to_their_section_are_refused_naming_it_and_read_from_old_runs(tmp_path):
    with pytest.raises(ConfigError, match=r"training\.vf_coef: .*\(removed: use training\.ppo\.vf_coef\)"):
        build_config({"training": {"vf_coef": 0.1}})
    with pytest.raises(ConfigError, match=r"^--set training\.gamma=0\.9: .*\(removed: use training\.ppo\.gamma\)"):
        load_config(Path(__file__).resolve().parents[1] / "params" / "laptop-ppo.yaml", ["training.gamma=0.9"])
    cfg = build_config({"run_name": "old-ppo", "output_root": str(tmp_path), "training": {
        "algorithm": "ppo", "ppo": {"value_learning_rate": 3e-4, "value_clip_eps": 0.1, "vf_coef": 0.25,
                                    "gamma": 0.9, "lam": 0.8, "whiten_advantages": False}}})
    data = cfg.model_dump(mode="json")
    ppo = data["training"].pop("ppo")  # how runs before the ppo section saved it (its six keys, flat)
    data["training"].update({k: ppo[k] for k in ("value_learning_rate", "value_clip_eps", "vf_coef", "gamma", "lam",
                                                 "whiten_advantages")})
    assert "ppo" not in data["training"] and data["training"]["lam"] == 0.8
    old = tmp_path / "old-ppo" / "config.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    assert load_run_config(old) == cfg
    assert load_run_config(old).training.ppo.value_learning_rate == 3e-4


def test_an_old_runs_config_yaml_with_unused_keys_is_still_read(tmp_path):
    from rlver_lib.analysis.runs import run_config
    from rlver_lib.pipeline.notebook import open_run
    from rlver_lib.pipeline.run import prepare_run_dir

    cfg = build_config({"run_name": "old", "output_root": str(tmp_path),
                        "analysis": {"annotator": {"backend": "rule"}}})
    old = tmp_path / "old" / "config.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(_old_run_config(cfg), sort_keys=False), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"evaluation\.judge\.initial_emotion"):
        load_config(old)  # as a params file it is refused ...
    assert load_run_config(old) == cfg  # ... as a run's saved config it reads as it ran
    assert run_config(old.parent) == cfg
    assert open_run(old, old.parent)[0] == cfg
    prepare_run_dir(cfg)  # resuming the old run: the same experiment, its config.yaml rewritten
    assert old.read_text(encoding="utf-8") == dump_config(cfg)
    old.write_text(yaml.safe_dump(_old_run_config(cfg.model_copy(update={"seed": 1}))), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"different config \(changed: seed\)"):
        prepare_run_dir(cfg)


def test_a_run_saved_before_a_key_existed_reads_at_the_value_it_ran_with(tmp_path):
    """params.ADDED_KEYS: a quickstart folder saved before ``speculative`` and
    ``capability.batch_size`` existed reads as it ran (no speculation, capability prompts
    8 at a time); resuming it with today's params names the one key whose default moved."""
    from rlver_lib.pipeline.run import prepare_run_dir

    cfg = load_config(ROOT / "params" / "quickstart.yaml", {"output_root": str(tmp_path)})
    saved = cfg.model_dump(mode="json")
    del saved["capability"]["batch_size"]
    for section in (saved["simulator"], saved["evaluation"]["judge"]):
        del section["speculative"]
    old = cfg.run_dir / "config.yaml"
    old.parent.mkdir(parents=True)
    old.write_text(yaml.safe_dump(saved), encoding="utf-8")
    ran = load_run_config(old)
    assert (ran.capability.batch_size, ran.simulator.speculative, ran.evaluation.judge.speculative) == (
        8, "none", "none")
    with pytest.raises(ConfigError, match=r"different config \(changed: capability\.batch_size\)"):
        prepare_run_dir(cfg)
    as_it_ran = cfg.model_copy(update={"capability": cfg.capability.model_copy(update={"batch_size": 8})})
    prepare_run_dir(as_it_ran)  # resumes, its config.yaml rewritten with today's keys
    assert load_run_config(old) == as_it_ran


# the quickstart judge as it was built before the endpoint config: evaluation.judge
# dumped, its seed popped, rebuilt as a SimulatorConfig at the benchmark's start emotion
# (with the quickstart's later expected-value appraisal settings)
QUICKSTART_JUDGE_BEFORE = {
    "backend": "llamacpp", "model": "embedded:qwen2.5-coder-1.5b-instruct-q4km", "base_url": None,
    "api_key_env": "OPENAI_API_KEY", "difficulty": "moderate", "initial_emotion": 40, "temperature": 0.7,
    "max_new_tokens": 192, "max_retries": 1, "timeout_s": 120.0, "concurrency": 8, "n_threads": None, "n_ctx": 2048,
    "appraisal_chars": 200, "message_chars": 400, "appraisal": "expected",
    "expected_questions": ["on_situation", "understood"], "expected_center": 0.67, "expected_scale": 80.0,
    "expected_answer_order": "yes_no", "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
}


# The keys a run folder saved before each idea of the config took one convention (issue 33,
# December 2026), written out by hand (not from params.RETIRED_KEYS): {old: today's}.
RENAMED_BEFORE_ONE_CONVENTION = {
    "scenarios.limit_train": "scenarios.n_train_scenarios", "scenarios.limit_test": "scenarios.n_test_scenarios",
    "evaluation.bootstrap_samples": "evaluation.n_boot", "analysis.judge": "analysis.annotator",
    "analysis.judge_sample": "analysis.n_annotated_replies", "analysis.judge_seeds": "analysis.n_self_agreement_runs",
    "analysis.self_agreement_sample": "analysis.n_self_agreement_replies",
    "analysis.judge_validation_n": "analysis.n_annotator_validation_items",
    "analysis.probe_scenarios": "analysis.n_probe_scenarios",
    "analysis.sycophancy_samples": "analysis.n_sycophancy_replies",
    "analysis.consistency_sample": "analysis.n_consistency_turns",
    "capability.humaneval_n": "capability.n_humaneval_problems", "capability.math_n": "capability.n_math_items",
}
# ... and the bools that switched a part off, which every such run saved
OFF_SWITCHES_BEFORE_ONE_CONVENTION = ("analysis.strategy_judge", "analysis.hacking_probes", "capability.enabled",
                                      "capability.lm_eval.enabled")


def _saved_before_one_convention(cfg, *, switched_on: bool) -> dict:
    """``cfg`` as a run folder saved it before: the old names, and each part's bool switch."""
    data = cfg.model_dump(mode="json")
    for old, new in RENAMED_BEFORE_ONE_CONVENTION.items():
        *section, name = new.split(".")
        value = get_dotted(data, ".".join(section)).pop(name)
        *section, name = old.split(".")
        get_dotted(data, ".".join(section))[name] = value
    for key in OFF_SWITCHES_BEFORE_ONE_CONVENTION:
        *section, name = key.split(".")
        get_dotted(data, ".".join(section))[name] = switched_on
    return data


def test_an_old_runs_config_yaml_is_read_with_todays_keys(tmp_path):
    cfg = build_config({"run_name": "old", "output_root": str(tmp_path), "scenarios": {"n_train_scenarios": 4},
                        "evaluation": {"n_boot": 50},
                        "analysis": {"annotator": {"backend": "rule"}, "n_annotated_replies": 5,
                                     "n_self_agreement_runs": 3, "n_annotator_validation_items": 0,
                                     "n_probe_scenarios": 2, "n_sycophancy_replies": 1, "n_consistency_turns": 0},
                        "capability": {"n_humaneval_problems": 3, "n_math_items": 4,
                                       "lm_eval": {"tasks": ["gsm8k"]}}})
    old = tmp_path / "old" / "config.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(_saved_before_one_convention(cfg, switched_on=True)), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"analysis\.judge_sample: .*\(removed: use analysis\.n_annotated_replies\)"):
        load_config(old)  # as a params file it is refused, naming the new key ...
    assert load_run_config(old) == cfg  # ... as a run's saved config it reads as it ran
    # a part switched off by its bool reads as its counts at 0, whatever counts it saved beside it
    old.write_text(yaml.safe_dump(_saved_before_one_convention(cfg, switched_on=False)), encoding="utf-8")
    off = build_config(cfg.model_dump(), {
        "analysis.n_annotated_replies": 0, "analysis.n_sycophancy_replies": 0, "analysis.n_probe_scenarios": 0,
        "capability.n_humaneval_problems": 0, "capability.n_math_items": 0, "capability.lm_eval.tasks": []})
    assert load_run_config(old) == off


def test_the_quickstart_judge_is_built_from_its_config_as_before(monkeypatch):
    from rlver_lib import models
    from rlver_lib.evaluation.judge import Judge
    from rlver_lib.simulator import UserSimulator

    backend = SimpleNamespace(next_token_logprobs=None)  # the expected-value appraisal needs one
    monkeypatch.setattr(models, "make_simulator_backend", lambda sim_cfg, seed: backend)
    cfg = load_config(ROOT / "params" / "quickstart.yaml")
    judge = Judge.from_config(cfg.evaluation, cfg.seed).simulator
    assert isinstance(judge, UserSimulator) and judge.backend is backend and judge.seed == cfg.seed
    assert judge.cfg is cfg.evaluation.judge  # its own config, not a rebuilt copy
    # every field as before, less the start emotion the judge never read (the opening prompt has
    # none), plus the speculation added since (off: the judge decodes as it did), and one
    # server slot where it had 8 (params/quickstart.yaml says why)
    before = {k: v for k, v in QUICKSTART_JUDGE_BEFORE.items() if k != "initial_emotion"} | {
        "speculative": "none", "concurrency": 1}
    assert judge.cfg.model_dump(exclude={"seed"}) == before
    assert cfg.evaluation.initial_emotion == QUICKSTART_JUDGE_BEFORE["initial_emotion"]
