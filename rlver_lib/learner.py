"""The learner's maths around :class:`~rlver_lib.trainer.Trainer` (the RLVER paper's
PPO / GRPO over multi-turn dialogues; docs/ARCHITECTURE.md "Code map").

The policy with its value head (:class:`PolicyWithValueHead`), one :class:`Sample` per
policy turn, rewards, global batch sizes and optimizer windows counted in dialogues,
the micro-batch loss, the collectives every process takes part in, and one step's
metrics row. What PPO and GRPO do differently (the critic, the advantages, their own
loss terms and metrics) each function asks of the algorithm object
(:func:`~rlver_lib.algorithm_objects.algorithm_for`). No state of its own: the
:class:`~rlver_lib.trainer.Trainer` drives these, step by step.
"""

from __future__ import annotations

import copy
import math
import resource
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from rlver_lib import algorithms, credit
from rlver_lib.algorithm_objects import algorithm_for, dialogue_turns
from rlver_lib.config import RunConfig, TrainingConfig


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
    critic model; docs/GPU.md "The shared critic"). With ``value_offset`` the values are
    ``value_head(h) + value_offset``, a buffer (not trained, saved with the model's
    state) that the trainer fixes once (``training.ppo.value_offset``).
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear | None, temperature: float, *,
                 value_offset: bool = False):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.temperature = temperature if temperature > 0 else 1.0
        if value_offset:
            self.register_buffer("value_offset", torch.zeros(()))

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
            values = self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()
            if hasattr(self, "value_offset"):
                values = values + self.value_offset
            out["values"] = scatter(values)
        return out


