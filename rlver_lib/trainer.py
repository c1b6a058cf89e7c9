"""The learner loop: LoRA PPO and GRPO over multi-turn dialogues (the RLVER paper's
training; docs/ARCHITECTURE.md "Code map").

Batch sizes are global and counted in dialogues (:func:`batch_problems`), so a recipe
means the same on any number of processes. A step: sample ``scenarios_per_step``
scenarios (:func:`sample_scenario_indices`); each process rolls out ``group_size``
dialogues for each scenario of its equal share (whole GRPO groups stay on one process),
from its own random stream (:func:`process_seed`); reward = final emotion / 100 minus
``format_penalty``; old (and reference) log-probs and old values are scored on exactly
the sampled ids; advantages (GRPO: group-normalised, uninformative groups left out; PPO:
GAE across turns, whitened over all processes); ``epochs_per_step`` passes, each one
optimizer step per ``mini_batch_size`` trained dialogues of all processes
(:func:`dialogue_windows`), a process's share split into ``grad_accum_steps``
micro-batches through accelerate's gradient accumulation; one LR-scheduler step; the
policy hand-over to the rollout backend.
Every process takes part in the same collectives and optimizer steps every step
(zero-weight micro-batches where it has no samples); losses are normalised by the
token count of the whole optimizer step over all processes. Checkpoints:
:mod:`rlver_lib.checkpoint`; run folder: docs/ARCHITECTURE.md "Run folder".
"""

from __future__ import annotations

import copy
import math
import os
import resource
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from rlver_lib import algorithms
from rlver_lib.backends import Closing, PolicyBackend, close_backend
from rlver_lib.checkpoint import Checkpoints
from rlver_lib.config import ConfigError, RunConfig, TrainingConfig, dump_config, training_problems
from rlver_lib.files import CheckpointFolder, RunFolder, atomic_directory, atomic_write_text, iter_jsonl, write_jsonl

TIMING_METRICS = ("step_time_s", "rollout_time_s", "update_time_s", "tokens_per_s",
                  "generated_tokens_per_s", "peak_memory_mb")


class TrainerError(RuntimeError):
    """A training run that cannot proceed (bad launch, too few scenarios, bad checkpoint)."""


def _step_seed(seed: int, step: int) -> int:
    """A per-step seed derived from the run seed (independent of resume history)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def process_seed(seed: int, process_index: int) -> int:
    """The seed process ``process_index`` of a launch draws from, given the launch's
    ``seed``: ``seed`` itself on process 0 (a one-process run samples exactly as it
    always did), one derived from ``(seed, process_index)`` on the others, so no two
    processes share a random stream (backends then seed each dialogue of a batch
    from it: one row of a batched ``generate``, vLLM's per-request seeds)."""
    if process_index == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x5EED, process_index]).generate_state(1)[0])


def sample_scenario_indices(n_scenarios: int, position: int, count: int, seed: int) -> tuple[list[int], int]:
    """``count`` distinct scenario indices for the step starting at data ``position``.

    Returns ``(indices, new_position)``. The data stream is a sequence of epochs of
    ``n_scenarios`` positions each; epoch ``e`` visits the permutation seeded by
    ``(seed, e)``. A step takes the next ``count`` positions of the current epoch; when
    fewer than ``count`` are left it skips them and starts the next epoch (``drop_last``
    in PyTorch's ``DataLoader``), so a step never repeats a scenario and every epoch
    visits ``count * (n_scenarios // count)`` distinct scenarios (the skipped tail
    differs from epoch to epoch). A pure function of ``(n_scenarios, position, count,
    seed)``: a resumed run continues exactly.

    Raises :class:`TrainerError` when there are no scenarios or ``count`` exceeds
    ``n_scenarios`` (a step would have to repeat a scenario: raise
    ``training.group_size`` for more dialogues per scenario instead).
    """
    if n_scenarios < 1:
        raise TrainerError("no training scenarios")
    if count < 1 or position < 0:
        raise TrainerError(f"need count >= 1 and position >= 0, got count={count}, position={position}")
    if count > n_scenarios:
        raise TrainerError(
            f"training.scenarios_per_step={count} exceeds the {n_scenarios} training scenario(s): a step "
            "would repeat a scenario. Lower training.scenarios_per_step (or raise training.group_size "
            "for more dialogues per scenario).")
    epoch, offset = divmod(position, n_scenarios)
    if offset + count > n_scenarios:  # the tail of this epoch is too short: skip it
        epoch, offset = epoch + 1, 0
    perm = np.random.default_rng([seed, epoch]).permutation(n_scenarios)
    return perm[offset:offset + count].tolist(), epoch * n_scenarios + offset + count


# ---------------------------------------------------------------- launch checks


