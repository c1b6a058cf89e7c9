"""Every params file validates; the eight paper recipes (value by value, the grid, their GPU
settings) and the accelerate configs are checked here and only here."""

import itertools
from pathlib import Path

import pytest
import yaml

from rlver_lib.config import ConfigError, RunConfig, get_dotted
from rlver_lib.params import (
    RETIRED_KEYS,
    build_config,
    load_config,
    load_params,
    merge_params,
    upgrade_run_config,
)
from rlver_lib.pipeline.ablate import load_grid
from rlver_lib.vllm_backend import vllm_max_lora_rank

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_DIR = ROOT / "params" / "accelerate"  # `accelerate launch --config_file` files, not run params
PAPER_PARAMS = sorted((ROOT / "params").glob("paper-*.yaml"))
PARAM_FILES = sorted(p for p in (ROOT / "params").rglob("*.yaml") if ACCELERATE_DIR not in p.parents) \
    + sorted((ROOT / "tests").glob("params_*.yaml"))


def _is_grid(path: Path) -> bool:
    return "axes" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def test_params_files_found():
    names = {p.name for p in PARAM_FILES}
    assert {"quickstart.yaml", "ablation-grid.yaml", "params_tiny.yaml"} <= names


@pytest.mark.parametrize("path", PARAM_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_params_file_validates(path):
    if _is_grid(path):
        _, cells = load_grid(path)
        assert cells
    else:
        cfg = load_config(path)
        assert cfg.run_name


@pytest.mark.parametrize("path", sorted(ACCELERATE_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    assert ClusterConfig.from_yaml_file(str(path)).num_processes >= 1


def test_unknown_key_is_rejected_by_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "params" / "quickstart.yaml").read_text() + "\nevaluation:\n  max_turnz: 3\n")
    # a duplicate top-level key replaces the section; the unknown key must be named
    with pytest.raises(ConfigError, match=r"evaluation\.max_turnz"):
        load_config(bad)


@pytest.mark.parametrize("old", sorted(RETIRED_KEYS))
def test_a_params_file_with_a_retired_key_is_refused_naming_its_new_key(old, tmp_path):
    """Each key of the migration table is refused in a params file and as an override, the
    message naming what replaced it: today's keys (each one there is, none retired)."""
    today = RETIRED_KEYS[old].read(False)  # a renamed key's value moves; a switch set off
    assert today
    for key in today:
        get_dotted(RunConfig(), key)  # raises ConfigError for a key today's config lacks
    with pytest.raises(ConfigError):
        get_dotted(RunConfig(), old)  # a retired key is no key of today's config
    params = tmp_path / "old.yaml"
    params.write_text(yaml.safe_dump(_nested({old: 1})), encoding="utf-8")
    for load in (lambda: load_config(params), lambda: build_config({}, [f"{old}=1"])):
        with pytest.raises(ConfigError) as info:
            load()
        message = str(info.value)
        assert "unknown key" in message and old in message and all(key in message for key in today), message


def test_ablation_grid_has_the_paper_axes():
    grid, cells = load_grid(ROOT / "params" / "ablation-grid.yaml")
    assert len(cells) == 2 * 2 * 2
    combos = {(c.config.training.algorithm, c.config.policy.think, c.config.simulator.difficulty) for c in cells}
    assert combos == {(a, t, d) for a in ("grpo", "ppo") for t in (False, True) for d in ("moderate", "hard")}
    assert len({c.config.run_name for c in cells}) == len(cells)
    assert all(Path(c.config.output_root).name == grid.name for c in cells)


def test_quickstart_stays_within_its_simulator_budget():
    """The quickstart's 15-minute budget is counted in the 1.5B simulated user's work on 2
    cores: every appraisal is the expected-value one (a prefill, no sampling), at most 28
    of them (about 8 s each when 8-16 are batched), and no sampled user reply (one-turn
    dialogues). It still shows more than plumbing: at least 6 training steps and 8 test
    dialogues in each benchmark."""
    cfg = load_config(ROOT / "params" / "quickstart.yaml")
    assert cfg.policy.model.startswith("embedded:") and cfg.simulator.model.startswith("embedded:")
    assert cfg.simulator.appraisal == cfg.evaluation.judge.appraisal == "expected"
    assert cfg.rollout.max_turns == cfg.evaluation.max_turns == 1
    test_dialogues = cfg.scenarios.n_test_scenarios * cfg.evaluation.repeats
    train_dialogues = cfg.training.steps * cfg.training.scenarios_per_step * cfg.training.group_size
    assert 2 * test_dialogues + train_dialogues <= 28
    assert cfg.training.steps >= 6 and test_dialogues >= 8
    assert cfg.stages == ["scenarios", "baseline", "train", "trained", "analysis"]


def test_quickstart_analysis_stays_within_its_annotator_budget():
    """The analysis stage's cost is the 1.5B model's annotator labels (about 7.5 s each on
    2 cores, decoding the JSON) and injection-probe appraisals: at most 20 labels and 5
    probe appraisals, counted by hand from the stage's definition (one reply per source,
    i.e. baseline, each training step and trained; each self-agreement reply once per run;
    the labelled-set items; base and trained replies to the 3 at-fault test scenarios;
    a control and 4 probes per probe scenario). Every part of the report stays on."""
    from rlver_lib.analysis.hacking import INJECTIONS, at_fault_scenarios
    from rlver_lib.scenarios import load_scenarios

    cfg = load_config(ROOT / "params" / "quickstart.yaml")
    a = cfg.analysis
    sources = 1 + cfg.training.steps + 1
    at_fault = len(at_fault_scenarios(load_scenarios(cfg.scenarios.test)))
    assert at_fault == 3
    labels = (a.n_annotated_replies * sources + a.n_self_agreement_replies * a.n_self_agreement_runs
              + a.n_annotator_validation_items + a.n_sycophancy_replies * at_fault * 2)
    probes = a.n_probe_scenarios * (1 + len(INJECTIONS["en"]))
    assert labels <= 20 and probes <= 5
    assert min(a.n_annotated_replies, a.n_self_agreement_replies, a.n_annotator_validation_items,
               a.n_probe_scenarios, a.n_sycophancy_replies) >= 1


# ------------------------------------------------------------ composed paper recipes


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _nested(flat: dict) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


# Today's eight paper recipes, as their 82-line files spelled them out before they were
# composed from params/paper/base.yaml (values copied once from those files; the dead
# keys rollout.batch_size and evaluation.math_* removed). Every key a recipe sets is here, nothing more.
PAPER_SHARED = {
    "seed": 0, "output_root": "outputs",
    "stages": ["scenarios", "baseline", "train", "trained", "analysis"],
    "policy.model": "Qwen/Qwen2.5-7B-Instruct", "policy.backend": "vllm", "policy.dtype": "bfloat16",
    "policy.temperature": 1.0, "policy.top_p": 1.0, "policy.max_context_tokens": 8192,
    "policy.format_violation": "keep_reply", "policy.gpu_memory_utilization": 0.35,
    "policy.lora.r": 64, "policy.lora.alpha": 128, "policy.lora.dropout": 0.0,
    "policy.lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "simulator.backend": "openai", "simulator.base_url": "http://localhost:8000/v1",
    "simulator.model": "simulator", "simulator.api_key_env": "OPENAI_API_KEY",
    "simulator.initial_emotion": 50, "simulator.temperature": 0.7, "simulator.max_new_tokens": 512,
    "simulator.max_retries": 3, "simulator.timeout_s": 180, "simulator.concurrency": 64,
    "scenarios.train": "data/rlver_profiles/train_profile.jsonl",
    "scenarios.test": "data/rlver_profiles/test_profile.jsonl",
    "rollout.max_turns": 8,
    "training.steps": 300, "training.scenarios_per_step": 32, "training.epochs_per_step": 1,
    "training.mini_batch_size": 8, "training.grad_accum_steps": 4, "training.learning_rate": 1e-05,
    "training.ppo.value_learning_rate": 1e-05, "training.warmup_steps": 10, "training.lr_schedule": "constant",
    "training.max_grad_norm": 1.0, "training.clip_eps": 0.2, "training.ppo.value_clip_eps": 0.2,
    "training.ppo.vf_coef": 0.5, "training.entropy_coef": 0.001, "training.kl_coef": 0.0,
    "training.ppo.gamma": 1.0, "training.ppo.lam": 1.0, "training.format_penalty": 0.0,
    "training.gradient_checkpointing": True, "training.checkpoint_every": 25, "training.keep_checkpoints": 3,
    "evaluation.initial_emotion": 40, "evaluation.max_turns": 10,
}
PAPER_SHARED.update({  # added with the analysis stage: a named strategy annotator, capability retention
    "analysis.judge.backend": "openai", "analysis.judge.base_url": "http://localhost:8000/v1",
    "analysis.judge.model": "judge", "analysis.judge.api_key_env": "OPENAI_API_KEY",
    "analysis.judge.temperature": 0.0, "analysis.judge.max_new_tokens": 256, "analysis.judge.max_retries": 3,
    "analysis.judge.timeout_s": 180, "analysis.judge.concurrency": 64, "analysis.judge_sample": 64,
    "analysis.judge_seeds": 3, "analysis.self_agreement_sample": 32, "analysis.consistency_sample": 32,
    "analysis.sycophancy_samples": 4, "capability.humaneval_n": 164, "capability.humaneval_max_new_tokens": 768,
    "capability.math_n": 42, "capability.math_max_new_tokens": 512, "capability.lm_eval.enabled": True,
    "capability.lm_eval.tasks": ["gsm8k", "minerva_math500", "humaneval_instruct"], "capability.lm_eval.limit": None,
    "capability.lm_eval.batch_size": "auto", "capability.lm_eval.apply_chat_template": True,
})
PAPER_SHARED.update({  # later fixes: RLVER's released training simulators start at 30; field caps
    # for strong judges; the benchmark's own judge, independent of the training simulator
    "simulator.initial_emotion": 30, "simulator.appraisal_chars": 1200, "simulator.message_chars": 1200,
    "evaluation.protocol": "full", "evaluation.judge.backend": "openai",
    "evaluation.judge.base_url": "http://localhost:8000/v1", "evaluation.judge.model": "simulator",
    "evaluation.judge.api_key_env": "OPENAI_API_KEY", "evaluation.judge.difficulty": "moderate",
    "evaluation.judge.temperature": 0.7, "evaluation.judge.max_new_tokens": 512, "evaluation.judge.max_retries": 3,
    "evaluation.judge.timeout_s": 180, "evaluation.judge.concurrency": 64, "evaluation.judge.appraisal_chars": 1200,
    "evaluation.judge.message_chars": 1200,
})
PAPER_SHARED.update({  # the benchmark judge on an endpoint and model of its own, not the simulator's alias
    "evaluation.judge.base_url": "http://localhost:8001/v1", "evaluation.judge.model": "sentient-judge",
})
PAPER_SHARED.update({  # vLLM's memory on a GPU shared with the learner: a batched-token cap, sleep mode
    "policy.vllm_max_num_batched_tokens": 4096, "policy.vllm_sleep_mode": True,
})
# one convention per idea (counts n_<things>, the annotator's keys, no enabled switch): the
# same values under the keys params.RETIRED_KEYS gives them, as an old run folder reads
PAPER_SHARED = _flat(upgrade_run_config(_nested(PAPER_SHARED)))
PAPER_VARIANTS = {  # run_name: (training.algorithm, group_size, policy.think, max_new_tokens, difficulty)
    "paper-grpo-nothink-hard": ("grpo", 4, False, 512, "hard"),
    "paper-grpo-nothink-moderate": ("grpo", 4, False, 512, "moderate"),
    "paper-grpo-think-hard": ("grpo", 4, True, 1024, "hard"),
    "paper-grpo-think-moderate": ("grpo", 4, True, 1024, "moderate"),
    "paper-ppo-nothink-hard": ("ppo", 1, False, 512, "hard"),
    "paper-ppo-nothink-moderate": ("ppo", 1, False, 512, "moderate"),
    "paper-ppo-think-hard": ("ppo", 1, True, 1024, "hard"),
    "paper-ppo-think-moderate": ("ppo", 1, True, 1024, "moderate"),
}


# batch sizes became global, in dialogues (issue 23): 4 optimizer steps a step for both
# algorithms, PPO 32 / 8 (the base's value), GRPO 128 / 32 (set by each GRPO recipe)
PAPER_MINI_BATCH = {"ppo": 8, "grpo": 32}


def _expected_recipe(name: str) -> dict:
    algorithm, group_size, think, max_new_tokens, difficulty = PAPER_VARIANTS[name]
    return {**PAPER_SHARED, "run_name": name, "training.algorithm": algorithm,
            "training.group_size": group_size, "policy.think": think,
            "policy.max_new_tokens": max_new_tokens, "simulator.difficulty": difficulty,
            "training.mini_batch_size": PAPER_MINI_BATCH[algorithm]}


@pytest.mark.parametrize("name", sorted(PAPER_VARIANTS))
def test_paper_recipe_resolves_to_its_former_values(name):
    path = ROOT / "params" / f"{name}.yaml"
    expected = _expected_recipe(name)
    assert _flat(load_params(path)) == expected  # the same keys set, to the same values
    assert load_config(path).model_dump() == build_config(_nested(expected)).model_dump()


@pytest.mark.parametrize("name", sorted(PAPER_VARIANTS))
def test_paper_recipe_is_a_few_lines_on_its_base(name):
    text = (ROOT / "params" / f"{name}.yaml").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 15
    assert yaml.safe_load(text)["base"] == "paper/base.yaml"


def test_paper_recipes_share_one_judge_apart_from_the_training_simulator():
    """Every paper recipe is scored by the same judge (its whole config), and that judge
    is not the training simulator behind another name: its own endpoint and served model."""
    configs = {name: load_config(ROOT / "params" / f"{name}.yaml") for name in sorted(PAPER_VARIANTS)}
    judges = {name: cfg.evaluation.judge.model_dump() for name, cfg in configs.items()}
    first = next(iter(judges.values()))
    assert all(judge == first for judge in judges.values())
    for cfg in configs.values():
        assert (cfg.evaluation.judge.base_url, cfg.evaluation.judge.model) == (
            "http://localhost:8001/v1", "sentient-judge")
        assert cfg.evaluation.judge.base_url != cfg.simulator.base_url
        assert cfg.evaluation.judge.model != cfg.simulator.model


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_base_is_resolved_relative_to_the_including_file_and_nests(tmp_path):
    _write(tmp_path / "a" / "root.yaml", "seed: 1\ntraining:\n  steps: 5\n  learning_rate: 0.5\n"
           "policy:\n  lora:\n    r: 4\n    target_modules: [q_proj, v_proj]\n")
    _write(tmp_path / "a" / "b" / "mid.yaml", "base: ../root.yaml\ntraining:\n  steps: 7\n"
           "policy:\n  lora:\n    alpha: 32\n")
    top = _write(tmp_path / "c" / "top.yaml", "base: ../a/b/mid.yaml\nrun_name: top\n"
                 "policy:\n  lora:\n    target_modules: [o_proj]\n")
    assert load_params(top) == {
        "seed": 1, "run_name": "top",
        "training": {"steps": 7, "learning_rate": 0.5},                      # mappings merge key by key
        "policy": {"lora": {"r": 4, "alpha": 32, "target_modules": ["o_proj"]}},  # lists replace
    }
    cfg = load_config(top, ["training.steps=9"])  # overrides apply after the whole chain
    assert (cfg.training.steps, cfg.training.learning_rate, cfg.policy.lora.r) == (9, 0.5, 4)


def test_base_cycle_is_refused_naming_the_chain(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: c.yaml\n")
    _write(tmp_path / "c.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        load_config(tmp_path / "a.yaml")
    _write(tmp_path / "self.yaml", "base: self.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle .*self\.yaml -> .*self\.yaml"):
        load_config(tmp_path / "self.yaml")


def test_bad_base_is_a_config_error_naming_the_file(tmp_path):
    missing = _write(tmp_path / "m.yaml", "base: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml"):
        load_config(missing)
    listed = _write(tmp_path / "l.yaml", "base: [a.yaml, b.yaml]\n")
    with pytest.raises(ConfigError, match=r"l\.yaml: base: must be the path"):
        load_config(listed)
    # a key unknown to the schema in the base is named like any other
    _write(tmp_path / "bad_base.yaml", "training:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"training\.stepz"):
        load_config(_write(tmp_path / "child.yaml", "base: bad_base.yaml\n"))


def test_merge_params_leaves_its_inputs_alone():
    base = {"policy": {"lora": {"r": 8}}, "stages": ["train"]}
    overlay = {"policy": {"lora": {"alpha": 4}}, "stages": ["trained"]}
    assert merge_params(base, overlay) == {"policy": {"lora": {"r": 8, "alpha": 4}}, "stages": ["trained"]}
    assert base == {"policy": {"lora": {"r": 8}}, "stages": ["train"]}
    assert overlay == {"policy": {"lora": {"alpha": 4}}, "stages": ["trained"]}


def test_ablation_grid_on_a_composed_paper_recipe(tmp_path):
    grid = _write(tmp_path / "grid.yaml", f"name: g\nbase: {ROOT / 'params' / 'paper-ppo-think-hard.yaml'}\n"
                  "axes:\n  training.algorithm: [grpo, ppo]\n")
    _, cells = load_grid(grid)
    assert [c.config.training.algorithm for c in cells] == ["grpo", "ppo"]
    assert all(c.config.training.grad_accum_steps == 4 and c.config.policy.think for c in cells)


def test_policy_sampling_settings_come_from_the_policy_section():
    from rlver_lib.config import PolicyConfig, SamplingParams

    policy = PolicyConfig(temperature=0.7, top_p=0.9, max_new_tokens=33)
    assert policy.sampling(5) == SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=33, seed=5)
    assert policy.sampling(None).seed is None




# ----------------------------------------------------------------- the recipes' GPU settings


def test_eight_paper_recipes_cover_the_grid():
    names = {p.stem for p in PAPER_PARAMS}
    expected = {
        f"paper-{a}-{t}-{d}"
        for a, t, d in itertools.product(["ppo", "grpo"], ["think", "nothink"], ["moderate", "hard"])
    }
    assert names == expected == set(PAPER_VARIANTS)  # every recipe is checked value by value above


@pytest.mark.parametrize("hard", [p for p in PAPER_PARAMS if p.stem.endswith("-hard")], ids=lambda p: p.stem)
def test_hard_recipe_differs_from_its_moderate_twin_in_difficulty_only(hard):
    cfg, twin = load_config(hard), load_config(hard.with_name(hard.name.replace("-hard", "-moderate")))
    assert cfg.simulator.difficulty == "hard" and twin.simulator.difficulty == "moderate"
    strip = {"run_name": True, "simulator": {"difficulty": True}}
    assert cfg.model_dump(exclude=strip) == twin.model_dump(exclude=strip)


@pytest.mark.parametrize("path", PAPER_PARAMS, ids=lambda p: p.stem)
def test_paper_recipe_validates_with_paper_settings(path):
    cfg = load_config(path)
    _, algo, mode, difficulty = path.stem.split("-")
    assert cfg.run_name == path.stem
    assert cfg.training.algorithm == algo
    assert cfg.policy.think is (mode == "think")
    assert cfg.simulator.difficulty == difficulty
    assert cfg.policy.model == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.policy.backend == "vllm"
    assert cfg.simulator.backend == "openai"
    assert cfg.simulator.base_url == "http://localhost:8000/v1"
    # paper settings (RLVER §4): 32 scenarios/step, GRPO n=4, T=1.0, <= 8 turns,
    # clip 0.2, entropy 0.001, no KL
    assert cfg.training.scenarios_per_step == 32
    assert cfg.training.group_size == (4 if algo == "grpo" else 1)
    assert cfg.policy.temperature == 1.0
    assert cfg.rollout.max_turns == 8
    assert cfg.training.clip_eps == 0.2
    assert cfg.training.entropy_coef == 0.001
    assert cfg.training.kl_coef == 0.0
    assert cfg.scenarios.train == "data/rlver_profiles/train_profile.jsonl"
    assert vllm_max_lora_rank(cfg.policy.lora.r) == cfg.policy.lora.r


@pytest.mark.parametrize(
    "name, distributed_type, zero_stage",
    [("ddp", "MULTI_GPU", None), ("zero2", "DEEPSPEED", 2)],
)
def test_accelerate_config_parses_with_accelerate(name, distributed_type, zero_stage):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(ACCELERATE_DIR / f"{name}.yaml"))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type.value == distributed_type
    assert str(cfg.mixed_precision) == "bf16"
    assert cfg.num_processes >= 2
    assert cfg.deepspeed_config.get("zero_stage") == zero_stage
