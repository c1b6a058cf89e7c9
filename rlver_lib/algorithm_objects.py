"""One object per training algorithm, chosen once by name (``training.algorithm``;
docs/ARCHITECTURE.md "Code map").

What PPO and GRPO do differently sits in one class each, its loss in view (as in
CleanRL): the critic (a value head or none), how advantages are assigned to the
policy tokens, the loss terms only it has and the metrics they give. The learner's
shared path (:mod:`rlver_lib.learner`) asks :func:`algorithm_for` and never compares
the algorithm's name; the tensor maths is :mod:`rlver_lib.algorithms`. Adding an
algorithm is one subclass of :class:`Algorithm` and one line of :data:`ALGORITHMS`.

Samples are the learner's :class:`~rlver_lib.learner.Sample` (one policy turn;
per-position tensors ``[L-1]``) and ``collect`` its
:class:`~rlver_lib.learner.Collectives`; this module imports neither (the learner
imports this one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from typing import Any, ClassVar

import torch
from torch import nn

from rlver_lib import algorithms, credit
from rlver_lib.config import TrainingConfig


def dialogue_turns(samples: list[Any]) -> dict[str, list[Any]]:
    """``{dialogue id: its samples, turns in order}``, dialogues in order of first appearance."""
    by_dialogue: dict[str, list[Any]] = defaultdict(list)
    for s in samples:
        by_dialogue[s.dialogue_id].append(s)
    return {d: sorted(group, key=lambda s: s.turn) for d, group in by_dialogue.items()}


def grpo_sample_advantages(samples: list[Any], rewards: dict[str, float], *,
                           scale_rewards: bool) -> tuple[list[Any], int, int]:
    """GRPO: every policy token of every turn carries its dialogue's group-normalised
    advantage (``[L-1]``, 0 off the policy tokens). Returns ``(kept samples,
    zero-variance groups, groups)``; samples of zero-variance groups are left out
    (:func:`~rlver_lib.algorithms.informative_groups`)."""
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


def grpo_turn_sample_advantages(samples: list[Any], turn_rewards: dict[str, list[float]], *,
                                scale_rewards: bool) -> tuple[list[Any], int, int]:
    """GRPO with ``training.credit: per_turn``: the tokens of turn ``t`` carry
    :func:`~rlver_lib.credit.grpo_turn_advantages` at ``t``. Returns as
    :func:`grpo_sample_advantages`; samples of zero-variance groups are left out."""
    turns = dialogue_turns(samples)
    dialogues = list(turns)
    groups = [turns[d][0].group_id for d in dialogues]
    advantages, zero_variance = credit.grpo_turn_advantages(
        [turn_rewards[d][:len(turns[d])] for d in dialogues], groups, scale_rewards=scale_rewards)
    informative = {g for g, a in zip(groups, advantages) if any(a)}
    kept = []
    for d, g, adv in zip(dialogues, groups, advantages):
        for s, a in zip(turns[d], adv):
            s.advantages = s.mask * a
        if g in informative:
            kept.extend(turns[d])
    return kept, zero_variance, len(set(groups))


def ppo_sample_advantages(samples: list[Any], rewards: dict[str, float] | dict[str, list[float]], *,
                          gamma: float, lam: float) -> None:
    """PPO: GAE over each dialogue's policy tokens, its turns chained in order
    (:func:`~rlver_lib.algorithms.dialogue_gae`; RLVER §3.3); sets ``advantages`` and
    ``returns`` (``[L-1]``) from ``old_values``. ``rewards``: a dialogue's reward on its
    last policy token, or its rewards per turn (``training.credit``)."""
    turns = list(dialogue_turns(samples).values())
    advantages, returns = algorithms.dialogue_gae(
        [[s.old_values for s in dialogue] for dialogue in turns], [[s.mask for s in dialogue] for dialogue in turns],
        [rewards[dialogue[0].dialogue_id] for dialogue in turns], gamma=gamma, lam=lam)
    for dialogue, adv, ret in zip(turns, advantages, returns):
        for s, a, r in zip(dialogue, adv, ret):
            s.advantages, s.returns = a, r


class Algorithm(ABC):
    """What one training algorithm adds to the learner's shared path; stateless, the
    settings come in as ``training`` (a :class:`~rlver_lib.config.TrainingConfig`).

    The defaults are those of an algorithm without a critic. A subclass sets
    :attr:`name` (its ``training.algorithm``), :attr:`label` and :meth:`assign_advantages`, and an
    algorithm with a critic overrides the critic's methods as :class:`PPO` does.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    """How a report names the algorithm (``"PPO"``)."""
    critic: ClassVar[bool] = False
    """Whether the policy carries a value head (and the step logs the critic's diagnostics)."""
    update_sums: ClassVar[tuple[str, ...]] = ()
    """The keys this algorithm adds to a micro-batch's sums (:meth:`loss_terms`), beside
    the learner's ``UPDATE_SUMS``."""

    def value_head(self, hidden_size: int) -> nn.Linear | None:
        """The critic on the backbone's last hidden state ``[..., hidden_size]``, or ``None``."""
        return None

    def critic_warmup_steps(self, training: TrainingConfig) -> int:
        """How many first training steps train the critic alone (0: none)."""
        return 0

    @abstractmethod
    def assign_advantages(self, samples: list[Any], rewards: dict[str, float],
                          turn_rewards: dict[str, list[float]] | None, training: TrainingConfig,
                          collect: Any) -> tuple[list[Any], int, int]:
        """Set each sample's ``advantages`` (and what else its loss needs). ``rewards``:
        each dialogue's reward; ``turn_rewards``: its rewards per policy turn under
        ``training.credit`` (``None`` under ``final``). Returns ``(samples to train on,
        zero-variance groups, groups)``, the counts summed over processes by the caller."""

    def critic_moments(self, samples: list[Any]) -> torch.Tensor:
        """This process's float64 sums for :meth:`critic_statistics` (``[0]``: none)."""
        return torch.zeros(0, dtype=torch.float64)

    def critic_statistics(self, total: torch.Tensor) -> dict[str, float]:
        """The step's critic diagnostics from :meth:`critic_moments` summed over processes."""
        return {}

    def loss_terms(self, loss: torch.Tensor, out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor],
                   training: TrainingConfig, *, tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
        """``loss`` (the shared policy, entropy and KL terms) plus this algorithm's own
        terms, and their local sums (keys :attr:`update_sums`). ``out``: the model's
        ``[B, L-1]`` outputs; ``batch``: the collated micro-batch; ``tokens``: the
        window's policy tokens over all processes (the normaliser)."""
        return loss, {}

    def update_metrics(self, total: dict[str, float], *, windows: int, tokens: float) -> dict[str, float]:
        """The update's metrics of this algorithm's terms from the sums of :meth:`loss_terms`
        over every micro-batch and process (losses per optimizer step, the rest per token)."""
        return {}


