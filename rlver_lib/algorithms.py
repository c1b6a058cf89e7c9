"""Advantage estimators and losses of the learner: the RLVER paper's PPO and GRPO
(docs/ARCHITECTURE.md "algorithms, trainer").

Pure tensor functions, no model and no state. Conventions used throughout:

- ``B`` rows (samples), ``T`` token positions, ``V`` vocabulary size.
- ``mask`` is ``[B, T]`` with 1 on tokens the policy generated (the only tokens that
  carry loss) and 0 on system/user/template tokens and padding. Any dtype; it is
  converted to the values' dtype.
- Log-probabilities are natural logs (nats); rewards are in ``[0, 1]`` (emotion / 100)
  but nothing here depends on that range.
- Every function raises :class:`ValueError` on mismatched shapes or bad settings.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1.

    ``values`` and ``mask`` have the same shape. With ``dim=None`` the result is a
    scalar; otherwise the mean along ``dim`` (rows with no masked-in position give 0).
    """
    _check_same_shape(values=values, mask=mask)
    mask = mask.to(values.dtype)
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance (scalar) of ``values`` over the mask positions."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` ``[B, T]`` shifted and scaled to zero mean, unit variance over the mask
    positions (advantage normalisation of PPO implementations, e.g. Huang et al. 2022
    "The 37 implementation details of PPO", detail 7). Masked positions come back 0."""
    _check_same_shape(values=values, mask=mask)
    whitened = (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened * mask


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token_mean``: sum over all policy tokens of the batch / their count (every
      token weighs the same; DAPO / TRL ``bnpo``; Liu et al. 2025 "Dr. GRPO" argue
      against per-sequence length normalisation).
    - ``seq_mean``: mean over policy tokens of each row, then mean over rows (the
      original GRPO objective, Shao et al. 2024 §4.1 eq. 3; TRL ``loss_type="grpo"``).
      Rows without policy tokens count as 0, as in TRL.
    """
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean":
        return masked_mean(per_token, mask, dim=-1).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}; expected 'token_mean' or 'seq_mean'")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under ``logits``.

    ``logits`` ``[B, L, V]`` from a causal LM on ``input_ids`` ``[B, L]``. Returns
    ``[B, L - 1]``: entry ``t`` is ``log p(input_ids[t + 1] | input_ids[:t + 1])``, so it
    aligns with ``loss_mask[:, 1:]``. Computed in float32.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = -Σ_v p_v log p_v`` in nats of each categorical in ``logits`` ``[..., V]``.

    Returns ``[...]`` (float32). Range ``[0, log V]``.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"] = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ || π_ref)`` from samples of π_θ.

    Estimators from J. Schulman, "Approximating KL divergence" (2020), with
    ``log r = log π_ref(x) - log π_θ(x)``:

    - ``k1 = -log r`` (unbiased, can be negative),
    - ``k3 = (r - 1) - log r`` (unbiased, always ≥ 0; the GRPO paper's eq. 4 term).

    Shapes ``[B, T]`` in, ``[B, T]`` out. The reference is the same model with the
    LoRA adapter disabled.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    scale_rewards: bool = True,
    eps: float = 1e-4,
) -> tuple[torch.Tensor, int]:
    """Group-normalised advantages (GRPO, Shao et al. 2024 §4.1, "outcome supervision").

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` with the unbiased sample std
    (as TRL's GRPOTrainer); with ``scale_rewards=False`` the std division is dropped
    (Dr. GRPO, Liu et al. 2025): ``A_i = r_i - mean(r_group)``.

    ``rewards`` ``[N]`` (one per dialogue), ``group_ids`` ``N`` labels (dialogues from
    the same scenario share a label). Returns ``(advantages [N], zero_variance_groups)``
    where the count is the number of groups whose rewards are all equal (their
    advantages are exactly 0: they carry no signal). A group of one is such a group.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    labels = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(labels) != rewards.numel():
        raise ValueError(f"{len(labels)} group ids for {rewards.numel()} rewards")
    if eps <= 0:
        raise ValueError("eps must be > 0")
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    zero_variance = 0
    for label in dict.fromkeys(labels):
        idx = torch.tensor([i for i, g in enumerate(labels) if g == label], device=rewards.device)
        group = rewards[idx].float()
        if bool((group == group[0]).all()):
            zero_variance += 1
            continue
        centred = group - group.mean()
        advantages[idx] = centred / (group.std() + eps) if scale_rewards else centred
    return advantages, zero_variance


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over policy tokens (Schulman et al. 2016, eq. 16).

    ``δ_t = r_t + γ V(s_{t'}) - V(s_t)``, ``A_t = δ_t + γλ A_{t'}``, where ``t'`` is the
    **next policy-token position** after ``t`` in the same row (not ``t + 1``): user and
    template tokens (``mask == 0``) are not actions, so they are skipped and the chain
    jumps over them. A whole multi-turn dialogue laid out in one row therefore chains
    the last token of turn k to the first token of turn k+1, which is what makes the
    dialogue-end reward flow back to earlier turns. After the last policy token of a
    row the episode ends (``V = 0``, ``A = 0``).

    ``rewards``, ``values``, ``mask``: ``[B, T]``. The reward of a dialogue sits at its
    last policy token; rewards at masked positions must be 0 (otherwise they would
    be lost silently), else :class:`ValueError`.

    Returns ``(advantages, returns)``, both ``[B, T]``, 0 at masked positions;
    ``returns = advantages + values`` on policy tokens (the critic's regression target).
    Computed without gradient.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    if rewards.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(rewards.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma}, {lam}")
    with torch.no_grad():
        m = mask.to(torch.float32)
        r, v = rewards.float(), values.float()
        if bool(((r != 0) & (m == 0)).any()):
            raise ValueError("rewards found at masked (non-policy) positions")
        advantages = torch.zeros_like(r)
        next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
        next_adv = torch.zeros_like(next_value)
        for t in reversed(range(r.shape[1])):
            delta = r[:, t] + gamma * next_value - v[:, t]
            adv_t = delta + gamma * lam * next_adv
            on = m[:, t] > 0
            advantages[:, t] = torch.where(on, adv_t, torch.zeros_like(adv_t))
            next_value = torch.where(on, v[:, t], next_value)
            next_adv = torch.where(on, adv_t, next_adv)
        returns = (advantages + v) * m
    return advantages, returns


@dataclass
class PolicyLossOutput:
    """Result of :func:`clipped_policy_loss`: the scalar ``loss`` (with grad),
    ``clip_fraction`` (share of policy tokens where the clip is active, in [0, 1])
    and ``approx_kl`` (k3 estimate of KL(π_old || π_θ), nats/token)."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    aggregation: Aggregation = "token_mean",
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised.

    ``ρ_t = exp(logπ_θ - logπ_old)``; per token ``-min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t)``,
    reduced over policy tokens with :func:`aggregate`. Used by both PPO (``A`` from
    :func:`gae`) and GRPO (``A`` from :func:`grpo_advantages`, broadcast to tokens;
    ``[B]`` advantages are accepted and broadcast).

    ``logprobs`` (with grad), ``old_logprobs``, ``mask``: ``[B, T]``; ``advantages``
    ``[B, T]`` or ``[B]``.
    """
    if clip_eps <= 0:
        raise ValueError("clip_eps must be > 0")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    loss = aggregate(-torch.min(unclipped, clipped), mask, aggregation)
    with torch.no_grad():
        active = ((ratio < 1.0 - clip_eps) & (advantages < 0)) | ((ratio > 1.0 + clip_eps) & (advantages > 0))
        clip_fraction = masked_mean(active.float(), mask)
        approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, mask)
    return PolicyLossOutput(loss, clip_fraction, approx_kl)


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss (PPO2 style, as in OpenAI baselines / TRL's former PPO trainer).

    ``V_clip = V_old + clip(V - V_old, -ε, ε)``;
    per token ``½ max((V - R)², (V_clip - R)²)``, averaged over policy tokens only
    (``mask``), never over user/template positions. All ``[B, T]``.

    Returns ``(loss, clip_fraction)`` — the scalar loss (with grad) and the share of
    policy tokens where the clipped term is the larger one.
    """
    if clip_eps <= 0:
        raise ValueError("clip_eps must be > 0")
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        clip_fraction = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clip_fraction


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over policy tokens; 1 is a perfect critic, ≤ 0 a
    useless one; NaN when the returns have zero variance. ``[B, T]`` inputs."""
    _check_same_shape(values=values, returns=returns, mask=mask)
    var_r = masked_var(returns.float(), mask)
    if float(var_r) == 0.0:
        return float("nan")
    return float(1.0 - masked_var((returns - values).float(), mask) / var_r)
