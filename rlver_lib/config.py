"""Typed run configuration (DESIGN §3 "config").

One :class:`RunConfig` describes a whole run: the policy, the simulated user, the
scenarios, rollouts, training, evaluation and reporting.  It is loaded from
``params/*.yaml``; dotted overrides (``training.steps=4``) come from the command
line (``rlver run P.yaml --set key=value``) and from papermill parameters.
Unknown keys are errors everywhere (``extra="forbid"``).

Errors: :func:`load_config` raises :class:`ConfigError` naming the file and the
offending key (for example ``params/x.yaml: training.stepz: Extra inputs are not
permitted``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

EMBEDDED_POLICY = "embedded:smollm2-135m-instruct"
EMBEDDED_SIMULATOR = "embedded:qwen2.5-coder-1.5b-instruct-q4km"


class ConfigError(ValueError):
    """A params file or override that does not fit the schema; the message names the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    """LoRA adapter settings (peft ``LoraConfig``)."""

    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )


class PolicyConfig(_Strict):
    """The chat policy being trained or evaluated.

    ``model`` is the embedded SmolLM2 default, a Hugging Face id or a local folder.
    ``adapter`` optionally names a saved LoRA adapter folder to load on top.
    """

    model: str = EMBEDDED_POLICY
    backend: Literal["transformers", "vllm"] = "transformers"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    adapter: str | None = None
    think: bool = False
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_context_tokens: int = Field(2048, ge=64)
    format_violation: Literal["keep_reply", "end_dialogue"] = "keep_reply"
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    lora: LoraConfig = Field(default_factory=LoraConfig)


class SimulatorConfig(_Strict):
    """The affective simulated user (DESIGN §1).

    ``backend``: ``llamacpp`` (in-process GGUF), ``transformers`` (local HF model),
    ``openai`` (any OpenAI-compatible server at ``base_url``; the key is read
    from the environment variable named by ``api_key_env``), or ``rule`` (no
    model: the deterministic ``rollout.RuleSimulator`` with its default change
    function; for tiny test runs and CI, not for research).
    """

    backend: Literal["llamacpp", "transformers", "openai", "rule"] = "llamacpp"
    model: str = EMBEDDED_SIMULATOR
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    difficulty: Literal["easy", "moderate", "hard"] = "moderate"
    initial_emotion: int = Field(50, ge=0, le=100)
    temperature: float = Field(0.7, ge=0.0)
    max_new_tokens: int = Field(256, ge=16)
    max_retries: int = Field(2, ge=0)
    timeout_s: float = Field(120.0, gt=0)
    concurrency: int = Field(8, ge=1)
    n_threads: int | None = None
    n_ctx: int = Field(4096, ge=512)

    @model_validator(mode="after")
    def _url_for_openai(self) -> "SimulatorConfig":
        if self.backend == "openai" and not self.base_url:
            raise ValueError("simulator.base_url is required when simulator.backend is 'openai'")
        return self


class ScenarioConfig(_Strict):
    """Where scenarios come from: ``builtin:train`` / ``builtin:test`` (the shipped
    English set, persona-disjoint split) or a path to a JSONL/YAML file in our
    format or the RLVER/SAGE profile format."""

    train: str = "builtin:train"
    test: str = "builtin:test"
    limit_train: int | None = Field(None, ge=1)
    limit_test: int | None = Field(None, ge=1)


class RolloutConfig(_Strict):
    """Multi-turn rollout settings used during training."""

    max_turns: int = Field(8, ge=1)
    batch_size: int = Field(32, ge=1)


class TrainingConfig(_Strict):
    """The learner (DESIGN §3 "algorithms", "trainer"); paper defaults where they apply."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = Field(100, ge=0)
    scenarios_per_step: int = Field(32, ge=1)
    group_size: int = Field(4, ge=1)
    epochs_per_step: int = Field(1, ge=1)
    mini_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-5, gt=0)
    value_learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    value_clip_eps: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.001, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    scale_rewards: bool = True
    whiten_advantages: bool = True  # PPO: GAE advantages to zero mean, unit variance per batch
    loss_aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    format_penalty: float = Field(0.0, ge=0)
    gradient_checkpointing: bool = False
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    tensorboard: bool = False


class EvaluationConfig(_Strict):
    """The Sentient benchmark (DESIGN §1): start at 40, at most 10 policy turns."""

    initial_emotion: int = Field(40, ge=0, le=100)
    max_turns: int = Field(10, ge=1)
    n_scenarios: int | None = Field(None, ge=1)
    bootstrap_samples: int = Field(1000, ge=10)
    confidence: float = Field(0.95, gt=0, lt=1)
    math_retention: bool = True
    math_n: int | None = Field(None, ge=1)
    math_max_new_tokens: int = Field(64, ge=1)


class AnalysisConfig(_Strict):
    """Optional analyses in reports."""

    strategy_judge: bool = False
    judge_sample: int = Field(32, ge=1)
    consistency_sample: int = Field(8, ge=0)
    hacking_probes: bool = True


class RunConfig(_Strict):
    """A whole run, as resolved and saved to ``outputs/<run_name>/config.yaml``."""

    run_name: str = "run"
    seed: int = 0
    output_root: str = "outputs"
    stages: list[Literal["scenarios", "baseline", "train", "evaluate", "analysis"]] = Field(
        default_factory=lambda: ["scenarios", "baseline", "train", "evaluate", "analysis"]
    )
    threads: int | None = Field(None, ge=1)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    scenarios: ScenarioConfig = Field(default_factory=ScenarioConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)

    @property
    def run_dir(self) -> Path:
        """``<output_root>/<run_name>``."""
        return Path(self.output_root) / self.run_name


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{key}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``key=value``; the value is parsed as YAML (``4``, ``true``, ``[a, b]``).

    Raises :class:`ConfigError` when there is no ``=``.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else None


def _format_error(source: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{source}: {loc}: {e['msg']}")
    return "\n".join(lines)


def build_config(
    data: dict[str, Any] | None = None,
    overrides: dict[str, Any] | list[str] | None = None,
    source: str = "<config>",
) -> RunConfig:
    """Validate ``data`` with dotted ``overrides`` applied.

    ``overrides`` is a mapping ``{"training.steps": 4}`` or a list of
    ``"key=value"`` strings. Raises :class:`ConfigError` naming every bad key.
    """
    data = json.loads(json.dumps(data or {}))
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(source, err)) from None


def load_config(
    path: str | Path, overrides: dict[str, Any] | list[str] | None = None
) -> RunConfig:
    """Load ``path`` (YAML), apply overrides, validate. Raises :class:`ConfigError`."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    return build_config(data, overrides, source=str(path))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (what every run saves as ``config.yaml``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
