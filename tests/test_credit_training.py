"""training.credit wired into the trainer, end to end with the rule simulator on 3-turn
dialogues: where the per-turn rewards land, what a failed simulator turn does, the
one-turn warning and the config's error."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from rlver_lib import credit
from rlver_lib import trainer as trainer_module
from rlver_lib.config import ConfigError
from rlver_lib.params import build_config
from rlver_lib.simulator import RuleSimulator, SimulatorTurn
from rlver_lib.trainer import Trainer
from tests.training_support import hashed_change, tiny_config, tiny_scenarios


def _spy(monkeypatch):
    """Capture the trajectories, turn rewards and trained samples of each step."""
    seen: dict = {}
    real_rewards, real_assign = trainer_module.credit_turn_rewards, trainer_module.assign_advantages

    def rewards(trajectories, training):
        seen["trajectories"] = list(trajectories)
        seen["turn_rewards"] = real_rewards(trajectories, training)
        return seen["turn_rewards"]

    def assign(samples, dialogue_rewards, training, collect, turn_rewards=None):
        out = real_assign(samples, dialogue_rewards, training, collect, turn_rewards)
        seen["samples"] = out[0]
        return out

    monkeypatch.setattr(trainer_module, "credit_turn_rewards", rewards)
    monkeypatch.setattr(trainer_module, "assign_advantages", assign)
    return seen


def _three_turn(tmp_path, name, **training):
    cfg = tiny_config(tmp_path, name, steps=1, scenarios_per_step=2, group_size=2, mini_batch_size=4, **training)
    cfg.rollout.max_turns = 3
    cfg.policy.dtype = "float32"
    return cfg


def _one_step(tmp_path, simulator, name, **training):
    """One training step of the 3-turn config; returns what :func:`_spy` saw and the step's row."""
    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        seen = _spy(monkeypatch)
        trainer = Trainer(_three_turn(tmp_path, name, **training), tiny_scenarios(2), simulator=simulator)
        return seen, trainer.train()[0]


def _by_dialogue(samples):
    out = defaultdict(list)
    for s in samples:
        out[s.dialogue_id].append(s)
    return {d: sorted(v, key=lambda s: s.turn) for d, v in out.items()}


class _FailsOnSecondTurn(RuleSimulator):
    """The rule simulator, except that dialogue ``s0#0``'s appraisal fails on its second turn."""

    def step(self, requests):
        turns = super().step(requests)
        return [SimulatorTurn(r.dialogue_id, None, None, r.emotion, r.emotion, "B", {}, None, False, error="outage")
                if r.dialogue_id == "s0#0" and sum(m["role"] == "assistant" for m in r.history) == 2 else t
                for r, t in zip(requests, turns)]


@pytest.fixture(scope="module")
def ppo_per_turn(tmp_path_factory):
    """One PPO step with per-turn credit on 3-turn dialogues; dialogue ``s0#0``'s simulated
    user fails on its second turn (the others play out)."""
    return _one_step(tmp_path_factory.mktemp("ppo"), _FailsOnSecondTurn(hashed_change), "ppo-turns",
                     algorithm="ppo", credit="per_turn")


@pytest.mark.slow
def test_ppo_per_turn_rewards_sit_on_each_turns_last_token_and_sum_to_the_change(ppo_per_turn):
    seen, row = ppo_per_turn
    # the critic's diagnostics are logged (their formulas: tests/test_credit.py)
    for key in ("explained_variance", "explained_variance_after", "return_mean", "return_sd", "value_mean",
                "value_sd"):
        assert math.isfinite(row[key]), key
    assert row["explained_variance_after"] != row["explained_variance"]  # the update moved the values
    assert 0.0 <= row["reward_between_group_share"] <= 1.0
    samples = _by_dialogue(seen["samples"])
    assert max(len(v) for v in samples.values()) >= 2  # several turns were played
    played = [t for t in seen["trajectories"] if t.termination != "error"]
    assert len(played) == 3
    for t in played:
        rewards = seen["turn_rewards"][t.dialogue_id]
        assert len(rewards) == len(t.samples)
        assert sum(rewards) == pytest.approx((t.final_emotion - t.initial_emotion) / 100)
        # γ = λ = 1: the return of every policy token of turn k is the sum of the turn
        # rewards from k on, whatever the values; constant within a turn, so each turn's
        # reward sits on its last token (on the first, the turn's later tokens would miss it)
        for s, g in zip(samples[t.dialogue_id], credit.rewards_to_go(rewards)):
            on = s.mask.bool()
            torch.testing.assert_close(s.returns[on], torch.full((int(on.sum()),), g), atol=1e-5, rtol=0)
            assert bool((s.returns[~on] == 0).all())


@pytest.mark.slow
def test_a_failed_turn_and_after_are_not_trained_and_are_counted(ppo_per_turn):
    seen, row = ppo_per_turn
    failed = next(t for t in seen["trajectories"] if t.dialogue_id == "s0#0")
    assert failed.termination == "error" and len(failed.samples) == 2
    assert len(seen["turn_rewards"]["s0#0"]) == 1  # only the turn before the failure has a reward
    assert [s.turn for s in _by_dialogue(seen["samples"])["s0#0"]] == [failed.samples[0].turn]
    assert row["failed_turns"] == 1


@pytest.mark.slow
def test_grpo_per_turn_advantages_are_reward_to_go_against_the_other_dialogues(tmp_path):
    seen, _ = _one_step(tmp_path, RuleSimulator(hashed_change), "grpo-turns", credit="per_turn",
                        scale_rewards=False)
    samples = _by_dialogue(seen["samples"])
    for scenario in ("s0", "s1"):
        a, b = f"{scenario}#0", f"{scenario}#1"
        if a not in samples:  # a zero-variance group is left out
            continue
        ga, gb = (credit.rewards_to_go(seen["turn_rewards"][d]) for d in (a, b))
        for k, s in enumerate(samples[a]):  # a group of two: the baseline is the other one's, or 0
            expected = ga[k] - (gb[k] if k < len(gb) else 0.0)
            on = s.mask.bool()
            torch.testing.assert_close(s.advantages[on], torch.full((int(on.sum()),), expected), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_per_turn_credit_on_one_turn_dialogues_runs_with_a_warning(tmp_path):
    torch.set_num_threads(2)
    cfg = tiny_config(tmp_path, "one-turn", credit="per_turn", steps=1)
    with pytest.warns(UserWarning, match="same signal as 'final'"):
        trainer = Trainer(cfg, tiny_scenarios(1), simulator=RuleSimulator(hashed_change))
    assert len(trainer.train()) == 1


def test_an_unknown_credit_is_an_error_naming_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="per_turn"):
        build_config({"run_name": "x", "output_root": str(tmp_path), "training": {"credit": "per_token"}})
