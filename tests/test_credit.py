"""Credit per turn (rlver_lib.credit, algorithms.dialogue_gae with per-turn rewards)
against hand-computed returns and advantages."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from rlver_lib import algorithms as alg
from rlver_lib import credit


def test_turn_rewards_are_the_clamped_changes_and_sum_to_final_minus_initial():
    # 50 -> 58 -> 55 -> 70: +8, -3, +15 (/100)
    assert credit.turn_rewards(50, [58, 55, 70]) == pytest.approx([0.08, -0.03, 0.15])
    assert sum(credit.turn_rewards(50, [58, 55, 70])) == pytest.approx((70 - 50) / 100)
    # emotions outside [0, 100] count as clamped: 96 -> 104 is +4, then 104 -> 90 is -10
    assert credit.turn_rewards(96, [104, 90]) == pytest.approx([0.04, -0.10])


def test_turn_rewards_of_dialogues_that_end_early():
    # success: 50 -> 80 -> 100 ends after 2 turns; failure: 30 -> 8 ends below 10
    assert credit.turn_rewards(50, [80, 100]) == pytest.approx([0.30, 0.20])
    assert credit.turn_rewards(50, [30, 8]) == pytest.approx([-0.20, -0.22])


def test_a_failed_simulator_turn_and_those_after_it_get_no_reward():
    assert credit.turn_rewards(50, [60, None, 70]) == pytest.approx([0.10])
    assert credit.turn_rewards(50, [None, 70]) == []
    with pytest.raises(ValueError, match="turn 1"):
        credit.turn_rewards(50, [60, float("nan")])


def test_policy_turn_emotions_read_the_transcript():
    opening = {"role": "user", "content": "hi"}
    said = {"role": "assistant", "content": "..."}

    def user(e, error=None):
        return {"role": "user", "content": "u", "emotion_before": None, "emotion": e, "error": error}

    assert credit.policy_turn_emotions([opening, said, user(60), said, user(54)]) == [60.0, 54.0]
    # the simulator failed on the second turn: it and the third get None
    failed = [opening, said, user(60), said, user(60, error="bad json"), said, user(70)]
    assert credit.policy_turn_emotions(failed) == [60.0, None, None]
    # a last policy turn without an appraisal (format violation) keeps the emotion
    assert credit.policy_turn_emotions([opening, said, user(60), said]) == [60.0, 60.0]


def test_rewards_to_go():
    assert credit.rewards_to_go([0.1, 0.2, -0.1]) == pytest.approx([0.2, 0.1, -0.1])
    assert credit.rewards_to_go([]) == []


def test_grpo_turn_advantages_hand_computed_with_unequal_lengths():
    rewards = [[0.1, 0.2, -0.1],   # G = [.2, .1, -.1]
               [0.3, 0.2],         # G = [.5, .2]  (ended early: emotion 100)
               [-0.2, -0.2, 0.1],  # G = [-.3, -.1, .1]
               [0.4]]              # a group of one
    adv, zero = credit.grpo_turn_advantages(rewards, ["a", "a", "a", "b"], scale_rewards=False)
    # d0: t0 .2 - mean(.5, -.3) = .1; t1 .1 - mean(.2, -.1) = .05; t2 -.1 - .1 (d1 has no t2) = -.2
    # d1: t0 .5 - mean(.2, -.3) = .55; t1 .2 - mean(.1, -.1) = .2
    # d2: t0 -.3 - mean(.2, .5) = -.65; t1 -.1 - mean(.1, .2) = -.25; t2 .1 - (-.1) = .2
    assert adv[0] == pytest.approx([0.1, 0.05, -0.2])
    assert adv[1] == pytest.approx([0.55, 0.2])
    assert adv[2] == pytest.approx([-0.65, -0.25, 0.2])
    assert adv[3] == [0.0]
    assert zero == 1
    scaled, _ = credit.grpo_turn_advantages(rewards, ["a", "a", "a", "b"], scale_rewards=True)
    s = statistics.stdev([0.2, 0.1, -0.1, 0.5, 0.2, 0.0, -0.3, -0.1, 0.1]) + 1e-4  # d1 padded with 0
    assert scaled[2] == pytest.approx([-0.65 / s, -0.25 / s, 0.2 / s])


def test_grpo_turn_advantages_when_no_other_dialogue_reached_the_turn():
    # e0 ended after one turn; at e1's second turn no other dialogue is left: baseline 0
    adv, zero = credit.grpo_turn_advantages([[0.1], [0.0, 0.1]], ["c", "c"], scale_rewards=False)
    assert adv == [pytest.approx([0.0]), pytest.approx([0.0, 0.1])] and zero == 0
    adv, zero = credit.grpo_turn_advantages([[0.1, 0.0], [0.1, 0.0]], ["c", "c"])
    assert adv == [[0.0, 0.0], [0.0, 0.0]] and zero == 1


def test_one_turn_per_turn_grpo_is_the_group_advantage_times_the_leave_one_out_factor():
    final = torch.tensor([0.55, 0.60, 0.40, 0.52])
    initial = 0.5
    reference, _ = alg.grpo_advantages(final, ["g"] * 4, scale_rewards=False)
    adv, _ = credit.grpo_turn_advantages([[float(r) - initial] for r in final], ["g"] * 4, scale_rewards=False)
    assert [a[0] for a in adv] == pytest.approx((reference * 4 / 3).tolist(), abs=1e-6)
    assert "same" in credit.one_turn_note("per_turn", "grpo")
    assert "offset" in credit.one_turn_note("per_turn", "ppo")
    assert credit.one_turn_note("final", "ppo") is None


def test_credit_rewards_of_the_three_arms():
    emotions = [58, 55, 70]
    assert credit.credit_rewards("final", 70, 50, emotions) == pytest.approx([0, 0, 0.70])
    assert credit.credit_rewards("final_minus_initial", 70, 50, emotions) == pytest.approx([0, 0, 0.20])
    assert credit.credit_rewards("per_turn", 70, 50, emotions) == pytest.approx([0.08, -0.03, 0.15])
    # reversed control and format penalty: scale every reward, penalty on the last
    assert credit.credit_rewards("per_turn", 70, 50, emotions, scale=-1, penalty=0.1) == pytest.approx(
        [-0.08, 0.03, -0.25])
    assert credit.credit_rewards("final_minus_initial", 70, 50, emotions, scale=-1) == pytest.approx([0, 0, -0.2])
    with pytest.raises(ValueError, match="final, final_minus_initial, per_turn"):
        credit.credit_rewards("per_token", 70, 50, emotions)


def test_dialogue_gae_with_per_turn_rewards_gives_reward_to_go():
    # two turns of 2 and 1 policy tokens, values 0: with γ = λ = 1 the return of every
    # token of a turn is the sum of the turn rewards from that turn on
    values = [[torch.zeros(3), torch.zeros(3)], [torch.zeros(2)]]
    masks = [[torch.tensor([0.0, 1, 1]), torch.tensor([0.0, 0, 1])], [torch.tensor([0.0, 1])]]
    adv, ret = alg.dialogue_gae(values, masks, [[0.08, -0.03], [0.2]])
    torch.testing.assert_close(ret[0][0], torch.tensor([0.0, 0.05, 0.05]))
    torch.testing.assert_close(ret[0][1], torch.tensor([0.0, 0.0, -0.03]))
    torch.testing.assert_close(ret[1][0], torch.tensor([0.0, 0.2]))
    # with values: turn 1's last token δ = r + V(next turn's first token) - V
    values = [[torch.tensor([0.0, 0.1, 0.2]), torch.tensor([0.0, 0.0, 0.3])]]
    adv, ret = alg.dialogue_gae(values, masks[:1], [[0.08, -0.03]], gamma=0.9, lam=0.5)
    a2 = -0.03 - 0.3                                  # last token: r - V
    a1 = 0.08 + 0.9 * 0.3 - 0.2 + 0.45 * a2           # end of turn 0: its reward, bootstrap turn 1
    a0 = 0.9 * 0.2 - 0.1 + 0.45 * a1
    torch.testing.assert_close(adv[0][0], torch.tensor([0.0, a0, a1]))
    torch.testing.assert_close(adv[0][1], torch.tensor([0.0, 0.0, a2]))
    with pytest.raises(ValueError, match="1 turn rewards for 2 turns"):
        alg.dialogue_gae(values, masks[:1], [[0.1]])


def test_check_credit_names_the_valid_values():
    assert credit.check_credit("per_turn") == "per_turn"
    with pytest.raises(ValueError, match="expected one of final, final_minus_initial, per_turn"):
        credit.check_credit("turn")


# ---------------------------------------------------------------- critic diagnostics

def test_between_group_share_is_the_one_way_anova_eta_squared():
    rewards = np.array([0.50, 0.52, 0.49, 0.60, 0.61, 0.40, 0.45, 0.43])
    groups = ["a", "a", "a", "b", "b", "c", "c", "c"]
    mean = rewards.mean()
    ss_between = sum((np.array(groups) == g).sum() * (rewards[np.array(groups) == g].mean() - mean) ** 2
                     for g in "abc")
    expected = ss_between / ((rewards - mean) ** 2).sum()
    assert alg.between_group_share(torch.tensor(rewards), groups) == pytest.approx(expected, rel=1e-9)
    # all the variance within groups: 0; all between: 1; no variance: NaN
    assert alg.between_group_share(torch.tensor([0.1, 0.2, 0.1, 0.2]), ["a", "a", "b", "b"]) == pytest.approx(0)
    assert alg.between_group_share(torch.tensor([0.1, 0.1, 0.3, 0.3]), ["a", "a", "b", "b"]) == pytest.approx(1)
    assert np.isnan(alg.between_group_share(torch.tensor([0.1, 0.1]), ["a", "b"]))
    with pytest.raises(ValueError, match="group ids"):
        alg.between_group_share(torch.tensor([0.1, 0.1]), ["a"])


# ---------------------------------------------------------------- the ablation grid

def test_credit_ablation_grid_has_three_arms_on_the_same_several_turn_recipe():
    from pathlib import Path

    from rlver_lib.pipeline.ablate import load_grid

    _, cells = load_grid(Path(__file__).resolve().parents[1] / "params" / "ablation-credit.yaml")
    assert sorted(c.config.training.credit for c in cells) == ["final", "final_minus_initial", "per_turn"]
    for c in cells:
        assert c.config.training.algorithm == "ppo"
        assert c.config.rollout.max_turns == c.config.evaluation.max_turns >= 3
    same = {(c.config.seed, c.config.scenarios.n_train_scenarios, c.config.scenarios.n_test_scenarios,
             c.config.evaluation.repeats, c.config.training.steps) for c in cells}
    assert len(same) == 1


def test_critic_statistics_equal_numpy_over_the_policy_tokens():
    values = torch.tensor([[0.40, 0.45, 9.0], [0.50, 0.55, 0.52]])
    returns = torch.tensor([[0.48, 0.50, 7.0], [0.47, 0.60, 0.51]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    v, r = values[mask.bool()].numpy(), returns[mask.bool()].numpy()
    got = alg.critic_statistics(alg.masked_moments(returns, mask), alg.masked_moments(values, mask),
                                alg.masked_moments(returns - values, mask))
    assert got["return_mean"] == pytest.approx(r.mean(), rel=1e-6)
    assert got["return_sd"] == pytest.approx(r.std(), rel=1e-5)
    assert got["value_mean"] == pytest.approx(v.mean(), rel=1e-6)
    assert got["value_sd"] == pytest.approx(v.std(), rel=1e-5)
    assert got["explained_variance"] == pytest.approx(1 - np.var(r - v) / np.var(r), rel=1e-5)
