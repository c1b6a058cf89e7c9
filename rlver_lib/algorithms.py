"""Advantage estimators and losses of the learner: the RLVER paper's PPO and GRPO
(docs/ARCHITECTURE.md "Code map").

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

Aggregation = Literal["token_mean", "seq_mean", "dr_grpo"]


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


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[count, sum, sum of squares]`` (float64) of ``values`` over the mask positions.

    Moments add up: the moments of a batch split across processes are the sum of
    each part's, so a distributed caller all-reduces them (sum) and passes the total
    to :func:`whiten_with_moments`.
    """
    _check_same_shape(values=values, mask=mask)
    m = mask.to(torch.float64)
    v = values.detach().to(torch.float64)
    return torch.stack([m.sum(), (v * m).sum(), (v * v * m).sum()])


def moments_mean_var(moments: torch.Tensor) -> tuple[float, float]:
    """Mean and population variance described by :func:`masked_moments` (``(0, 0)``
    for no positions). Variances below float64 rounding of the mean count as 0."""
    count, total, squares = (float(x) for x in moments)
    if count <= 0:
        return 0.0, 0.0
    mean = total / count
    var = squares / count - mean * mean
    return mean, var if var > 1e-12 * (mean * mean + 1e-12) else 0.0


def whiten_with_moments(values: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor,
                        eps: float = 1e-8) -> torch.Tensor:
    """``values`` shifted and scaled by the mean and population variance that
    ``moments`` (from :func:`masked_moments`, possibly summed over processes)
    describe; masked positions come back 0."""
    _check_same_shape(values=values, mask=mask)
    mean, var = moments_mean_var(moments)
    return (values - mean) * (var + eps) ** -0.5 * mask.to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` ``[B, T]`` shifted and scaled to zero mean, unit variance over the mask
    positions (advantage normalisation of PPO implementations, e.g. Huang et al. 2022
    "The 37 implementation details of PPO", detail 7). Masked positions come back 0."""
    return whiten_with_moments(values, mask, masked_moments(values, mask), eps)


def aggregation_numerator(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation) -> torch.Tensor:
    """The summed part of :func:`aggregate`: ``Σ`` of the masked per-token values
    (``token_mean``, ``dr_grpo``) or ``Σ`` over rows of each row's masked mean (``seq_mean``).
    Numerators of micro-batches add up to the numerator of their whole batch."""
    _check_same_shape(per_token=per_token, mask=mask)
    if mode in ("token_mean", "dr_grpo"):
        return (per_token * mask.to(per_token.dtype)).sum()
    if mode == "seq_mean":
        return masked_mean(per_token, mask, dim=-1).sum()
    raise ValueError(f"unknown loss aggregation {mode!r}; expected 'token_mean', 'seq_mean' or 'dr_grpo'")


def aggregation_denominator(mode: Aggregation, *, tokens: float, rows: float,
                            max_tokens: int | None = None) -> float:
    """What :func:`aggregate` divides by: the number of policy ``tokens``
    (``token_mean``), of ``rows`` (``seq_mean``), or the constant
    ``rows * max_tokens`` (``dr_grpo``, ``max_tokens`` = the completion budget). At least 1."""
    if mode == "token_mean":
        return max(float(tokens), 1.0)
    if mode == "seq_mean":
        return max(float(rows), 1.0)
    if mode == "dr_grpo":
        if not max_tokens or max_tokens < 1:
            raise ValueError("dr_grpo aggregation needs max_tokens >= 1 (the completion budget)")
        return max(float(rows), 1.0) * max_tokens
    raise ValueError(f"unknown loss aggregation {mode!r}; expected 'token_mean', 'seq_mean' or 'dr_grpo'")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, *,
              normaliser: float | None = None, max_tokens: int | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar: :func:`aggregation_numerator` /
    ``normaliser``.

    - ``token_mean``: sum over all policy tokens of the batch / their count (every
      token weighs the same; DAPO / TRL ``bnpo``).
    - ``seq_mean``: mean over policy tokens of each row, then mean over rows (the
      original GRPO objective, Shao et al. 2024 §4.1 eq. 3; TRL ``loss_type="grpo"``).
      Rows without policy tokens count as 0, as in TRL.
    - ``dr_grpo``: sum over all policy tokens / (rows × ``max_tokens``), a constant
      that does not depend on the replies' lengths (Liu et al. 2025 "Understanding
      R1-Zero-like training", Dr. GRPO; TRL ``loss_type="dr_grpo"``).

    ``normaliser`` defaults to this batch's :func:`aggregation_denominator`; a caller
    that accumulates micro-batches passes the whole optimizer batch's (all
    micro-batches and processes), so the micro-batch losses sum to the batch loss.
    """
    if normaliser is None:
        normaliser = aggregation_denominator(mode, tokens=float(mask.sum()), rows=mask.shape[0],
                                             max_tokens=max_tokens)
    return aggregation_numerator(per_token, mask, mode) / normaliser


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[ids]`` in float32: the log-probability of each id.

    ``logits`` ``[..., V]``, ``ids`` ``[...]`` (same leading shape); returns ``[...]``.
    Computed as ``logit - logsumexp`` so no ``[..., V]`` log-softmax is kept for backward.
    """
    if logits.shape[:-1] != ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match ids {tuple(ids.shape)}")
    logits = logits.float()
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under ``logits``.

    ``logits`` ``[B, L, V]`` from a causal LM on ``input_ids`` ``[B, L]``. Returns
    ``[B, L - 1]``: entry ``t`` is ``log p(input_ids[t + 1] | input_ids[:t + 1])``, so it
    aligns with ``loss_mask[:, 1:]``. Computed in float32.
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match input_ids {tuple(input_ids.shape)}")
    return gather_logprobs(logits[:, :-1], input_ids[:, 1:])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = -Σ_v p_v log p_v`` in nats of each categorical in ``logits`` ``[..., V]``.

    Returns ``[...]`` (float32). Range ``[0, log V]``.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


LOGIT_CHUNK_ROWS = 256
"""Token positions whose full-vocabulary logits :func:`chunked_logprobs_and_entropy`
holds at once (a few ``[256, V]`` float32 tensors: ~50 MB each for SmolLM2's 49k
vocabulary, ~156 MB for Qwen2.5's 152k)."""


def _chunk_logprobs_and_entropy(hidden: torch.Tensor, ids: torch.Tensor, head, temperature: float,
                                entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = -sum p (x - lse) = lse - sum p x: one [n, V] product, no log-softmax copy
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, ent


def chunked_logprobs_and_entropy(hidden: torch.Tensor, head, ids: torch.Tensor, *, temperature: float = 1.0,
                                 entropy: bool = True, entropy_grad: bool = True,
                                 chunk_rows: int = LOGIT_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``ids`` and entropies (nats) of the categoricals
    ``softmax(head(hidden) / temperature)``, ``chunk_rows`` positions at a time.

    ``hidden`` ``[N, H]`` (the backbone's last hidden states at the scored positions),
    ``head`` maps ``[n, H]`` to ``[n, V]`` logits (the LM head), ``ids`` ``[N]``. Returns
    ``(logprobs [N], entropy [N] or None)`` in float32; ``entropy=False`` skips the
    entropy (scoring old log-probs needs none); ``entropy_grad=False`` returns it
    without gradient.

    Memory: the float32 ``[N, V]`` logits never exist at once. Each chunk's logits are
    computed, reduced to log-prob and entropy, and freed (the log-prob as ``logit -
    logsumexp``, TRL's ``selective_log_softmax``; the entropy as ``logsumexp - Σ p·logit``).
    With gradient each chunk runs under ``torch.utils.checkpoint``: autograd keeps only
    ``hidden`` and recomputes the chunk's logits in backward, so the learner's peak
    is a few ``[chunk_rows, V]`` tensors instead of several ``[N, V]`` ones (one LM-head
    matmul more per chunk in backward).
    """
    if hidden.dim() != 2 or ids.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and ids {tuple(ids.shape)}: expected [N, H] and [N]")
    if temperature <= 0 or chunk_rows < 1:
        raise ValueError(f"need temperature > 0 and chunk_rows >= 1, got {temperature}, {chunk_rows}")
    if hidden.shape[0] == 0:  # no position: empty results, still attached to the graph of ``hidden``
        empty = hidden.float().sum(-1) * 0.0
        return empty, (empty.clone() if entropy else None)
    recompute = torch.is_grad_enabled() and (hidden.requires_grad
                                             or any(p.requires_grad for p in getattr(head, "parameters", list)()))
    logprobs, entropies = [], []
    for h, i in zip(hidden.split(chunk_rows), ids.split(chunk_rows)):
        if recompute:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk_logprobs_and_entropy, h, i, head, temperature, entropy, entropy_grad,
                                 use_reentrant=False, preserve_rng_state=False)
        else:
            lp, ent = _chunk_logprobs_and_entropy(h, i, head, temperature, entropy, entropy_grad)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs), (torch.cat(entropies) if entropy else None)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"] = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(π_θ || π_ref)`` from samples of π_θ.

    Estimators from J. Schulman, "Approximating KL divergence" (2020), with
    ``log r = log π_ref(x) - log π_θ(x)``:

    - ``k1 = -log r`` (unbiased, can be negative),
    - ``k3 = (r - 1) - log r`` (unbiased, always ≥ 0; the GRPO paper's eq. 4 term).

    Shapes ``[B, T]`` in, ``[B, T]`` out. The reference is the same model with the
    LoRA adapter disabled (the base model, also when a run starts from
    ``policy.adapter``).

    As a *loss* term only ``k3`` works: the gradient of ``k1 = log π_θ - log π_ref``
    is ``∇ log π_θ``, whatever the reference, and its expectation under π_θ is 0, so
    ``kl_coef * k1`` pulls nothing towards π_ref (the config refuses
    ``kl_estimator: k1`` with ``kl_coef > 0``). ``k1`` remains a valid value estimate.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected 'k1' or 'k3'")


def informative_groups(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: True for members of groups whose rewards are not all equal.

    The other groups (a group of one included) get advantage exactly 0 from
    :func:`grpo_advantages` and carry no policy-gradient signal; the learner leaves
    them out of the loss so they do not dilute the token mean (DAPO's dynamic-sampling
    filter, Yu et al. 2025 §3.2, without the resampling).
    """
    labels = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if rewards.dim() != 1 or len(labels) != rewards.numel():
        raise ValueError(f"{len(labels)} group ids for rewards of shape {tuple(rewards.shape)}")
    keep = torch.zeros(len(labels), dtype=torch.bool)
    for label in dict.fromkeys(labels):
        idx = [i for i, g in enumerate(labels) if g == label]
        group = rewards[idx]
        keep[idx] = not bool((group == group[0]).all())
    return keep


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


def _turn_end_rewards(dialogue: int, reward: float | Sequence[float] | torch.Tensor,
                      counts: list[int]) -> list[tuple[int, float]]:
    """``(position in the dialogue's row of policy tokens, reward)`` pairs: a scalar
    ``reward`` at the last policy token, one reward per turn at each turn's last."""
    if not isinstance(reward, (Sequence, torch.Tensor)) or (isinstance(reward, torch.Tensor) and reward.dim() == 0):
        return [(sum(counts) - 1, float(reward))] if sum(counts) else []
    per_turn = [float(r) for r in reward]
    if len(per_turn) != len(counts):
        raise ValueError(f"dialogue {dialogue}: {len(per_turn)} turn rewards for {len(counts)} turns")
    pairs, end = [], 0
    for k, (n, r) in enumerate(zip(counts, per_turn)):
        end += n
        if n == 0 and r != 0:
            raise ValueError(f"dialogue {dialogue}: turn {k} has a reward but no policy token")
        if n:
            pairs.append((end - 1, r))
    return pairs


def dialogue_gae(
    values: Sequence[Sequence[torch.Tensor]],
    masks: Sequence[Sequence[torch.Tensor]],
    rewards: Sequence[float | Sequence[float]] | torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """PPO advantages for dialogues whose policy turns are separate samples.

    ``values[d][k]`` and ``masks[d][k]`` (``[T_dk]``): old values and policy-token mask
    of turn ``k`` of dialogue ``d``, turns in order; ``rewards[d]``: either the
    dialogue's reward (RLVER: final emotion / 100), placed at its last policy token,
    or one reward per turn (``training.credit: per_turn``, :mod:`rlver_lib.credit`),
    each placed at the last policy token of its turn. The policy
    tokens of all turns of a dialogue are laid out in one row, in turn order, and
    :func:`gae` runs over the rows, so the chain crosses turn boundaries: the last
    token of turn ``k`` bootstraps from the first token of turn ``k + 1``.

    Returns ``(advantages, returns)`` in the layout of ``values`` (0 off the mask).
    A dialogue without policy tokens gets zeros.
    """
    if not (len(values) == len(masks) == len(rewards)):
        raise ValueError(f"{len(values)} value lists, {len(masks)} mask lists, {len(rewards)} rewards")
    rows, placed = [], []
    for d, (turn_values, turn_masks) in enumerate(zip(values, masks)):
        if len(turn_values) != len(turn_masks):
            raise ValueError(f"dialogue {d}: {len(turn_values)} value tensors for {len(turn_masks)} masks")
        for v, m in zip(turn_values, turn_masks):
            _check_same_shape(values=v, mask=m)
        rows.append(torch.cat([v[m.bool()].float() for v, m in zip(turn_values, turn_masks)])
                    if turn_values else torch.zeros(0))
        placed.append(_turn_end_rewards(d, rewards[d], [int(m.bool().sum()) for m in turn_masks]))
    width = max([len(r) for r in rows] + [1])
    flat_values = torch.zeros(len(rows), width)
    flat_mask = torch.zeros(len(rows), width)
    flat_rewards = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        flat_values[i, :len(row)] = row
        flat_mask[i, :len(row)] = 1.0
        for position, reward in placed[i]:
            flat_rewards[i, position] += reward
    adv, ret = gae(flat_rewards, flat_values, flat_mask, gamma=gamma, lam=lam)
    advantages: list[list[torch.Tensor]] = []
    returns: list[list[torch.Tensor]] = []
    for i, turn_masks in enumerate(masks):
        offset, adv_turns, ret_turns = 0, [], []
        for m in turn_masks:
            sel = m.bool()
            n = int(sel.sum())
            a, r = torch.zeros(m.shape), torch.zeros(m.shape)
            a[sel], r[sel] = adv[i, offset:offset + n], ret[i, offset:offset + n]
            adv_turns.append(a)
            ret_turns.append(r)
            offset += n
        advantages.append(adv_turns)
        returns.append(ret_turns)
    return advantages, returns


def truncated_is_weights(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
                         cap: float = 3.0) -> torch.Tensor:
    """Truncated importance-sampling weights for a rollout engine that samples from a
    slightly different distribution than the learner scores (vLLM vs the training
    forward pass): ``w_t = min(exp(log π_old(trainer) - log π_sampling), cap)``.

    Token-level truncated IS (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"; TRL ``vllm_importance_sampling_mode=
    "token_truncate"`` with ``vllm_importance_sampling_clip_max``). All ``[B, T]``;
    returns ``[B, T]`` without gradient, 1 off the mask and where a sampling log-prob
    is NaN (unavailable). ``cap`` > 0.
    """
    if cap <= 0:
        raise ValueError("cap must be > 0")
    _check_same_shape(old_logprobs=old_logprobs, sampling_logprobs=sampling_logprobs, mask=mask)
    diff = torch.nan_to_num((old_logprobs.detach() - sampling_logprobs.detach()) * mask.to(old_logprobs.dtype),
                            nan=0.0)
    return torch.clamp(torch.exp(diff), max=cap)


def logprob_gap(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Σ |Δ|, max |Δ|, count)`` over policy tokens of ``Δ = log π_old(trainer) -
    log π_sampling`` (nats): the training-inference mismatch of a rollout engine.
    Sums and counts so that a caller can add them over batches and processes."""
    _check_same_shape(old_logprobs=old_logprobs, sampling_logprobs=sampling_logprobs, mask=mask)
    sel = mask.bool() & ~torch.isnan(sampling_logprobs)
    gap = (old_logprobs - sampling_logprobs).abs()[sel]
    zero = torch.zeros((), dtype=torch.float64)
    return (gap.double().sum() if gap.numel() else zero, gap.double().max() if gap.numel() else zero,
            torch.tensor(float(gap.numel()), dtype=torch.float64))


@dataclass
class PolicyLossOutput:
    """Result of :func:`clipped_policy_loss`: the scalar ``loss`` (with grad),
    ``clip_fraction`` (share of policy tokens where the clip is active, in [0, 1])
    and ``approx_kl`` (k3 estimate of KL(π_old || π_θ), nats/token); both means over
    this batch's policy tokens."""

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
    normaliser: float | None = None,
    max_tokens: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised.

    ``ρ_t = exp(logπ_θ - logπ_old)``; per token ``-min(ρ_t A_t, clip(ρ_t, 1-ε, 1+ε) A_t)``,
    times ``is_weights`` when given (:func:`truncated_is_weights`), reduced over
    policy tokens with :func:`aggregate` (``normaliser``, ``max_tokens`` as there).
    Used by both PPO (``A`` from :func:`gae`) and GRPO (``A`` from
    :func:`grpo_advantages`, broadcast to tokens; ``[B]`` advantages are accepted).

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
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        _check_same_shape(logprobs=logprobs, is_weights=is_weights)
        per_token = per_token * is_weights.detach()
    loss = aggregate(per_token, mask, aggregation, normaliser=normaliser, max_tokens=max_tokens)
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
    normaliser: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped critic loss (PPO2 style, as in OpenAI baselines / TRL's former PPO trainer).

    ``V_clip = V_old + clip(V - V_old, -ε, ε)``;
    per token ``½ max((V - R)², (V_clip - R)²)``, averaged over policy tokens only
    (``mask``), never over user/template positions; with ``normaliser`` the sum is
    divided by it instead of this batch's token count. All ``[B, T]``.

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
    loss = 0.5 * aggregate(torch.max(loss_unclipped, loss_clipped), mask, "token_mean", normaliser=normaliser)
    with torch.no_grad():
        clip_fraction = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    return loss, clip_fraction


def explained_variance_from_moments(return_moments: torch.Tensor, residual_moments: torch.Tensor) -> float:
    """:func:`explained_variance` from the :func:`masked_moments` of the returns and
    of the residuals ``R - V`` (summed over processes by a distributed caller)."""
    var_r = moments_mean_var(return_moments)[1]
    if var_r == 0.0:
        return float("nan")
    return 1.0 - moments_mean_var(residual_moments)[1] / var_r


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over policy tokens; 1 is a perfect critic, ≤ 0 a
    useless one; NaN when the returns have zero variance. ``[B, T]`` inputs."""
    _check_same_shape(values=values, returns=returns, mask=mask)
    return explained_variance_from_moments(masked_moments(returns.float(), mask),
                                           masked_moments((returns - values).float(), mask))


def between_group_share(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> float:
    """Share of the rewards' variance that lies between groups (scenarios): the one-way
    ANOVA ``η² = SS_between / SS_total`` with ``SS_between = Σ_g n_g (mean_g - mean)²``
    and ``SS_total = Σ_i (r_i - mean)²``.

    ``rewards`` ``[N]`` (one per dialogue), ``group_ids`` ``N`` labels. In [0, 1]; NaN
    when all rewards are equal. A critic that sees the scenario but cannot tell two
    replies to it apart explains at most this share of the returns' variance, so it
    bounds the explained variance a young critic can reach.
    """
    labels = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if rewards.dim() != 1 or len(labels) != rewards.numel():
        raise ValueError(f"{len(labels)} group ids for rewards of shape {tuple(rewards.shape)}")
    r = rewards.detach().double()
    total = float(((r - r.mean()) ** 2).sum()) if r.numel() else 0.0
    if total <= 1e-24:
        return float("nan")
    between = 0.0
    for label in dict.fromkeys(labels):
        group = r[[i for i, g in enumerate(labels) if g == label]]
        between += group.numel() * float(group.mean() - r.mean()) ** 2
    return between / total


def critic_statistics(return_moments: torch.Tensor, value_moments: torch.Tensor,
                      residual_moments: torch.Tensor) -> dict[str, float]:
    """The critic's per-step diagnostics from :func:`masked_moments` of the returns, the
    values and the residuals ``R - V`` over policy tokens (summed over processes by a
    distributed caller): ``return_mean``, ``return_sd``, ``value_mean``, ``value_sd``
    (population s.d., reward units) and ``explained_variance``
    (:func:`explained_variance_from_moments`)."""
    return_mean, return_var = moments_mean_var(return_moments)
    value_mean, value_var = moments_mean_var(value_moments)
    return {"return_mean": return_mean, "return_sd": return_var ** 0.5, "value_mean": value_mean,
            "value_sd": value_var ** 0.5,
            "explained_variance": explained_variance_from_moments(return_moments, residual_moments)}