def _zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of this launch (0 when DeepSpeed is not in use)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def check_launch(accelerator) -> None:
    """Refuse launches that would silently mis-train. Raises :class:`TrainerError` when

    - the environment says ``WORLD_SIZE > 1`` but accelerate runs this process alone
      (plain ``torchrun`` on CPU: every process would train its own copy into the same
      run folder);
    - DeepSpeed ZeRO-3 shards the weights: every rank's generation would have to run in
      lockstep and the LoRA weights could not be handed to a rollout engine.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise TrainerError(
            f"WORLD_SIZE={world} in the environment, but accelerate runs this process alone "
            f"({accelerator.distributed_type}): each of the {world} processes would train its own copy into the "
            "same run folder. On GPUs launch with `accelerate launch --config_file params/accelerate/ddp.yaml "
            f"...`; on CPU with `ACCELERATE_USE_CPU=true torchrun --nproc_per_node {world} ...`.")
    if _zero_stage(accelerator) == 3:
        raise TrainerError("DeepSpeed ZeRO-3 is not supported: it shards the weights, so rollouts would need "
                           "every rank to generate in lockstep and the LoRA adapter could not be handed to vLLM. "
                           "Use params/accelerate/ddp.yaml or zero2.yaml.")


def process_group_kwargs(timeout_s: float):
    """accelerate's ``InitProcessGroupKwargs`` for this launch: the collective timeout
    ``timeout_s`` (seconds) of the whole launch (the process group is made once per
    process) and, for a DeepSpeed launch on a machine without CUDA, the ``gloo``
    backend. accelerate leaves the backend unset there (it knows NCCL and the other
    accelerators' libraries only) and then counts one process, so DeepSpeed's batch
    check fails (``train_batch_size ... 1 != 1 * 1 * 2``); DeepSpeed's CPU accelerator
    itself communicates over gloo when oneCCL is absent."""
    from accelerate.utils import InitProcessGroupKwargs

    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    deepspeed_launch = (os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
                        and int(os.environ.get("LOCAL_RANK", "-1")) != -1)
    if deepspeed_launch and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    return InitProcessGroupKwargs(**kwargs)


def configure_deepspeed(accelerator, training: TrainingConfig) -> None:
    """Under DeepSpeed, put the accumulation, clipping and micro-batch settings of
    ``training`` into the DeepSpeed config before ``prepare``: the engine, not the
    trainer, accumulates and clips there (``accelerator.clip_grad_norm_`` only reports
    its norm). A value the DeepSpeed config sets explicitly must agree, else
    :class:`TrainerError`.

    accelerate hands every later ``Accelerator`` of a process the first one's plugin
    (``rlver ablate`` trains several runs in one process), whose config accelerate and
    this function filled in for the first run (``train_batch_size`` too); the launch's
    config is therefore kept on first sight (``plugin.launch_config``) and restored,
    in place, before each run's settings go in."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    launch = plugin.__dict__.setdefault("launch_config", copy.deepcopy(plugin.deepspeed_config))
    plugin.deepspeed_config.clear()
    plugin.deepspeed_config.update(copy.deepcopy(launch))
    # DeepSpeed's nominal micro-batch (its batch-size bookkeeping only: the trainer feeds the
    # engine itself): a process's dialogues per micro-batch, at least 1
    micro = max(1, training.mini_batch_size // (accelerator.num_processes * training.grad_accum_steps))
    wanted = {"gradient_accumulation_steps": ("grad_accum_steps", training.grad_accum_steps),
              "gradient_clipping": ("max_grad_norm", training.max_grad_norm),
              "train_micro_batch_size_per_gpu": ("mini_batch_size", micro)}
    config = plugin.deepspeed_config
    for key, (name, value) in wanted.items():
        current = config.get(key, "auto")
        if current in ("auto", None):
            config[key] = value
        elif float(current) != float(value):
            raise TrainerError(f"the DeepSpeed config sets {key}={current} but training.{name} is {value}; "
                               f"set {key}: auto in the DeepSpeed config")


def lr_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig):
    """The LR schedule (``transformers.get_scheduler``: ``constant`` means
    ``constant_with_warmup``, so ``warmup_steps`` is honoured by every schedule).

    Stepped once here, so that training step ``s`` (1-based) runs at the schedule's
    value at ``s``: step 1 is not at LR 0; warmup reaches the peak at step
    ``warmup_steps``; linear/cosine decay reach 0 one step after the last.
    """
    from transformers import get_scheduler

    name = "constant_with_warmup" if training.lr_schedule == "constant" else training.lr_schedule
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=training.warmup_steps,
                              num_training_steps=training.steps + 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
    return scheduler


# ---------------------------------------------------------------- model


class PolicyWithValueHead(nn.Module):
    """The LoRA policy plus (for PPO) a linear value head on the backbone's last hidden state.

    ``forward(input_ids [B, L], attention_mask [B, L], mask [B, L-1])`` returns a dict of
    ``[B, L-1]`` float32 tensors aligned with next-token positions (entry ``t`` scores
    ``input_ids[:, t+1]``): ``logprobs`` (at the sampling temperature), ``entropy``
    (nats; left out with ``entropy=False``, without gradient unless ``entropy_grad``)
    and, with a value head, ``values``. Only positions where ``mask`` is 1 are computed
    (the LM head runs on policy tokens only); the rest are 0. Log-probs and entropy
    come from :func:`~rlver_lib.algorithms.chunked_logprobs_and_entropy`: the
    full-vocabulary float32 logits exist a chunk of positions at a time, never for
    the whole batch, and are recomputed in backward instead of kept.

    The critic shares the policy: ``values`` is ``value_head(h)`` on the same LoRA
    backbone's hidden state, without a detach, so the value loss also trains the
    LoRA weights and both gradients are clipped together (RLVER/verl train a separate
    critic model; docs/GPU.md "The shared critic").
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear | None, temperature: float):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.temperature = temperature if temperature > 0 else 1.0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor, *,
                entropy: bool = True, entropy_grad: bool = True) -> dict:
        base = self.policy.get_base_model()
        hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        selected = mask.bool()
        h = hidden[:, :-1][selected]  # [N, H], N = number of policy tokens

        def scatter(values: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
            out[selected] = values
            return out

        logprobs, ent = algorithms.chunked_logprobs_and_entropy(
            h, base.get_output_embeddings(), input_ids[:, 1:][selected], temperature=self.temperature,
            entropy=entropy, entropy_grad=entropy_grad)
        out = {"logprobs": scatter(logprobs)}
        if ent is not None:
            out["entropy"] = scatter(ent)
        if self.value_head is not None:
            out["values"] = scatter(self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float())
        return out


def build_model(cfg: RunConfig) -> tuple[PolicyWithValueHead, Any]:
    """``(model, tokenizer)``: the policy of ``cfg.policy`` with a fresh LoRA adapter (or
    its ``policy.adapter``, trainable), gradient checkpointing when asked, a zero-
    initialised value head for PPO, and dropout switched off everywhere (as TRL's
    ``disable_dropout``), so old and new log-probs come from the same function."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from rlver_lib.models import load_policy

    policy, tokenizer = load_policy(cfg.policy, trainable=True)
    if not isinstance(policy, PeftModel):
        lora = cfg.policy.lora
        policy = get_peft_model(policy, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                   target_modules=lora.target_modules, task_type="CAUSAL_LM"))
    if cfg.training.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.enable_input_require_grads()
    value_head = None
    if cfg.training.algorithm == "ppo":
        # zero-initialised: the first advantages are then the (whitened) returns, not
        # the noise of a random critic over the backbone's large hidden states
        value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(value_head.weight)
        nn.init.zeros_(value_head.bias)
    model = PolicyWithValueHead(policy, value_head, cfg.policy.temperature)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, tokenizer