class GRPO(Algorithm):
    """GRPO (Shao et al. 2024 §4.1, outcome supervision; the RLVER paper's GRPO runs):
    no critic; a dialogue's reward normalised within its scenario's group is the
    advantage of every policy token of the dialogue, and groups whose rewards are all
    equal are left out. With ``training.credit: per_turn``, turn ``t`` carries the
    group-normalised reward-to-go at ``t`` (:func:`~rlver_lib.credit.grpo_turn_advantages`)."""

    name = "grpo"
    label = "GRPO"

    def assign_advantages(self, samples: list[Any], rewards: dict[str, float],
                          turn_rewards: dict[str, list[float]] | None, training: TrainingConfig,
                          collect: Any) -> tuple[list[Any], int, int]:
        """:func:`grpo_turn_sample_advantages` under ``per_turn`` credit, else
        :func:`grpo_sample_advantages` on the dialogue rewards (a dialogue's turn rewards
        summed under ``final_minus_initial``)."""
        if training.credit == "per_turn":
            return grpo_turn_sample_advantages(samples, turn_rewards, scale_rewards=training.scale_rewards)
        dialogue_rewards = rewards if turn_rewards is None else {d: sum(r) for d, r in turn_rewards.items()}
        return grpo_sample_advantages(samples, dialogue_rewards, scale_rewards=training.scale_rewards)