def build_model(cfg: RunConfig) -> tuple[PolicyWithValueHead, Any]:
    """``(model, tokenizer)``: the policy of ``cfg.policy`` with a fresh LoRA adapter (or
    its ``policy.adapter``, trainable), gradient checkpointing when asked, the
    algorithm's value head (:meth:`~rlver_lib.algorithm_objects.Algorithm.value_head`;
    PPO's, zero-initialised) and dropout switched off everywhere (as TRL's
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
    value_head = algorithm_for(cfg.training).value_head(policy.config.hidden_size)
    model = PolicyWithValueHead(policy, value_head, cfg.policy.temperature,
                                value_offset=value_head is not None and cfg.training.ppo.value_offset != "zero")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model, tokenizer


def optimizer_groups(model: PolicyWithValueHead, training: TrainingConfig) -> list[dict[str, Any]]:
    """AdamW parameter groups: the LoRA weights at ``learning_rate``, the value head
    (PPO) at ``ppo.value_learning_rate``."""
    groups = [{"params": [p for p in model.policy.parameters() if p.requires_grad], "lr": training.learning_rate}]
    if model.value_head is not None:
        groups.append({"params": list(model.value_head.parameters()), "lr": training.ppo.value_learning_rate})
    return groups


# ---------------------------------------------------------------- samples and advantages


_PER_POSITION = ("sampling_logprobs", "old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")


@dataclass
class Sample:
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


def samples_from_trajectories(trajectories: Sequence[Any]) -> list[Sample]:
    """One :class:`Sample` per policy turn of each trajectory, turns in order."""
    samples = []
    for t in trajectories:
        for turn in sorted(t.samples, key=lambda s: s.turn):
            ids = torch.tensor(turn.input_ids)
            sampling = torch.full((len(ids) - 1,), float("nan"))
            if len(turn.old_logprobs) == len(turn.completion_ids):
                start = len(turn.context_ids) - 1
                sampling[start:start + len(turn.completion_ids)] = torch.tensor(turn.old_logprobs)
            samples.append(Sample(t.dialogue_id, t.group_id, turn.turn, ids,
                                   torch.tensor(turn.loss_mask[1:], dtype=torch.float32), sampling))
    return samples


def credit_turn_rewards(trajectories: Sequence[Any], training: TrainingConfig) -> dict[str, list[float]] | None:
    """Each dialogue's rewards per policy turn under ``training.credit``
    (:func:`~rlver_lib.credit.credit_rewards`, scaled by ``reward_scale``, the format
    penalty on the last turn); ``None`` under ``final``, whose dialogue reward
    (:func:`train_reward`) goes on the last token as before. An ``error`` dialogue
    keeps, under ``per_turn``, the rewards of the turns before the simulator failed;
    under ``final_minus_initial`` it gets 0s (trained only with ``error_dialogues: zero_reward``)."""
    if training.credit == "final":
        return None
    rewards = {}
    for t in trajectories:
        emotions = credit.policy_turn_emotions(t.transcript)
        if t.termination == "error" and training.credit != "per_turn":
            rewards[t.dialogue_id] = [0.0] * len(emotions)
            continue
        rewards[t.dialogue_id] = credit.credit_rewards(
            training.credit, t.final_emotion, t.initial_emotion, emotions, scale=training.reward_scale,
            penalty=training.format_penalty if t.format_violations else 0.0)
    return rewards


def rewarded_turns(samples: list[Sample], turn_rewards: dict[str, list[float]]) -> tuple[list[Sample], int]:
    """The samples of turns that have a reward (a dialogue's first ``len(turn_rewards[d])``
    turns) and the number of turns left out: those on or after a failed simulator turn,
    not trained as a change of 0."""
    kept, dropped = [], 0
    for d, ordered in dialogue_turns(samples).items():
        n = len(turn_rewards[d])
        kept.extend(ordered[:n])
        dropped += len(ordered[n:])
    return kept, dropped


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


def batch_notes(training: TrainingConfig, num_processes: int) -> list[str]:
    """Batch settings that run but waste work, each with its remedy (empty when none).

    Each process splits its ``mini_batch_size / num_processes`` dialogues of an
    optimizer step (all their turns) into ``grad_accum_steps`` micro-batches. With fewer
    dialogues than micro-batches, a dialogue shorter than ``grad_accum_steps /
    (dialogues a process)`` turns leaves micro-batches without a sample, and each still
    runs a zero-weight forward and backward pass (every process must join every
    collective): e.g. PPO with 8 dialogues an optimizer step on 8 GPUs and
    ``grad_accum_steps: 4`` (docs/GPU.md section 4)."""
    share = training.mini_batch_size // num_processes
    if share and training.grad_accum_steps > share:
        return [f"training.grad_accum_steps={training.grad_accum_steps} micro-batches for the {share} "
                f"dialogue(s) each of the {num_processes} process(es) holds of an optimizer step "
                f"(training.mini_batch_size {training.mini_batch_size}): dialogues of fewer than "
                f"{math.ceil(training.grad_accum_steps / share)} turns leave micro-batches empty, and each "
                f"still runs a zero-weight forward and backward pass; set training.grad_accum_steps={share} "
                f"(the gradient is the same)"]
    return []


def optimizer_steps_per_epoch(dialogues: int, mini_batch_size: int) -> int:
    """Optimizer steps of one pass over ``dialogues`` trained dialogues (all processes):
    ``ceil(dialogues / mini_batch_size)``. All of a step's dialogues make
    ``scenarios_per_step x group_size / mini_batch_size``; GRPO groups without signal
    and dropped error dialogues make fewer, each still of about ``mini_batch_size``."""
    if dialogues < 0 or mini_batch_size < 1:
        raise ValueError(f"need dialogues >= 0 and mini_batch_size >= 1, got {dialogues}, {mini_batch_size}")
    return math.ceil(dialogues / mini_batch_size)


def scoring_batch_size(samples: Sequence[Sample], training: TrainingConfig, num_processes: int) -> int:
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


def window_sizes(chunks: Sequence[Sequence[Sample]], accumulation: int) -> torch.Tensor:
    """``[windows, 2]`` float64: the policy tokens and the samples of each window of
    ``accumulation`` consecutive micro-batches (``chunks``) on this process; summed over
    processes they are the window's loss normalisers."""
    return torch.tensor([[sum(float(s.mask.sum()) for chunk in chunks[w:w + accumulation] for s in chunk),
                          sum(len(chunk) for chunk in chunks[w:w + accumulation])]
                         for w in range(0, len(chunks), accumulation)], dtype=torch.float64).reshape(-1, 2)


