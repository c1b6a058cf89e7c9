"""Credit assignment over the policy turns of a dialogue (``training.credit``;
docs/ARCHITECTURE.md "Credit per turn").

Three ways to turn a dialogue into rewards on policy tokens:

- ``final``: the RLVER paper's reward (§3), the final emotion / 100, on the last
  policy token of the dialogue.
- ``final_minus_initial``: (final - initial emotion) / 100 on the last policy token.
  For GRPO it is the same as ``final`` (every dialogue of a group starts at the same
  emotion); for PPO it removes the offset the critic must otherwise learn. It
  separates a gain from credit per turn from a gain from the critic's offset.
- ``per_turn``: the emotion change each policy turn caused, / 100, on that turn's
  last token (:func:`turn_rewards`). The turn rewards sum to (final - initial) / 100.
  PPO runs GAE over them (:func:`rlver_lib.algorithms.dialogue_gae`), GRPO compares
  reward-to-go at the same turn index (:func:`grpo_turn_advantages`).

Emotions are on the simulator's 0-100 scale; rewards are emotion / 100. Plain
Python numbers in and out (no model, no state); :class:`ValueError` on bad input.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

Credit = Literal["final", "final_minus_initial", "per_turn"]
CREDITS: tuple[str, ...] = ("final", "final_minus_initial", "per_turn")


def check_credit(credit: str) -> Credit:
    """``credit`` if it is one of :data:`CREDITS`, else :class:`ValueError` naming them."""
    if credit not in CREDITS:
        raise ValueError(f"unknown training.credit {credit!r}; expected one of {', '.join(CREDITS)}")
    return credit  # type: ignore[return-value]


_ONE_TURN_PER_TURN = {
    "grpo": ("training.credit: per_turn with one-turn dialogues: for GRPO it is the same signal as "
             "'final' (one turn's reward-to-go is final - initial, and every dialogue of a group starts "
             "at the same emotion); the leave-one-out baseline scales the advantages by N/(N-1)"),
    "ppo": ("training.credit: per_turn with one-turn dialogues: for PPO it differs from 'final' only by the "
            "initial emotion's offset (the reward is (final - initial) / 100 instead of final / 100)"),
}


def one_turn_note(credit: str, algorithm: str) -> str | None:
    """The warning for ``per_turn`` credit on one-turn dialogues (``rollout.max_turns: 1``)
    under the algorithm named ``algorithm`` (:attr:`rlver_lib.algorithm_objects.Algorithm.name`),
    or ``None`` when there is nothing to say."""
    return _ONE_TURN_PER_TURN[algorithm] if credit == "per_turn" else None


def _clamp(emotion: float) -> float:
    return max(0.0, min(100.0, float(emotion)))


def policy_turn_emotions(transcript: Sequence[Mapping[str, Any]]) -> list[float | None]:
    """The emotion after each policy turn of a dialogue record's ``transcript``
    (docs/ARCHITECTURE.md "Run folder"), one entry per ``assistant`` entry, in order.

    The emotion is that of the next ``user`` entry (the simulator's appraisal of the
    turn). ``None`` where that entry carries an ``error`` (the simulator failed) and
    for every policy turn after it. A policy turn without a user entry after it (the
    dialogue ended on a format violation) leaves the emotion where it was.
    """
    emotions: list[float | None] = []
    current: float | None = None
    failed = False
    pending = False
    for entry in transcript:
        if entry.get("role") == "assistant":
            if pending:
                emotions.append(None if failed else current)
            pending = True
        elif entry.get("role") == "user" and "emotion" in entry:
            failed = failed or entry.get("error") is not None or entry.get("emotion") is None
            if not failed:
                current = float(entry["emotion"])
            if pending:
                emotions.append(None if failed else current)
                pending = False
    if pending:
        emotions.append(None if failed else current)
    return emotions


def turn_rewards(initial_emotion: float, emotions_after: Sequence[float | None]) -> list[float]:
    """Reward of each policy turn: the emotion change it caused / 100.

    ``emotions_after[t]``: the emotion after policy turn ``t`` (0-100; ``None`` where
    the simulator failed, e.g. from :func:`policy_turn_emotions`; a missing value for
    the first turns is the initial emotion). Turn ``t``'s reward is
    ``(clamp(e_t) - clamp(e_{t-1})) / 100`` with ``e_{-1}`` = ``initial_emotion``
    and clamp into [0, 100], so the rewards sum to ``(clamp(e_last) - clamp(initial)) / 100``.

    Returns one reward per turn **before the first failed one**: a failed turn and
    every turn after it get no reward (the caller leaves them out of training rather
    than train them as a change of 0, and counts them: ``len(emotions_after) - len(result)``).
    """
    rewards: list[float] = []
    previous = _clamp(initial_emotion)
    for emotion in emotions_after:
        if emotion is None:
            break
        if not math.isfinite(float(emotion)):
            raise ValueError(f"turn {len(rewards)}: emotion {emotion!r} is not a finite number")
        rewards.append((_clamp(emotion) - previous) / 100.0)
        previous = _clamp(emotion)
    return rewards


def rewards_to_go(rewards: Sequence[float]) -> list[float]:
    """``G_t = Σ_{k ≥ t} r_k`` (undiscounted Monte Carlo return of each turn)."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running += float(rewards[t])
        out[t] = running
    return out