class PPO(Algorithm):
    """PPO (RLVER §3.3): a linear value head on the shared LoRA backbone
    (:class:`~rlver_lib.learner.PolicyWithValueHead`), GAE across a dialogue's turns
    (``training.ppo.gamma``, ``training.ppo.lam``), advantages whitened over every process's
    policy tokens (``training.ppo.whiten_advantages``), and the clipped value loss
    (``training.ppo.vf_coef`` x :func:`~rlver_lib.algorithms.clipped_value_loss`, clipped at
    ``training.ppo.value_clip_eps``)."""

    name = "ppo"
    label = "PPO"
    critic = True
    update_sums = ("value_loss", "value_clipped")

    def value_head(self, hidden_size: int) -> nn.Linear:
        """``Linear(hidden_size, 1)``, zero-initialised: the first advantages are then the
        (whitened) returns, not the noise of a random critic over the backbone's large
        hidden states."""
        head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    def critic_warmup_steps(self, training: TrainingConfig) -> int:
        """``training.ppo.critic_warmup_steps``."""
        return training.ppo.critic_warmup_steps

    def assign_advantages(self, samples: list[Any], rewards: dict[str, float],
                          turn_rewards: dict[str, list[float]] | None, training: TrainingConfig,
                          collect: Any) -> tuple[list[Any], int, int]:
        """:func:`ppo_sample_advantages` (every sample is trained; no groups), then, with
        ``whiten_advantages``, whitening with moments summed over processes (a collective)."""
        ppo_sample_advantages(samples, rewards if turn_rewards is None else turn_rewards,
                              gamma=training.ppo.gamma, lam=training.ppo.lam)
        if training.ppo.whiten_advantages:  # over every process's policy tokens
            moments = collect.sum(sum((algorithms.masked_moments(s.advantages, s.mask) for s in samples),
                                      torch.zeros(3, dtype=torch.float64)))
            for s in samples:
                s.advantages = algorithms.whiten_with_moments(s.advantages, s.mask, moments)
        return samples, 0, 0

    def critic_moments(self, samples: list[Any]) -> torch.Tensor:
        """``[9]``: :func:`~rlver_lib.algorithms.masked_moments` of the returns, the
        residuals ``returns - old_values`` and the old values, summed over ``samples``."""
        zero = torch.zeros(3, dtype=torch.float64)
        return torch.cat([sum((algorithms.masked_moments(s.returns, s.mask) for s in samples), zero),
                          sum((algorithms.masked_moments(s.returns - s.old_values, s.mask) for s in samples), zero),
                          sum((algorithms.masked_moments(s.old_values, s.mask) for s in samples), zero)])

    def critic_statistics(self, total: torch.Tensor) -> dict[str, float]:
        """:func:`~rlver_lib.algorithms.critic_statistics` of the summed ``[9]`` moments."""
        return algorithms.critic_statistics(total[0:3], total[6:9], total[3:6])

    def loss_terms(self, loss: torch.Tensor, out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor],
                   training: TrainingConfig, *, tokens: float) -> tuple[torch.Tensor, dict[str, float]]:
        """``loss + vf_coef x`` the clipped value loss of ``out["values"]`` against
        ``batch["returns"]`` around ``batch["old_values"]`` (all ``[B, L-1]``); sums
        ``value_loss`` and ``value_clipped`` (clipped tokens)."""
        mask = batch["mask"]
        value_loss, value_clip = algorithms.clipped_value_loss(
            out["values"], batch["old_values"], batch["returns"], mask, clip_eps=training.ppo.value_clip_eps,
            normaliser=tokens)
        return (loss + training.ppo.vf_coef * value_loss,
                {"value_loss": float(value_loss.detach()), "value_clipped": float(value_clip) * float(mask.sum())})

    def update_metrics(self, total: dict[str, float], *, windows: int, tokens: float) -> dict[str, float]:
        """``value_loss`` (mean over optimizer steps) and ``value_clip_fraction`` (per token)."""
        return {"value_loss": total["value_loss"] / windows, "value_clip_fraction": total["value_clipped"] / tokens}


ALGORITHMS: dict[str, Algorithm] = {"grpo": GRPO(), "ppo": PPO()}
"""The algorithms by their ``training.algorithm`` name."""


def algorithm_for(training: TrainingConfig) -> Algorithm:
    """The :data:`ALGORITHMS` object of ``training.algorithm``: the one place the name is read."""
    return ALGORITHMS[training.algorithm]