def empty_sample(pad_id: int) -> Sample:
    """A zero-weight micro-batch (no policy token) for a process with no samples left."""
    return Sample("", "", 0, torch.tensor([pad_id, pad_id]), torch.zeros(1))


def collate(samples: Sequence[Sample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
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
def score_old(model: PolicyWithValueHead, samples: list[Sample], *, batch_size: int, pad_id: int,
              device: torch.device, reference: bool) -> None:
    """Set old log-probs, old values (PPO) and, with ``reference``, reference log-probs
    (the adapter disabled) of each sample: local forward passes of the unwrapped model,
    ``batch_size`` samples at a time, no collectives."""
    model.eval()
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        batch = collate(chunk, pad_id, device)
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


def explained_variance_after(model: PolicyWithValueHead, samples: list[Sample], collect: Collectives, *,
                             batch_size: int, pad_id: int, device: torch.device) -> float:
    """PPO: the explained variance of the critic after the step's updates, on the same
    samples and returns as the step's ``explained_variance`` (before them): one more
    forward pass of the unwrapped model, no gradient, over every process's samples."""
    after = [copy.copy(s) for s in samples]
    score_old(model, after, batch_size=batch_size, pad_id=pad_id, device=device, reference=False)
    zero = torch.zeros(3, dtype=torch.float64)
    returns = sum((algorithms.masked_moments(s.returns, s.mask) for s in samples), zero)
    residuals = sum((algorithms.masked_moments(s.returns - a.old_values, s.mask) for s, a in zip(samples, after)),
                    zero)
    total = collect.sum(torch.cat([returns, residuals]))
    return algorithms.explained_variance_from_moments(total[:3], total[3:])


def micro_batch_loss(prepared: nn.Module, batch: dict[str, torch.Tensor], training: TrainingConfig, *,
                 max_new_tokens: int, tokens: float, rows: float,
                 critic_only: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The micro-batch's share of its window's loss (the shared terms here, the algorithm's
    own in :meth:`~rlver_lib.algorithm_objects.Algorithm.loss_terms`) and its local sums
    for the metrics (keys :data:`UPDATE_SUMS` and the algorithm's ``update_sums``);
    ``tokens``/``rows``: the window's policy tokens and samples over all processes, the
    normalisers of every term. ``critic_only`` (a critic warm-up step) leaves the policy,
    entropy and KL terms out of the loss; their metrics are still summed."""
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
    if critic_only:
        loss = torch.zeros((), device=loss.device)
    loss, own = algorithm_for(training).loss_terms(loss, out, batch, training, tokens=tokens)
    parts.update(own)
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


def assign_advantages(samples: list[Sample], rewards: dict[str, float], training: TrainingConfig,
                      collect: Collectives, turn_rewards: dict[str, list[float]] | None = None,
                      ) -> tuple[list[Sample], dict[str, float], dict[str, float]]:
    """Advantages for ``samples`` (:meth:`~rlver_lib.algorithm_objects.Algorithm.assign_advantages`;
    PPO's returns too); returns the samples to train on, the step's sample statistics
    summed over processes, and the critic's statistics
    (:meth:`~rlver_lib.algorithm_objects.Algorithm.critic_statistics`) and largest
    sampling log-prob gap over processes. ``turn_rewards`` (:func:`credit_turn_rewards`,
    ``None`` under ``training.credit: final``) replaces ``rewards`` with rewards per turn."""
    algorithm = algorithm_for(training)
    failed_turns = 0
    if turn_rewards is not None:
        samples, failed_turns = rewarded_turns(samples, turn_rewards)
    gaps = [algorithms.logprob_gap(s.old_logprobs, s.sampling_logprobs, s.mask) for s in samples]
    samples, zero_variance, groups = algorithm.assign_advantages(samples, rewards, turn_rewards, training, collect)
    names = ("samples", "policy_tokens", "train_tokens", "zero_variance_groups", "groups", "gap_sum", "gap_count",
             "failed_turns")
    local = torch.cat([torch.tensor([
        len(samples), sum(float(s.mask.sum()) for s in samples),
        sum(s.input_ids.numel() for s in samples) * training.epochs_per_step, zero_variance, groups,
        sum(float(g[0]) for g in gaps), sum(float(g[2]) for g in gaps), failed_turns], dtype=torch.float64),
        algorithm.critic_moments(samples)])
    total = collect.sum(local)
    k = len(names)
    sums = dict(zip(names, total[:k].tolist()))
    extra = {"logprob_gap_max": float(collect.max(torch.tensor([max([float(g[1]) for g in gaps] + [0.0])])))}
    extra.update(algorithm.critic_statistics(total[k:]))
    return samples, sums, extra


def update_metrics(total: dict[str, float], grad_norms: list[float], training: TrainingConfig, *,
                   windows: int) -> dict[str, float]:
    """The update's metrics from the sums of :func:`micro_batch_loss` over every micro-batch
    and process: losses as means over optimizer steps (``windows``), the rest as means
    over policy tokens; ``grad_norm`` the mean over optimizer steps; the algorithm's own
    (:meth:`~rlver_lib.algorithm_objects.Algorithm.update_metrics`)."""
    tokens = max(total["tokens"], 1.0)
    update = {"policy_loss": total["policy_loss"] / windows, "entropy": total["entropy"] / tokens,
              "approx_kl_old": total["approx_kl_old"] / tokens, "clip_fraction": total["clipped"] / tokens,
              "grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan")}
    if training.kl_coef > 0:
        update["kl_ref"] = total["kl_ref"] / tokens
    update.update(algorithm_for(training).update_metrics(total, windows=windows, tokens=tokens))
    if training.is_correction:
        update["is_weight_mean"] = total["is_weight"] / tokens
        update["is_capped_fraction"] = total["is_capped"] / tokens
    return update


UPDATE_SUMS = ("policy_loss", "tokens", "entropy", "approx_kl_old", "clipped", "kl_ref", "is_weight", "is_capped")
"""The sums of :func:`micro_batch_loss` every algorithm has (its own: ``update_sums``)."""


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
    user = [x for r in records for x in r["transcript"] if x.get("role") == "user" and "emotion" in x]
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
        "reply_cut_rate": sum(bool(x.get("cut")) for x in assistant) / max(1, len(assistant)),
        "context_limit_rate": sum(r["termination"] == "context_limit" for r in records) / n,
        "user_history_shortened_rate": sum((x.get("history_dropped") or 0) > 0 for x in user) / max(1, len(user)),
        "zero_variance_group_share": sums["zero_variance_groups"] / sums["groups"] if sums["groups"] else 0.0,
        "completion_tokens_mean": sums["policy_tokens"] / max(1.0, sums["samples"]),
        "reply_chars_mean": float(np.mean([len(x.get("content") or "") for x in assistant])) if assistant else 0.0,
        "thought_chars_mean": float(np.mean([len(x.get("thought") or "") for x in assistant])) if assistant else 0.0,
        "samples": int(sums["samples"]),
        "learning_rate": fields["learning_rate"],
        "explained_variance": fields.get("explained_variance", nan),
        "explained_variance_after": fields.get("explained_variance_after", nan),
        **{k: fields.get(k, nan) for k in ("return_mean", "return_sd", "value_mean", "value_sd")},
        "reward_between_group_share": (algorithms.between_group_share(
            torch.tensor(reward), [r["group_id"] for r in records]) if len(reward) else nan),
        "failed_turns": int(sums.get("failed_turns", 0)),
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