def grpo_turn_advantages(
    turn_rewards_by_dialogue: Sequence[Sequence[float]],
    group_ids: Sequence[Hashable],
    *,
    scale_rewards: bool = True,
    eps: float = 1e-4,
) -> tuple[list[list[float]], int]:
    """Per-turn GRPO advantages: reward-to-go minus a leave-one-out baseline at the same turn index.

    ``turn_rewards_by_dialogue[i]``: the rewards of dialogue ``i``'s trained turns
    (:func:`turn_rewards`; dialogues may differ in length); ``group_ids[i]``: its
    group (the scenario). With ``G_{i,t}`` the reward-to-go (:func:`rewards_to_go`):

    ``A_{i,t} = G_{i,t} - mean{G_{j,t} : j ≠ i in i's group, dialogue j has a turn t}``.

    - **Ended early**: a dialogue that ended before turn ``t`` (emotion reached 100 or
      fell below 10, a goodbye, a failed simulator) is left out of the baseline at
      ``t``; when no other dialogue of the group reached turn ``t`` the baseline is 0,
      the reward-to-go of a dialogue that has ended (its emotion no longer changes).
    - A group of one has no comparison: advantages 0, counted as a zero-variance group,
      as in :func:`rlver_lib.algorithms.grpo_advantages`. So is a group whose
      advantages all come out 0.
    - ``scale_rewards``: every advantage of a group is divided by one number, the
      unbiased s.d. of the group's ``G_{i,t}`` over all dialogues and all turn indices
      up to the group's longest dialogue (0 after a dialogue's end) + ``eps``.
      One scale per group, never per turn: rewards are not normalised turn by turn
      and then summed, which is biased when the length depends on the policy.

    Source: the Monte Carlo returns over turns with a group baseline at each turn
    index of MAPO (Zhang et al. 2026, "Mixed Advantage Policy Optimization for
    Long-Horizon Multi-Turn Dialogue", arXiv 2603.06194). Departures: the baseline
    is the leave-one-out mean (RLOO, Ahmadian et al. 2024), so a dialogue's own
    return never enters its baseline, instead of MAPO's turn-level mean/s.d.
    normalisation mixed with a batch-level one; the only scaling is the one group
    s.d. above. With one-turn dialogues ``A_i = N/(N-1) (r_i - mean r)`` (before
    scaling), the GRPO advantage times the leave-one-out factor.

    Returns ``(advantages, zero_variance_groups)``: ``advantages[i]`` has one value
    per trained turn of dialogue ``i``.
    """
    if len(turn_rewards_by_dialogue) != len(group_ids):
        raise ValueError(f"{len(group_ids)} group ids for {len(turn_rewards_by_dialogue)} dialogues")
    if eps <= 0:
        raise ValueError("eps must be > 0")
    returns = [rewards_to_go(r) for r in turn_rewards_by_dialogue]
    advantages = [[0.0] * len(g) for g in returns]
    zero_variance = 0
    labels = list(group_ids)
    for label in dict.fromkeys(labels):
        members = [i for i, g in enumerate(labels) if g == label]
        if len(members) < 2:
            zero_variance += 1
            continue
        centred = {}
        for i in members:
            for t, g in enumerate(returns[i]):
                others = [returns[j][t] for j in members if j != i and len(returns[j]) > t]
                centred[i, t] = g - (sum(others) / len(others) if others else 0.0)
        if not any(centred.values()):
            zero_variance += 1
            continue
        scale = 1.0
        if scale_rewards:
            width = max(len(returns[i]) for i in members)
            pooled = [returns[i][t] if t < len(returns[i]) else 0.0 for i in members for t in range(width)]
            mean = sum(pooled) / len(pooled)
            scale = math.sqrt(sum((x - mean) ** 2 for x in pooled) / (len(pooled) - 1)) + eps
        for (i, t), a in centred.items():
            advantages[i][t] = a / scale
    return advantages, zero_variance


def credit_rewards(credit: str, final_emotion: float, initial_emotion: float,
                   emotions_after: Sequence[float | None], *, scale: float = 1.0,
                   penalty: float = 0.0) -> list[float]:
    """The rewards of a dialogue's trained policy turns under ``credit``, one per turn.

    ``final``: ``final_emotion / 100`` on the last turn; ``final_minus_initial``:
    ``(final_emotion - initial_emotion) / 100`` there; ``per_turn``:
    :func:`turn_rewards` (a failed turn and those after it are not in the result).
    Every reward is multiplied by ``scale`` (``training.reward_scale``; -1 is the
    reversed control) and ``penalty`` (``training.format_penalty`` when a turn broke
    the format) is subtracted from the last one, so the rewards always sum to the
    dialogue's scaled reward minus the penalty. ``emotions_after``:
    :func:`policy_turn_emotions`; no turns give ``[]``.
    """
    credit = check_credit(credit)
    if credit == "per_turn":
        rewards = turn_rewards(initial_emotion, emotions_after)
    elif not emotions_after:
        rewards = []
    else:
        offset = initial_emotion if credit == "final_minus_initial" else 0.0
        rewards = [0.0] * (len(emotions_after) - 1) + [(float(final_emotion) - offset) / 100.0]
    rewards = [scale * r for r in rewards]
    if rewards and penalty:
        rewards[-1] -= penalty
    return rewards