def optimizer_groups(model: PolicyWithValueHead, training: TrainingConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups: the LoRA weights at ``learning_rate``, the value head
    (PPO) at ``value_learning_rate``."""
    groups = [{"params": [p for p in model.policy.parameters() if p.requires_grad], "lr": training.learning_rate}]
    if model.value_head is not None:
        groups.append({"params": list(model.value_head.parameters()), "lr": training.value_learning_rate})
    return groups


# ---------------------------------------------------------------- samples and advantages


_PER_POSITION = ("sampling_logprobs", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")


@dataclass
class _Sample:
    """One policy turn prepared for training; per-position tensors are ``[L-1]``
    (``sampling_logprobs``: the rollout engine's, NaN where it gave none)."""

    dialogue_id: str
    group_id: str
    turn: int
    input_ids: torch.Tensor
    mask: torch.Tensor
    sampling_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def samples_from_trajectories(trajectories: Sequence[Any]) -> list[_Sample]:
    """One :class:`_Sample` per policy turn of each trajectory, turns in order."""
    samples = []
    for t in trajectories:
        for turn in sorted(t.samples, key=lambda s: s.turn):
            ids = torch.tensor(turn.input_ids)
            sampling = torch.full((len(ids) - 1,), float("nan"))
            if len(turn.old_logprobs) == len(turn.completion_ids):
                start = len(turn.context_ids) - 1
                sampling[start:start + len(turn.completion_ids)] = torch.tensor(turn.old_logprobs)
            samples.append(_Sample(t.dialogue_id, t.group_id, turn.turn, ids,
                                   torch.tensor(turn.loss_mask[1:], dtype=torch.float32), sampling))
    return samples


def grpo_sample_advantages(samples: list[_Sample], rewards: dict[str, float], *,
                           scale_rewards: bool) -> tuple[list[_Sample], int, int]:
    """GRPO: every policy token of every turn carries its dialogue's group-normalised
    advantage. Returns ``(kept samples, zero-variance groups, groups)``; samples of
    zero-variance groups are left out (:func:`~rlver_lib.algorithms.informative_groups`)."""
    dialogues = list(dict.fromkeys(s.dialogue_id for s in samples))
    if not dialogues:
        return [], 0, 0
    group_of = {s.dialogue_id: s.group_id for s in samples}
    reward = torch.tensor([rewards[d] for d in dialogues], dtype=torch.float32)
    groups = [group_of[d] for d in dialogues]
    advantage, zero_variance = algorithms.grpo_advantages(reward, groups, scale_rewards=scale_rewards)
    keep = algorithms.informative_groups(reward, groups)
    by_dialogue = {d: (float(a), bool(k)) for d, a, k in zip(dialogues, advantage, keep)}
    for s in samples:
        s.advantages = s.mask * by_dialogue[s.dialogue_id][0]
    return [s for s in samples if by_dialogue[s.dialogue_id][1]], zero_variance, len(set(groups))


def ppo_sample_advantages(samples: list[_Sample], rewards: dict[str, float], *, gamma: float, lam: float) -> None:
    """PPO: GAE over each dialogue's policy tokens, its turns chained in order
    (:func:`~rlver_lib.algorithms.dialogue_gae`); sets ``advantages`` and ``returns``."""
    by_dialogue: dict[str, list[_Sample]] = defaultdict(list)
    for s in samples:
        by_dialogue[s.dialogue_id].append(s)
    turns = [sorted(group, key=lambda s: s.turn) for group in by_dialogue.values()]
    advantages, returns = algorithms.dialogue_gae(
        [[s.old_values for s in dialogue] for dialogue in turns], [[s.mask for s in dialogue] for dialogue in turns],
        [rewards[dialogue[0].dialogue_id] for dialogue in turns], gamma=gamma, lam=lam)
    for dialogue, adv, ret in zip(turns, advantages, returns):
        for s, a, r in zip(dialogue, adv, ret):
            s.advantages, s.returns = a, r


def train_reward(trajectory: Any, format_penalty: float, reward_scale: float = 1.0) -> float:
    """The reward a dialogue is trained on: ``reward_scale`` x its reward (final emotion /
    100, in [0, 1]; RLVER §3), minus ``format_penalty`` when a policy turn broke the
    format; 0 for an ``error`` dialogue (trained only with ``training.error_dialogues:
    zero_reward``). ``reward_scale = -1`` is the reversed-reward control
    (``training.reward_scale``); the penalty keeps its sign either way."""
    if trajectory.termination == "error":
        return 0.0
    return reward_scale * float(trajectory.reward) - (format_penalty if trajectory.format_violations else 0.0)


def batch_problems(training: TrainingConfig, num_processes: int) -> list[str]:
    """Batch settings that do not divide, each with its reason (empty when none).

    The batch sizes are global and counted in dialogues, so a recipe means the same on
    any number of processes (as verl's ``train_batch_size`` / ``ppo_mini_batch_size``):
    a step rolls out ``scenarios_per_step x group_size`` dialogues over all processes,
    ``scenarios_per_step / num_processes`` scenarios (whole GRPO groups) on each; one
    optimizer step learns from ``mini_batch_size`` dialogues (all their turns), each
    process contributing ``mini_batch_size / num_processes``. ``grad_accum_steps`` only
    splits a process's share of an optimizer step into that many micro-batches (memory;
    the gradient is that of the whole window either way). Refused: a
    ``scenarios_per_step`` or ``mini_batch_size`` that does not divide by the number of
    processes, and a ``mini_batch_size`` that does not divide a step's dialogues.
    """
    problems = []
    processes, per_step, mini = num_processes, training.scenarios_per_step, training.mini_batch_size
    dialogues = per_step * training.group_size
    if per_step % processes:
        problems.append(f"training.scenarios_per_step={per_step} does not divide over {processes} processes "
                        f"(each rolls out an equal share of whole scenarios); use a multiple of {processes}")
    if dialogues % mini:
        problems.append(f"training.mini_batch_size={mini} (dialogues per optimizer step, over all processes) "
                        f"does not divide the {dialogues} dialogues of a step (training.scenarios_per_step "
                        f"{per_step} x training.group_size {training.group_size})")
    if mini % processes:
        problems.append(f"training.mini_batch_size={mini} (dialogues per optimizer step, over all processes) "
                        f"does not divide over {processes} processes; use a multiple of {processes}")
    return problems


def optimizer_steps_per_epoch(dialogues: int, mini_batch_size: int) -> int:
    """Optimizer steps of one pass over ``dialogues`` trained dialogues (all processes):
    ``ceil(dialogues / mini_batch_size)``. All of a step's dialogues make
    ``scenarios_per_step x group_size / mini_batch_size``; GRPO groups without signal
    and dropped error dialogues make fewer, each still of about ``mini_batch_size``."""
    if dialogues < 0 or mini_batch_size < 1:
        raise ValueError(f"need dialogues >= 0 and mini_batch_size >= 1, got {dialogues}, {mini_batch_size}")
    return math.ceil(dialogues / mini_batch_size)


def scoring_batch_size(samples: Sequence[_Sample], training: TrainingConfig, num_processes: int) -> int:
    """Samples per forward pass when scoring old log-probs: about a training
    micro-batch's (``mini_batch_size / (num_processes x grad_accum_steps)`` dialogues'
    turns at this step's turns per dialogue), at least 1."""
    dialogues = len({s.dialogue_id for s in samples})
    if not dialogues:
        return 1
    per_micro = training.mini_batch_size / (num_processes * training.grad_accum_steps)
    return max(1, math.ceil(len(samples) / dialogues * per_micro))


def dialogue_windows(n_local: int, offset: int, windows: int) -> list[int]:
    """The optimizer step (window) of each of this process's ``n_local`` dialogues: the
    dialogues of all processes in rank order (this process's first at ``offset``) are
    dealt round-robin into ``windows`` windows, so every window holds the floor or
    the ceiling of ``dialogues / windows`` over all processes, and on equal shares each
    process contributes the same number to every window."""
    if windows < 1:
        raise ValueError(f"need windows >= 1, got {windows}")
    return [(offset + j) % windows for j in range(n_local)]


def window_sizes(chunks: Sequence[Sequence[_Sample]], accumulation: int) -> torch.Tensor:
    """``[windows, 2]`` float64: the policy tokens and the samples of each window of
    ``accumulation`` consecutive micro-batches (``chunks``) on this process; summed over
    processes they are the window's loss normalisers."""
    return torch.tensor([[sum(float(s.mask.sum()) for chunk in chunks[w:w + accumulation] for s in chunk),
                          sum(len(chunk) for chunk in chunks[w:w + accumulation])]
                         for w in range(0, len(chunks), accumulation)], dtype=torch.float64).reshape(-1, 2)


def empty_sample(pad_id: int) -> _Sample:
    """A zero-weight micro-batch (no policy token) for a process with no samples left."""
    return _Sample("", "", 0, torch.tensor([pad_id, pad_id]), torch.zeros(1))


def rest_rollout_backend(backend: Any) -> None:
    """Let the rollout ``backend`` free its device memory while the learner scores and
    updates (its ``sleep``, where it has one: vLLM's sleep mode,
    ``policy.vllm_sleep_mode``); it wakes up at its next ``generate``."""
    sleep = getattr(backend, "sleep", None)
    if sleep is not None:
        sleep()


def _collate(samples: Sequence[_Sample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``/``attention_mask`` ``[B, L]``, the rest ``[B, L-1]``
    (a field a sample lacks is 0; ``sampling_logprobs`` is NaN where unknown)."""
    def pad(rows, value=0.0):
        return nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)

    batch = {"input_ids": pad([s.input_ids for s in samples], pad_id),
             "attention_mask": pad([torch.ones_like(s.input_ids) for s in samples], 0),
             "mask": pad([s.mask for s in samples])}
    for key in _PER_POSITION:
        missing = float("nan") if key == "sampling_logprobs" else 0.0
        batch[key] = pad([getattr(s, key) if getattr(s, key) is not None else torch.full_like(s.mask, missing)
                          for s in samples], missing)
    return {k: v.to(device) for k, v in batch.items()}


@torch.no_grad()
def score_old(model: PolicyWithValueHead, samples: list[_Sample], *, batch_size: int, pad_id: int,
              device: torch.device, reference: bool) -> None:
    """Set old log-probs, old values (PPO) and, with ``reference``, reference log-probs
    (the adapter disabled) of each sample: local forward passes of the unwrapped model,
    ``batch_size`` samples at a time, no collectives."""
    model.eval()
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        batch = _collate(chunk, pad_id, device)
        args = (batch["input_ids"], batch["attention_mask"], batch["mask"])
        out = model(*args, entropy=False)  # the entropy of old samples is never used
        ref = None
        if reference:
            with model.policy.disable_adapter():
                ref = model(*args, entropy=False)["logprobs"]
        for i, s in enumerate(chunk):
            n = s.mask.numel()
            s.old_logprobs = out["logprobs"][i, :n].cpu()
            s.ref_logprobs = None if ref is None else ref[i, :n].cpu()
            if "values" in out:
                s.old_values = out["values"][i, :n].cpu()


def micro_batch_loss(prepared: nn.Module, batch: dict[str, torch.Tensor], training: TrainingConfig, *,
                 max_new_tokens: int, tokens: float, rows: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of its window's loss (all terms in view, as in CleanRL) and
    its local sums for the metrics; ``tokens``/``rows``: the window's policy tokens and
    samples over all processes, the normalisers of every term."""
    mask = batch["mask"]
    out = prepared(batch["input_ids"], batch["attention_mask"], mask, entropy_grad=training.entropy_coef > 0)
    weights = None
    if training.is_correction:
        weights = algorithms.truncated_is_weights(batch["old_logprobs"], batch["sampling_logprobs"], mask,
                                                  training.is_cap)
    normaliser = algorithms.aggregation_denominator(training.loss_aggregation, tokens=tokens, rows=rows,
                                                    max_tokens=max_new_tokens)
    policy = algorithms.clipped_policy_loss(
        out["logprobs"], batch["old_logprobs"], batch["advantages"], mask, clip_eps=training.clip_eps,
        aggregation=training.loss_aggregation, normaliser=normaliser, is_weights=weights)
    entropy = algorithms.aggregate(out["entropy"], mask, "token_mean", normaliser=tokens)
    loss = policy.loss - training.entropy_coef * entropy
    n = float(mask.sum())
    parts = {"policy_loss": float(policy.loss.detach()), "tokens": n,
             "entropy": float((out["entropy"].detach() * mask).sum()),
             "approx_kl_old": policy.approx_kl.item() * n, "clipped": policy.clip_fraction.item() * n}
    if training.kl_coef > 0:
        kl = algorithms.kl_penalty(out["logprobs"], batch["ref_logprobs"], training.kl_estimator)
        loss = loss + training.kl_coef * algorithms.aggregate(kl, mask, "token_mean", normaliser=tokens)
        parts["kl_ref"] = float((kl.detach() * mask).sum())
    if training.algorithm == "ppo":
        value_loss, value_clip = algorithms.clipped_value_loss(
            out["values"], batch["old_values"], batch["returns"], mask, clip_eps=training.value_clip_eps,
            normaliser=tokens)
        loss = loss + training.vf_coef * value_loss
        parts.update(value_loss=float(value_loss.detach()), value_clipped=float(value_clip) * n)
    if weights is not None:
        parts.update(is_weight=float((weights * mask).sum()),
                     is_capped=float(((weights >= training.is_cap) * mask).sum()))
    return loss, parts


class Collectives:
    """Reductions over the processes of ``accelerator`` (plain values on one process);
    every process must call each of them, in the same order."""

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over processes (float64, on the CPU)."""
        if self.accelerator.num_processes == 1:
            return tensor.double()
        return self.accelerator.reduce(tensor.double().to(self.accelerator.device), reduction="sum").cpu()

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The largest entry of ``tensor`` over processes."""
        if self.accelerator.num_processes == 1:
            return tensor.max()
        return self.accelerator.gather(tensor.double().to(self.accelerator.device)).max().cpu()

    def gather(self, records: list[Any]) -> list[Any]:
        """Every process's records, rank 0's first."""
        if self.accelerator.num_processes == 1:
            return records
        from accelerate.utils import gather_object

        return gather_object(records)


def assign_advantages(samples: list[_Sample], rewards: dict[str, float], training: TrainingConfig,
                      collect: Collectives) -> tuple[list[_Sample], dict[str, float], dict[str, float]]:
    """Advantages (and PPO returns) for ``samples``; returns the samples to train on,
    the step's sample statistics summed over processes, and the explained variance
    and largest sampling log-prob gap over processes."""
    zero_variance = groups = 0
    gaps = [algorithms.logprob_gap(s.old_logprobs, s.sampling_logprobs, s.mask) for s in samples]
    if training.algorithm == "grpo":
        samples, zero_variance, groups = grpo_sample_advantages(samples, rewards,
                                                                scale_rewards=training.scale_rewards)
    else:
        ppo_sample_advantages(samples, rewards, gamma=training.gamma, lam=training.lam)
        if training.whiten_advantages:  # over every process's policy tokens
            moments = collect.sum(sum((algorithms.masked_moments(s.advantages, s.mask) for s in samples),
                                    torch.zeros(3, dtype=torch.float64)))
            for s in samples:
                s.advantages = algorithms.whiten_with_moments(s.advantages, s.mask, moments)
    ppo = training.algorithm == "ppo"
    return_moments = sum((algorithms.masked_moments(s.returns, s.mask) for s in samples if ppo),
                         torch.zeros(3, dtype=torch.float64))
    residual_moments = sum((algorithms.masked_moments(s.returns - s.old_values, s.mask) for s in samples if ppo),
                           torch.zeros(3, dtype=torch.float64))
    local = torch.cat([torch.tensor([
        len(samples), sum(float(s.mask.sum()) for s in samples),
        sum(s.input_ids.numel() for s in samples) * training.epochs_per_step, zero_variance, groups,
        sum(float(g[0]) for g in gaps), sum(float(g[2]) for g in gaps)], dtype=torch.float64),
        return_moments, residual_moments])
    total = collect.sum(local)
    names = ("samples", "policy_tokens", "train_tokens", "zero_variance_groups", "groups", "gap_sum", "gap_count")
    sums = dict(zip(names, total[:7].tolist()))
    extra = {"logprob_gap_max": float(collect.max(torch.tensor([max([float(g[1]) for g in gaps] + [0.0])])))}
    if ppo:
        extra["explained_variance"] = algorithms.explained_variance_from_moments(total[7:10], total[10:13])
    return samples, sums, extra



def update_metrics(total: dict[str, float], grad_norms: list[float], training: TrainingConfig, *,
                   windows: int) -> dict[str, float]:
    """The update's metrics from the sums of :func:`micro_batch_loss` over every micro-batch
    and process: losses as means over optimizer steps (``windows``), the rest as means
    over policy tokens; ``grad_norm`` the mean over optimizer steps."""
    tokens = max(total["tokens"], 1.0)
    update = {"policy_loss": total["policy_loss"] / windows, "entropy": total["entropy"] / tokens,
              "approx_kl_old": total["approx_kl_old"] / tokens, "clip_fraction": total["clipped"] / tokens,
              "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan")}
    if training.kl_coef > 0:
        update["kl_ref"] = total["kl_ref"] / tokens
    if training.algorithm == "ppo":
        update["value_loss"] = total["value_loss"] / windows
        update["value_clip_fraction"] = total["value_clipped"] / tokens
    if training.is_correction:
        update["is_weight_mean"] = total["is_weight"] / tokens
        update["is_capped_fraction"] = total["is_capped"] / tokens
    return update


_UPDATE_SUMS = ("policy_loss", "tokens", "entropy", "approx_kl_old", "clipped", "kl_ref", "value_loss",
                "value_clipped", "is_weight", "is_capped")


# ---------------------------------------------------------------- metrics


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def step_metrics(records: Sequence[dict[str, Any]], sums: dict[str, float], update: dict[str, float],
                 **fields: Any) -> dict[str, Any]:
    """One metrics row from every process's dialogue ``records`` (``to_record()`` plus
    ``train_reward`` and ``trained``), the sample ``sums`` (added over processes) and the
    ``update`` statistics; ``fields`` (step, data position, learning rate, number of
    processes, timings) are copied in. NaN where a metric is not defined for the step."""
    nan = float("nan")
    n = max(1, len(records))
    reward = np.array([r["reward"] for r in records], dtype=float)
    trained = [r["train_reward"] for r in records if r["trained"]]
    assistant = [x for r in records for x in r["transcript"] if x.get("role") == "assistant"]
    policy_turns = sum(r["policy_turns"] for r in records)
    row: dict[str, Any] = {key: fields[key] for key in ("step", "data_position", "num_processes")}
    row.update({
        "dialogues": len(records),
        "reward_mean": float(reward.mean()) if len(reward) else nan,
        "reward_std": float(reward.std()) if len(reward) else nan,
        "train_reward_mean": float(np.mean(trained)) if trained else nan,
        "success_rate": sum(r["termination"] == "success" for r in records) / n,
        "failure_rate": sum(r["termination"] == "failure" for r in records) / n,
        "error_rate": sum(r["termination"] == "error" for r in records) / n,
        "error_dialogues": sum(r["termination"] == "error" for r in records),
        "final_emotion_mean": float(np.mean([r["final_emotion"] for r in records])) if records else nan,
        "turns_mean": policy_turns / len(records) if records else nan,
        "format_violation_rate": sum(r["format_violations"] for r in records) / max(1, policy_turns),
        "zero_variance_group_share": sums["zero_variance_groups"] / sums["groups"] if sums["groups"] else 0.0,
        "completion_tokens_mean": sums["policy_tokens"] / max(1.0, sums["samples"]),
        "reply_chars_mean": float(np.mean([len(x.get("content") or "") for x in assistant])) if assistant else 0.0,
        "thought_chars_mean": float(np.mean([len(x.get("thought") or "") for x in assistant])) if assistant else 0.0,
        "samples": int(sums["samples"]),
        "learning_rate": fields["learning_rate"],
        "explained_variance": fields.get("explained_variance", nan),
        "logprob_gap_mean": sums["gap_sum"] / sums["gap_count"] if sums["gap_count"] else nan,
        "logprob_gap_max": fields.get("logprob_gap_max", nan) if sums["gap_count"] else nan,
    })
    row.update({k: update.get(k, nan) for k in (
        "policy_loss", "value_loss", "entropy", "kl_ref", "approx_kl_old", "clip_fraction",
        "value_clip_fraction", "is_weight_mean", "is_capped_fraction", "grad_norm")})
    row["optimizer_steps"] = int(update.get("optimizer_steps", 0))
    row.update({k: update.get(k, nan) for k in ("samples_per_update", "dialogues_per_update")})
    update_s, rollout_s = fields["update_time_s"], fields["rollout_time_s"]
    row.update({
        "step_time_s": fields["step_time_s"], "rollout_time_s": rollout_s, "update_time_s": update_s,
        "tokens_per_s": sums["train_tokens"] / update_s if update_s > 0 else nan,
        "generated_tokens_per_s": sums["policy_tokens"] / rollout_s if rollout_s > 0 else nan,
        "peak_memory_mb": _peak_memory_mb(),
    })
    return row


# ---------------------------------------------------------------- the learner


class Trainer(Closing):
    """LoRA PPO / GRPO learner for one run (see the module docstring for a step).

    ``cfg``: the run configuration (``training`` selects the algorithm and settings);
    ``train_scenarios``: the scenarios to sample from; ``simulator``: anything with
    ``opening_lines``/``step`` (default: built from ``cfg.simulator``);
    ``policy_backend``: the generation backend, a
    :class:`~rlver_lib.backends.PolicyBackend` that is handed the policy after every
    update (default: :func:`rlver_lib.models.make_policy_backend` over the live model).

    ``model`` is the :class:`PolicyWithValueHead` (its ``policy`` the live
    ``peft.PeftModel``); ``prepared`` is what ``accelerator.prepare`` made of it (a DDP
    or DeepSpeed wrapper, or the model itself), used for the update's forward and
    backward passes. Dropout is switched off in the whole model (as TRL's
    ``disable_dropout``) so old and new log-probs come from the same function. The KL
    reference (``kl_coef > 0``) is the base model with the adapter disabled, also when
    the run starts from ``policy.adapter``.

    Raises :class:`~rlver_lib.config.ConfigError` for settings the learner refuses
    (:func:`~rlver_lib.config.training_problems`) and :class:`TrainerError` for a bad
    launch (:func:`check_launch`), a ``policy_backend`` without ``sync_policy``, too few
    scenarios or a broken checkpoint.

    ``with Trainer(...) as trainer:`` (or :meth:`close`) stops the servers the trainer
    started itself (the simulator's, a served policy's); those passed in stay open.
    """

    def __init__(self, cfg: RunConfig, train_scenarios: Sequence[Any], *,
                 simulator: Any | None = None, policy_backend: PolicyBackend | None = None):
        from accelerate import Accelerator
        from transformers import set_seed

        from rlver_lib.models import make_policy_backend

        problems = training_problems(cfg)
        if problems:
            raise ConfigError("; ".join(problems))
        if policy_backend is not None and not isinstance(policy_backend, PolicyBackend):
            raise TrainerError(f"policy_backend {type(policy_backend).__name__} has no sync_policy(model, step): "
                               "the trainer could not hand it the updated policy (rlver_lib.backends.PolicyBackend)")
        training = cfg.training
        sample_scenario_indices(len(train_scenarios), 0, training.scenarios_per_step, cfg.seed)  # fail early
        self.cfg, self.training, self.scenarios = cfg, training, list(train_scenarios)
        self.accelerator = Accelerator(gradient_accumulation_steps=training.grad_accum_steps,
                                       kwargs_handlers=[process_group_kwargs(cfg.distributed.timeout_s)])
        self.accelerator.gradient_accumulation_steps = training.grad_accum_steps  # over any launcher default
        check_launch(self.accelerator)
        problems = batch_problems(training, self.accelerator.num_processes)
        if problems:
            raise ConfigError("; ".join(problems))
        configure_deepspeed(self.accelerator, training)
        self.folder = RunFolder(cfg.run_dir)
        set_seed(cfg.seed)

        self.model, self.tokenizer = build_model(cfg)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(optimizer_groups(self.model, training), weight_decay=training.weight_decay)
        self.scheduler = lr_scheduler(optimizer, training)  # stepped once per training step, not per process
        self.prepared, self.optimizer = self.accelerator.prepare(self.model, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.collect = Collectives(self.accelerator)
        self.checkpoints = Checkpoints(self.accelerator, self.folder.checkpoints, self.model,
                                       training.keep_checkpoints)
        self.pad_id = self.tokenizer.pad_token_id
        self.policy_backend = policy_backend or make_policy_backend(cfg.policy, self.model.policy, self.tokenizer)
        self._started = [] if policy_backend else [self.policy_backend]
        if simulator is None:
            from rlver_lib.models import build_simulator

            simulator = build_simulator(cfg.simulator, process_seed(cfg.seed, self.accelerator.process_index))
            self._started.append(simulator)
        self.simulator = simulator
        self.step, self.data_position = 0, 0
        self.history: list[dict[str, Any]] = []
        self._writer = None
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public

    def close(self) -> None:
        """Stop what this trainer started (the simulator's server, a served policy)."""
        for held in self._started:
            close_backend(held)

    def train(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Run up to ``training.steps`` steps (resuming where the run folder left off).

        ``stop_after`` ends this call after that global step without finishing the
        run (no final adapter) — what an interruption looks like. Returns the metrics
        rows of all steps so far.
        """
        training = self.training
        last = training.steps if stop_after is None else min(stop_after, training.steps)
        bar = tqdm(total=training.steps, initial=self.step, desc=f"{training.algorithm} steps",
                   disable=not self.accelerator.is_main_process)
        while self.step < last:
            self.step += 1
            row = self._train_step()
            self._log(row)
            if self.step % training.checkpoint_every == 0 or self.step == training.steps:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        bar.close()
        if self.step >= training.steps:
            self.save_adapter(self.folder.adapter)
        if self._writer is not None:
            self._writer.flush()
        return self.history

    def save_adapter(self, path: Path) -> Path:
        """Save the LoRA adapter (safetensors) to ``path`` atomically."""
        if self.accelerator.is_main_process:
            with atomic_directory(path) as tmp:
                self.model.policy.save_pretrained(tmp, safe_serialization=True)
        self.accelerator.wait_for_everyone()
        return path

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN`` (:class:`~rlver_lib.checkpoint.Checkpoints`)."""
        def extras(folder: Path) -> None:
            self.model.policy.save_pretrained(CheckpointFolder(folder).adapter, safe_serialization=True)
            atomic_write_text(CheckpointFolder(folder).config, dump_config(self.cfg))

        state = {"step": self.step, "data_position": self.data_position, "algorithm": self.training.algorithm,
                 "num_processes": self.accelerator.num_processes}
        return self.checkpoints.save(self.step, state, extras)

    # ------------------------------------------------------------ one step

    def _train_step(self) -> dict[str, Any]:
        from rlver_lib.rollout import run_rollouts

        training, policy_cfg, accelerator = self.training, self.cfg.policy, self.accelerator
        start = time.perf_counter()
        step_seed = _step_seed(self.cfg.seed, self.step)
        indices, self.data_position = sample_scenario_indices(
            len(self.scenarios), self.data_position, training.scenarios_per_step, self.cfg.seed)
        shard = [self.scenarios[i] for i in indices[accelerator.process_index::accelerator.num_processes]]
        # every process samples from its own stream (rank 0's is the one-process stream)
        rollout_seed = process_seed(step_seed, accelerator.process_index)
        trajectories = run_rollouts(
            self.policy_backend, self.simulator, shard, n_per_scenario=training.group_size,
            max_turns=self.cfg.rollout.max_turns, initial_emotion=self.cfg.simulator.initial_emotion,
            think=policy_cfg.think, seed=rollout_seed, progress=False,
            max_context_tokens=policy_cfg.max_context_tokens,
            format_violation=policy_cfg.format_violation, sampling=policy_cfg.sampling(rollout_seed))
        rollout_s = time.perf_counter() - start
        rest_rollout_backend(self.policy_backend)
        self._stop_if_simulator_died(trajectories)

        rewards = {t.dialogue_id: train_reward(t, training.format_penalty, training.reward_scale)
                   for t in trajectories}
        trained = [t for t in trajectories
                   if t.samples and (t.termination != "error" or training.error_dialogues == "zero_reward")]
        samples = samples_from_trajectories(trained)
        update_start = time.perf_counter()
        score_old(self.model, samples, batch_size=scoring_batch_size(samples, training, accelerator.num_processes),
                  pad_id=self.pad_id,
                  device=accelerator.device, reference=training.kl_coef > 0)
        samples, sums, extra = assign_advantages(samples, rewards, training, self.collect)
        update = self._update(samples, step_seed)
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the rate this step's update used
        self.scheduler.step()
        update_s = time.perf_counter() - update_start
        self.policy_backend.sync_policy(self.model.policy, self.step)

        ids = {t.dialogue_id for t in trained}
        records = self.collect.gather([dict(t.to_record(), train_reward=rewards[t.dialogue_id],
                                     trained=t.dialogue_id in ids) for t in trajectories])
        if accelerator.is_main_process:
            write_jsonl(self.folder.step_dialogues_file(self.step),
                        [{k: v for k, v in r.items() if k not in ("train_reward", "trained")} | {"step": self.step}
                         for r in records])
        return step_metrics(records, sums, update, step=self.step, data_position=self.data_position,
                            num_processes=accelerator.num_processes, learning_rate=learning_rate,
                            rollout_time_s=rollout_s, update_time_s=update_s,
                            step_time_s=time.perf_counter() - start, **extra)

    def _stop_if_simulator_died(self, trajectories) -> None:
        """Raise :class:`TrainerError` on every process when any process's simulated user
        lost its backend (its server process died): the step's dialogues, those in
        flight ending in ``error``, are written first; nothing of the step is trained
        and the last checkpoint stays, so running the same command again resumes."""
        fatal = getattr(self.simulator, "fatal_error", None)
        if not int(self.collect.max(torch.tensor([float(fatal is not None)]))):
            return
        records = self.collect.gather([t.to_record() | {"step": self.step} for t in trajectories])
        if self.accelerator.is_main_process:
            write_jsonl(self.folder.step_dialogues_file(self.step, failed=True), records)
        last = self.checkpoints.latest()
        raise TrainerError(
            f"step {self.step}: the simulated user's backend died ({fatal or 'on another process'}); "
            f"nothing of this step was trained; its dialogues are in "
            f"{self.folder.step_dialogues_file(self.step, failed=True)}; "
            f"last checkpoint: {last or 'none yet'}; run the same command again to resume")

    def _update(self, samples: list[_Sample], step_seed: int) -> dict[str, float]:
        """``epochs_per_step`` passes; each pass deals the trained dialogues of all processes
        into :func:`optimizer_steps_per_epoch` windows of about ``mini_batch_size`` dialogues
        (:func:`dialogue_windows`), one optimizer step per window; each process splits its
        share of a window (all turns of its dialogues there) into ``grad_accum_steps``
        micro-batches (accelerate's ``accumulate``). Returns the step's update statistics
        over all processes (``{}`` when no process has samples)."""
        training, accelerator = self.training, self.accelerator
        accumulation = training.grad_accum_steps
        by_dialogue: dict[str, list[_Sample]] = defaultdict(list)
        for s in samples:
            by_dialogue[s.dialogue_id].append(s)
        dialogues = list(by_dialogue)
        rank, processes = accelerator.process_index, accelerator.num_processes
        counts = torch.zeros(processes, dtype=torch.float64)
        counts[rank] = len(dialogues)
        counts = self.collect.sum(counts)  # every process's trained dialogues
        total = int(counts.sum())
        if total == 0:  # every process skips alike: nobody has anything to learn from
            return {}
        n_windows = optimizer_steps_per_epoch(total, training.mini_batch_size)  # the same on every process
        offset = int(counts[:rank].sum())
        generator = torch.Generator().manual_seed(step_seed)
        totals = dict.fromkeys(_UPDATE_SUMS, 0.0)
        grad_norms: list[float] = []
        window_samples: list[float] = []
        self.prepared.train()
        for _ in range(training.epochs_per_step):
            order = torch.randperm(len(dialogues), generator=generator).tolist()
            windows: list[list[_Sample]] = [[] for _ in range(n_windows)]
            for d, w in zip(order, dialogue_windows(len(dialogues), offset, n_windows)):
                windows[w].extend(by_dialogue[dialogues[d]])
            chunks = [[window[i] for i in part] for window in windows
                      for part in np.array_split(np.arange(len(window)), accumulation)]
            sizes = self.collect.sum(window_sizes(chunks, accumulation))  # each window's loss normalisers
            for k, chunk in enumerate(chunks):
                tokens, rows = sizes[k // accumulation].tolist()
                if rows == 0:  # an empty window on every process: no optimizer step
                    continue
                batch = _collate(chunk or [empty_sample(self.pad_id)], self.pad_id, accelerator.device)
                with accelerator.accumulate(self.prepared):
                    loss, parts = micro_batch_loss(self.prepared, batch, training, tokens=tokens, rows=rows,
                                                   max_new_tokens=self.cfg.policy.max_new_tokens)
                    # accelerator.backward divides by grad_accum_steps and DDP / ZeRO average
                    # the gradients over processes; the loss's normalisers already are the
                    # whole window's, so scaling back up makes the summed gradient exactly
                    # that of the window's loss (one token mean over the global batch)
                    accelerator.backward(loss * accumulation * accelerator.num_processes)
                    if accelerator.sync_gradients:  # the window's last micro-batch
                        norm = accelerator.clip_grad_norm_(self.trainable, training.max_grad_norm)
                        if norm is not None:
                            grad_norms.append(float(norm))
                    self.optimizer.step()  # a no-op until the window is complete
                    self.optimizer.zero_grad(set_to_none=True)
                for key, value in parts.items():
                    totals[key] += value
            window_samples += [rows for _, rows in sizes.tolist() if rows > 0]
        summed = self.collect.sum(torch.tensor([totals[k] for k in _UPDATE_SUMS], dtype=torch.float64))
        update = update_metrics(dict(zip(_UPDATE_SUMS, summed.tolist())), grad_norms, training,
                                windows=len(window_samples))
        update.update(optimizer_steps=len(window_samples), samples_per_update=float(np.mean(window_samples)),
                      dialogues_per_update=total * training.epochs_per_step / len(window_samples))
        return update

    # ------------------------------------------------------------ collectives, files

    def _log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if not self.accelerator.is_main_process:
            return
        write_jsonl(self.folder.metrics, self.history)
        atomic_write_text(self.folder.metrics_csv, pd.DataFrame(self.history).to_csv(index=False))
        if self.training.tensorboard:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

                self._writer = SummaryWriter(str(self.folder.tensorboard))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, row["step"])

    def _resume(self) -> None:
        """Load the latest complete checkpoint, if any, and drop metrics logged after it."""
        path = self.checkpoints.latest()
        if path is None:
            return
        state = self.checkpoints.state(path)
        if state.get("algorithm") != self.training.algorithm:
            raise TrainerError(f"{path}: checkpoint is for {state.get('algorithm')!r}, "
                               f"config asks for {self.training.algorithm!r}")
        self.checkpoints.load(path)
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        # a fresh rollout engine must sample from the restored adapter
        self.policy_backend.sync_policy(self.model.policy, self.step)
        metrics = self.folder.metrics
        if metrics.is_file():
            self.history = [row for _, row in iter_jsonl(metrics) if row["step"] <= self.step]

