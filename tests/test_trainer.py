"""The learner: sampler, launch checks, advantages and accumulation by hand, and the
real embedded SmolLM2 policy with a deterministic rule simulator.

Runtime on an idle 2-core machine (2 threads): about 15-20 s per learning test and
about 10 s for each other model test.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from training_support import FakeAccelerator, hashed_change, starts_with_i, tiny_config, tiny_scenarios

from rlver_lib import algorithms
from rlver_lib.algorithm_objects import grpo_sample_advantages, ppo_sample_advantages
from rlver_lib.config import EMBEDDED_POLICY, ConfigError
from rlver_lib.files import iter_jsonl
from rlver_lib.learner import (
    Sample,
    batch_notes,
    batch_problems,
    dialogue_windows,
    optimizer_steps_per_epoch,
    samples_from_trajectories,
    score_old,
    step_metrics,
    train_reward,
    window_sizes,
)
from rlver_lib.params import build_config, load_config
from rlver_lib.simulator import RuleSimulator
from rlver_lib.trainer import (
    Trainer,
    TrainerError,
    check_launch,
    configure_deepspeed,
    lr_scheduler,
    process_seed,
    sample_scenario_indices,
)


def _schedule(n: int, count: int, seed: int, steps: int, position: int = 0) -> list[tuple[int, list[int]]]:
    """``(start position, indices)`` of ``steps`` consecutive steps."""
    out = []
    for _ in range(steps):
        indices, new_position = sample_scenario_indices(n, position, count, seed)
        out.append((position, indices))
        position = new_position
    return out


def _check_schedule(n: int, count: int, seed: int, steps: int) -> None:
    schedule = _schedule(n, count, seed, steps)
    per_epoch: dict[int, list[int]] = {}
    for position, indices in schedule:
        assert len(indices) == count and len(set(indices)) == count, (n, count, seed, position, indices)
        assert all(0 <= i < n for i in indices)
        per_epoch.setdefault(position // n if position % n + count <= n else position // n + 1, []).extend(indices)
    for epoch, seen in list(per_epoch.items())[:-1]:  # every complete epoch: no scenario twice
        assert len(seen) == len(set(seen)) == count * (n // count), (n, count, seed, epoch)
    # resumable: restarting from any recorded position replays the rest exactly
    for k in (1, steps // 2, steps - 1):
        assert _schedule(n, count, seed, steps - k, position=schedule[k][0]) == schedule[k:]


@pytest.mark.parametrize("n,count,seed,steps", [
    (500, 32, 0, 300), (500, 32, 1, 300), (500, 32, 2, 300),  # the paper recipes' sizes
    (3, 2, 3, 20),
])
def test_sampler_never_repeats_a_scenario_within_a_step(n, count, seed, steps):
    _check_schedule(n, count, seed, steps)


def test_sampler_property_over_many_sizes_and_seeds():
    for n in range(1, 14):
        for count in range(1, n + 1):
            for seed in range(4):
                _check_schedule(n, count, seed, steps=3 * (n // count) + 2)


def test_sampler_is_a_pure_function_of_position_and_seed():
    first, pos = sample_scenario_indices(5, 0, 3, seed=1)
    second, pos2 = sample_scenario_indices(5, pos, 3, seed=1)
    assert pos == 3 and pos2 == 8  # the 2-scenario tail of epoch 0 is skipped: epoch 1 starts at 5
    assert sorted(first) == sorted(set(first)) and len(set(first) | set(second)) >= 3
    assert sample_scenario_indices(5, 3, 3, seed=1) == (second, 8)
    perm1 = np.random.default_rng([1, 1]).permutation(5).tolist()
    assert second == perm1[:3]
    assert [sample_scenario_indices(50, 0, 10, seed=s)[0] for s in range(3)] != \
        [sample_scenario_indices(50, 0, 10, seed=0)[0]] * 3


def test_sampler_refuses_more_scenarios_per_step_than_scenarios():
    with pytest.raises(TrainerError, match="scenarios_per_step=4 exceeds the 3"):
        sample_scenario_indices(3, 0, 4, seed=0)
    with pytest.raises(TrainerError, match="no training scenarios"):
        sample_scenario_indices(0, 0, 1, seed=0)


# ---------------------------------------------------------------- launch and settings (no model)


def test_every_process_training_alone_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainerError, match="WORLD_SIZE=2 .* would train its own copy"):
        check_launch(FakeAccelerator(num_processes=1))
    check_launch(FakeAccelerator(num_processes=2))
    monkeypatch.delenv("WORLD_SIZE")
    check_launch(FakeAccelerator(num_processes=1))
    with pytest.raises(TrainerError, match="ZeRO-3"):
        check_launch(FakeAccelerator(deepspeed_config={}, zero_stage=3))


def test_a_policy_backend_that_cannot_take_the_updated_policy_is_refused(tmp_path):
    class GeneratesOnly:  # a ChatBackend: generate, but no sync_policy
        def generate(self, conversations, sampling, json_schema=None):
            raise AssertionError("never called")

    cfg = tiny_config(tmp_path, "no-sync")
    with pytest.raises(TrainerError, match="GeneratesOnly has no sync_policy"):
        Trainer(cfg, tiny_scenarios(4), simulator=RuleSimulator(starts_with_i), policy_backend=GeneratesOnly())


def test_the_trainer_stops_the_simulator_it_started_and_leaves_one_it_was_given(tmp_path, monkeypatch):
    class Recording(RuleSimulator):
        closed = 0

        def close(self):
            self.closed += 1

    import rlver_lib.models

    built = Recording(starts_with_i)
    monkeypatch.setattr(rlver_lib.models, "build_simulator", lambda sim_cfg, seed: built)
    with Trainer(tiny_config(tmp_path, "started"), tiny_scenarios(4)) as trainer:
        assert trainer.simulator is built and built.closed == 0
    assert built.closed == 1
    given = Recording(starts_with_i)
    with Trainer(tiny_config(tmp_path, "given"), tiny_scenarios(4), simulator=given):
        pass
    assert given.closed == 0


def test_deepspeed_config_gets_accumulation_clipping_and_micro_batch():
    training = build_config({"training": {"grad_accum_steps": 4, "max_grad_norm": 0.5,
                                          "mini_batch_size": 8}}).training
    config = {"gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
    configure_deepspeed(FakeAccelerator(deepspeed_config=config), training)
    # DeepSpeed's nominal micro-batch: 8 dialogues per optimizer step / (1 process x 4 micro-batches)
    assert config == {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2,
                      "gradient_clipping": 0.5}
    with pytest.raises(TrainerError, match="gradient_clipping=1.0 but training.max_grad_norm is 0.5"):
        configure_deepspeed(FakeAccelerator(deepspeed_config={"gradient_clipping": 1.0}), training)
    # a second run in the same process gets the same plugin (accelerate's rule), filled in by
    # the first run: the launch's "auto" values come back before the second run's go in
    accelerator = FakeAccelerator(deepspeed_config=dict(config, gradient_accumulation_steps="auto",
                                                         train_micro_batch_size_per_gpu="auto"))
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    configure_deepspeed(accelerator, training)
    config["train_batch_size"] = 8  # what accelerate's prepare fills in
    second = build_config({"training": {"grad_accum_steps": 1, "max_grad_norm": 0.5, "mini_batch_size": 4}}).training
    configure_deepspeed(accelerator, second)
    assert config == {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5}
    configure_deepspeed(FakeAccelerator(), training)  # no DeepSpeed: nothing to do


@pytest.mark.parametrize("schedule,warmup,expected", [
    ("constant", 2, [0.5, 1.0, 1.0, 1.0]),  # warmup honoured: transformers' constant schedule drops it
    ("constant", 0, [1.0, 1.0, 1.0, 1.0]),
    ("linear", 2, [0.5, 1.0, 2 / 3, 1 / 3]),  # 4 steps: decay to 0 one step after the last
    ("cosine", 0, [(1 + math.cos(math.pi * s / 5)) / 2 for s in (1, 2, 3, 4)]),
])
def test_learning_rate_of_each_step(schedule, warmup, expected):
    training = build_config({"training": {"steps": 4, "warmup_steps": warmup, "lr_schedule": schedule,
                                          "learning_rate": 1.0}}).training
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = lr_scheduler(optimizer, training)
    used = []
    for _ in range(4):
        used.append(optimizer.param_groups[0]["lr"])  # what the step's update runs at
        optimizer.step()
        scheduler.step()
    assert used == pytest.approx(expected)
    assert used[0] > 0  # step 1 is never at LR 0


def test_trainer_refuses_settings_that_bias_the_ratio(tmp_path):
    for override, reason in ((("policy", "lora", "dropout"), 0.1), (("policy", "top_p"), 0.9)):
        data = {"stages": ["trained"], "output_root": str(tmp_path), "policy": {"lora": {}}}
        node = data
        for key in override[:-1]:
            node = node.setdefault(key, {})
        node[override[-1]] = reason
        cfg = build_config(data)  # an evaluation-only run may use these
        with pytest.raises(ConfigError, match=override[-1]):
            Trainer(cfg, tiny_scenarios(2))
        with pytest.raises(ConfigError, match=override[-1]):
            build_config({**data, "stages": ["train"]})


# ---------------------------------------------------------------- advantages by hand (no model)


def _sample(dialogue, turn, context, values, group="g"):
    """A turn with ``context`` context ids and ``len(values)`` policy tokens."""
    n = context + len(values)
    mask = torch.tensor([0.0] * (context - 1) + [1.0] * len(values))
    old_values = torch.tensor([9.0] * (context - 1) + list(values))
    return Sample(dialogue, group, turn, torch.arange(n), mask, old_values=old_values)


def test_grpo_every_turn_carries_its_dialogues_advantage_and_flat_groups_are_left_out():
    samples = [_sample("a#0", 0, 3, [0, 0]), _sample("a#0", 1, 5, [0, 0, 0]), _sample("a#1", 0, 3, [0]),
               _sample("b#0", 0, 2, [0], group="b"), _sample("b#1", 0, 2, [0, 0], group="b")]
    rewards = {"a#0": 0.2, "a#1": 0.6, "b#0": 0.5, "b#1": 0.5}
    kept, zero_variance, groups = grpo_sample_advantages(samples, rewards, scale_rewards=True)
    a = -0.2 / (math.sqrt(0.08) + 1e-4)  # (r - mean) / (unbiased std + eps) of [0.2, 0.6]
    assert (zero_variance, groups) == (1, 2)
    assert [s.dialogue_id for s in kept] == ["a#0", "a#0", "a#1"]  # group b (equal rewards) is left out
    torch.testing.assert_close(kept[0].advantages, torch.tensor([0, 0, a, a]))
    torch.testing.assert_close(kept[1].advantages, torch.tensor([0, 0, 0, 0, a, a, a]))  # turn 1: same value
    torch.testing.assert_close(kept[2].advantages, torch.tensor([0, 0, -a]))


def test_ppo_gae_runs_across_the_turn_boundary_of_a_two_turn_dialogue():
    # turn 0: policy tokens with values .1, .2; turn 1: .3, .4; reward 1.0; γ = .9, λ = .5
    samples = [_sample("d#0", 1, 4, [0.3, 0.4]), _sample("d#0", 0, 3, [0.1, 0.2])]  # out of order on purpose
    ppo_sample_advantages(samples, {"d#0": 1.0}, gamma=0.9, lam=0.5)
    a4 = 1.0 - 0.4
    a3 = (0.9 * 0.4 - 0.3) + 0.45 * a4
    a2 = (0.9 * 0.3 - 0.2) + 0.45 * a3  # the last token of turn 0 bootstraps from turn 1's first
    a1 = (0.9 * 0.2 - 0.1) + 0.45 * a2
    torch.testing.assert_close(samples[1].advantages, torch.tensor([0, 0, a1, a2]))
    torch.testing.assert_close(samples[0].advantages, torch.tensor([0, 0, 0, a3, a4]))
    torch.testing.assert_close(samples[1].returns, torch.tensor([0, 0, a1 + 0.1, a2 + 0.2]))


def _training(**kw):
    return build_config({"training": kw}).training


def test_batch_sizes_are_global_dialogues_and_must_divide():
    ok = _training(scenarios_per_step=32, group_size=4, mini_batch_size=32)
    assert all(batch_problems(ok, p) == [] for p in (1, 2, 4, 8))
    scenarios, mini = batch_problems(ok, 3)
    assert "scenarios_per_step=32 does not divide over 3 processes" in scenarios
    assert "mini_batch_size=32 (dialogues per optimizer step, over all processes) does not divide over 3" in mini
    (problem,) = batch_problems(_training(scenarios_per_step=4, group_size=3, mini_batch_size=5), 1)
    assert "mini_batch_size=5" in problem and "the 12 dialogues of a step" in problem
    (problem,) = batch_problems(_training(scenarios_per_step=4, group_size=1, mini_batch_size=2), 4)
    assert "mini_batch_size=2" in problem and "over 4 processes" in problem


def test_more_micro_batches_than_a_processes_dialogues_is_a_note_naming_the_remedy():
    # the paper's PPO without thinking on 8 GPUs: 8 dialogues an optimizer step, 1 a process, 4 micro-batches
    training = _training(scenarios_per_step=32, group_size=1, mini_batch_size=8, grad_accum_steps=4)
    assert batch_notes(training, 1) == [] and batch_notes(training, 2) == []  # 8 and 4 dialogues a process
    (note,) = batch_notes(training, 8)
    assert "1 dialogue(s) each of the 8 process(es)" in note and "fewer than 4 turns" in note
    assert "set training.grad_accum_steps=1" in note
    (note,) = batch_notes(training, 4)  # 2 a process: one-turn dialogues leave 2 of 4 micro-batches empty
    assert "fewer than 2 turns" in note and "grad_accum_steps=2" in note


def _global_windows(dialogues: int, mini_batch: int, processes: int) -> list[list[int]]:
    """Per window, the dialogues each process contributes (equal shares, as rolled out)."""
    n = optimizer_steps_per_epoch(dialogues, mini_batch)
    share = dialogues // processes
    out = [[0] * processes for _ in range(n)]
    for rank in range(processes):
        for w in dialogue_windows(share, rank * share, n):
            out[w][rank] += 1
    return out


@pytest.mark.parametrize("dialogues, mini_batch", [(32, 8), (128, 32), (4, 2), (16, 8)])
def test_optimizer_steps_and_dialogues_per_update_do_not_depend_on_the_process_count(dialogues, mini_batch):
    for processes in (1, 2, 4, 8):
        if dialogues % processes or mini_batch % processes:
            continue
        windows = _global_windows(dialogues, mini_batch, processes)
        assert len(windows) == dialogues // mini_batch
        assert all(sum(w) == mini_batch and set(w) == {mini_batch // processes} for w in windows), windows
    # fewer trained dialogues (GRPO groups without signal, dropped errors): fewer steps, none empty
    assert optimizer_steps_per_epoch(7, 2) == 4 and optimizer_steps_per_epoch(0, 2) == 0
    assert sorted(dialogue_windows(7, 0, 4)) == [0, 0, 1, 1, 2, 2, 3]
    assert dialogue_windows(3, 5, 4) == [1, 2, 3]  # this process's dialogues start at global index 5


def test_each_process_draws_its_own_seed_and_process_0_the_run_seed():
    assert process_seed(1234, 0) == 1234  # one process samples as it always did
    seeds = [process_seed(1234, rank) for rank in range(8)]
    assert len(set(seeds)) == 8 and seeds == [process_seed(1234, rank) for rank in range(8)]
    assert process_seed(1235, 1) != seeds[1]


def test_window_sizes_count_policy_tokens_and_samples_per_window():
    a, b, c = (Sample("d", "g", 0, torch.zeros(n + 1, dtype=torch.long), torch.tensor([1.0] * n + [0.0]))
               for n in (1, 2, 3))
    # micro-batches [a, b], [c], [], [a]; windows of 2 micro-batches: ([a, b], [c]) and ([], [a])
    sizes = window_sizes([[a, b], [c], [], [a]], 2)
    assert sizes.dtype == torch.float64 and sizes.tolist() == [[6.0, 3.0], [1.0, 1.0]]


def test_train_reward_penalises_format_and_zeroes_errors():
    from types import SimpleNamespace as T

    assert train_reward(T(termination="success", reward=1.0, format_violations=0), 0.1) == 1.0
    assert train_reward(T(termination="max_turns", reward=0.5, format_violations=2), 0.1) == pytest.approx(0.4)
    assert train_reward(T(termination="error", reward=0.7, format_violations=1), 0.1) == 0.0
    # the reversed-reward control: the emotion reward's sign flips, the format penalty stays a penalty
    assert train_reward(T(termination="max_turns", reward=0.5, format_violations=2), 0.1, -1.0) == pytest.approx(-0.6)
    assert train_reward(T(termination="error", reward=0.7, format_violations=0), 0.1, -1.0) == 0.0


def test_reward_scale_zero_is_refused():
    from rlver_lib.config import TrainingConfig

    with pytest.raises(ValueError, match="reward_scale"):
        TrainingConfig(reward_scale=0)


def test_sampling_logprobs_are_aligned_with_the_policy_tokens():
    from rlver_lib.rollout import Trajectory, TurnSample

    turn = TurnSample("a#0", 0, [10, 11, 12], [13, 14], [-0.1, -0.2])
    t = Trajectory("a#0", "a", "a", [], 50, 0.5, "max_turns", samples=[turn])
    (sample,) = samples_from_trajectories([t])
    # next-token positions: entry j scores input_ids[j + 1]; ids 13, 14 sit at j = 2, 3
    torch.testing.assert_close(sample.mask, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(sample.sampling_logprobs[2:], torch.tensor([-0.1, -0.2]))
    assert torch.isnan(sample.sampling_logprobs[:2]).all()


def test_policy_forward_keeps_no_entropy_graph_when_not_needed():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlver_lib.learner import PolicyWithValueHead

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    model = PolicyWithValueHead(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])), None, 0.7)
    ids = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = model(ids, torch.ones_like(ids), mask, entropy_grad=False)
    assert out["logprobs"].requires_grad and not out["entropy"].requires_grad
    assert model(ids, torch.ones_like(ids), mask)["entropy"].requires_grad
    logits = base(input_ids=ids).logits[0, 1:3] / 0.7  # positions 1, 2 score ids 3, 4
    torch.testing.assert_close(out["logprobs"][0, 1:], torch.log_softmax(logits, -1)[[0, 1], [3, 4]])
    torch.testing.assert_close(out["entropy"][0, 1:], torch.distributions.Categorical(logits=logits).entropy())


def test_score_old_computes_no_entropy_and_matches_the_update_forward(monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlver_lib.learner import PolicyWithValueHead

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    model = PolicyWithValueHead(get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])),
                                torch.nn.Linear(16, 1), 0.7)
    samples = [Sample(f"d#{k}", "d", 0, torch.tensor([1, 2, 3, 4, 5][:4 + k]), torch.tensor([0.0, 1, 1, 1][:3 + k]))
               for k in range(2)]
    asked, real = [], algorithms.chunked_logprobs_and_entropy
    monkeypatch.setattr(algorithms, "chunked_logprobs_and_entropy",
                        lambda *args, **kw: asked.append(kw["entropy"]) or real(*args, **kw))
    score_old(model, samples, batch_size=2, pad_id=0, device=torch.device("cpu"), reference=True)
    assert asked == [False, False]  # the policy and the reference (adapter disabled): no entropy
    out = model(samples[1].input_ids[None], torch.ones(1, 5, dtype=torch.long), samples[1].mask[None])
    torch.testing.assert_close(samples[1].old_logprobs, out["logprobs"][0].detach())
    torch.testing.assert_close(samples[1].old_values, out["values"][0].detach())
    assert asked[-1] is True and out["entropy"][0, 1:].gt(0).all()


def test_atomic_directory_replaces_whole_or_not_at_all(tmp_path):
    from rlver_lib.files import atomic_directory

    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(KeyError):
        with atomic_directory(target) as tmp:
            (tmp / "b").write_text("2")
            raise KeyError("interrupted")
    assert sorted(p.name for p in target.iterdir()) == ["a"] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with atomic_directory(target) as tmp:
        (tmp / "c").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["c"]
    with atomic_directory(target, if_exists="keep") as tmp:
        (tmp / "d").write_text("4")
    assert sorted(p.name for p in target.iterdir()) == ["c"] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ---------------------------------------------------------------- the real policy


class _Resting:
    """A rollout backend that records its generate, sleep and sync_policy calls."""

    def __init__(self, backend):
        self.backend, self.events = backend, []

    def prompt_ids(self, conversation):
        return self.backend.prompt_ids(conversation)

    def generate(self, *args, **kwargs):
        self.events.append("generate")
        return self.backend.generate(*args, **kwargs)

    def sleep(self):
        self.events.append("sleep")

    def sync_policy(self, model, step):
        self.events.append("sync")
        self.backend.sync_policy(model, step)


@pytest.mark.slow
def test_first_mini_batch_has_ratio_one_at_temperature_0_7_and_warmup_is_honoured(tmp_path):
    torch.set_num_threads(2)
    cfg = build_config({
        "run_name": "t07", "output_root": str(tmp_path), "seed": 5,
        "policy": {"dtype": "float32", "temperature": 0.7, "max_new_tokens": 6, "lora": {"r": 4, "alpha": 8}},
        "simulator": {"backend": "rule"}, "rollout": {"max_turns": 2},
        "training": {"algorithm": "ppo", "steps": 2, "scenarios_per_step": 1, "group_size": 2,
                     "mini_batch_size": 2, "epochs_per_step": 1, "learning_rate": 1e-3, "warmup_steps": 2,
                     "checkpoint_every": 100}})
    trainer = Trainer(cfg, tiny_scenarios(2), simulator=RuleSimulator(starts_with_i))
    trainer.policy_backend = _Resting(trainer.policy_backend)
    rows = trainer.train()
    # the rollout backend rests (vLLM's sleep mode) once a step, after its last turn's
    # generation, and before the update (the hand-over of the updated policy)
    events = trainer.policy_backend.events
    assert [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]] == ["generate", "sleep", "sync"] * 2
    assert events.count("generate") >= 4  # 2 turns a step
    for row in rows:
        assert row["approx_kl_old"] < 1e-6 and row["clip_fraction"] == 0.0
        # the learner's old log-probs are the ones the policy sampled with (fp32)
        assert row["logprob_gap_max"] < 1e-4 and abs(row["is_weight_mean"] - 1) < 1e-4
    assert [r["learning_rate"] for r in rows] == pytest.approx([5e-4, 1e-3])
    assert all(r["num_processes"] == 1 for r in rows)


class _Erroring(RuleSimulator):
    """The rule simulator, except that dialogue ``s0#0`` hits an outage at its first turn."""

    def step(self, requests):
        from rlver_lib.simulator import SimulatorTurn

        turns = super().step(requests)
        return [SimulatorTurn(r.dialogue_id, None, None, r.emotion, r.emotion, "B", {}, None, False, error="outage")
                if r.dialogue_id == "s0#0" else t for r, t in zip(requests, turns)]


def _padded(samples, key):
    return torch.nn.utils.rnn.pad_sequence([getattr(s, key) for s in samples], batch_first=True)


@pytest.mark.slow
def test_error_dialogues_are_counted_and_accumulation_steps_once_per_window_with_the_full_gradient(tmp_path):
    torch.set_num_threads(2)
    cfg = tiny_config(tmp_path, "accum", algorithm="ppo", ppo={"vf_coef": 0.0}, steps=1, scenarios_per_step=2,
                      group_size=2, mini_batch_size=2, grad_accum_steps=2, max_grad_norm=1e6, entropy_coef=0.0,
                      is_correction=False)
    cfg.policy.dtype = "float32"
    trainer = Trainer(cfg, tiny_scenarios(2), simulator=_Erroring(starts_with_i))
    # error dialogues: left out by default, counted; trained on with reward 0 on request
    dropped = trainer.train()[0]
    trainer.training = trainer.training.model_copy(update={"error_dialogues": "zero_reward"})
    trainer.step += 1
    zeroed = trainer._train_step()
    for row in (dropped, zeroed):
        assert (row["error_dialogues"], row["dialogues"], row["error_rate"]) == (1, 4, 0.25)
    assert (dropped["samples"], zeroed["samples"]) == (3, 4)  # one turn per dialogue
    # mini-batches of 2 dialogues: 3 trained dialogues make 2 optimizer steps (2 + 1), 4 make 2 (2 + 2)
    assert (dropped["optimizer_steps"], dropped["samples_per_update"]) == (2, 1.5)
    assert (zeroed["optimizer_steps"], zeroed["samples_per_update"]) == (2, 2.0)
    records = [r for _, r in iter_jsonl(cfg.run_dir / "train" / "dialogues" / "step_000001.jsonl")]
    assert sorted(r["termination"] for r in records).count("error") == 1

    # hand-made samples, one per dialogue: mini-batches of 2 dialogues -> exactly 2 optimizer steps,
    # each of 2 micro-batches of one sample, with the gradient of its window's token-mean loss
    samples = [Sample(f"x#{k}", "x", 0, torch.tensor([1, 5 + k, 9, 11 + k][:3 + k % 2]),
                       torch.tensor([0.0, 1.0, 1.0][:2 + k % 2])) for k in range(4)]
    score_old(trainer.model, samples, batch_size=1, pad_id=trainer.pad_id, device=trainer.accelerator.device,
              reference=False)
    for k, s in enumerate(samples):
        s.advantages, s.returns = s.mask * (k - 1.5), torch.zeros_like(s.mask)
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0  # both windows then see the same weights
    inner, recorded = trainer.optimizer.optimizer, []
    original_step = inner.step

    def spy(*args, **kwargs):
        recorded.append([p.grad.detach().clone() for p in trainer.trainable])
        return original_step(*args, **kwargs)

    inner.step = spy
    trainer._update(samples, step_seed=11)
    inner.step = original_step
    assert len(recorded) == 2
    order = torch.randperm(4, generator=torch.Generator().manual_seed(11)).tolist()
    for window, grads in zip(([order[0], order[2]], [order[1], order[3]]), recorded):  # dealt round-robin
        batch = [samples[i] for i in window]
        trainer.model.zero_grad()
        ids = _padded(batch, "input_ids")
        out = trainer.model(ids, (_padded(batch, "input_ids") > 0).long(), _padded(batch, "mask"))
        algorithms.clipped_policy_loss(out["logprobs"], _padded(batch, "old_logprobs"), _padded(batch, "advantages"),
                                       _padded(batch, "mask")).loss.backward()
        expected = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainer.trainable]
        # fp32 noise of unpadded micro-batches vs one padded batch stays below ~1e-4 of the
        # largest gradient entry; a wrong normaliser or a lost micro-batch is off by tens of percent
        scale = max(float(e.abs().max()) for e in expected)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=2e-4 * scale)
        assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,extra", [
    ("grpo", {}),
    ("ppo", {"ppo": {"vf_coef": 0.1, "value_learning_rate": 1e-3}}),
    ("grpo", {"reward_scale": -1.0}),  # the reversed-reward control must lower the reward
], ids=["grpo", "ppo", "grpo-reversed"])
def test_learner_moves_reward_of_real_policy_the_way_it_is_told(tmp_path, algorithm, extra):
    """Rule simulator: +10 if the reply starts with "I", else -10 (reward 0.6 vs 0.4):
    trained on the reward, the share of such replies rises. The reversed-reward control
    (``reward_scale: -1``) meets the opposite simulator (-10 for "I", +10 otherwise), so
    the share of "I" replies must rise there too, while the logged emotion reward
    (``reward_mean``, never the scaled one) falls; ignoring the scale would lower it."""
    torch.set_num_threads(2)
    scale = extra.get("reward_scale", 1.0)
    cfg = tiny_config(tmp_path, algorithm, algorithm=algorithm, steps=6, scenarios_per_step=2, group_size=4,
               mini_batch_size=8, learning_rate=5e-3, checkpoint_every=100, entropy_coef=0.0, **extra)
    rows = Trainer(cfg, tiny_scenarios(4), simulator=RuleSimulator(lambda reply: scale * starts_with_i(reply))).train()
    curve = [round(r["reward_mean"], 3) for r in rows]
    print(f"{algorithm} {extra} reward curve: {curve}")
    share_i = [(r - 0.4) / 0.2 if scale > 0 else (0.6 - r) / 0.2 for r in curve]  # replies starting with "I"
    assert np.mean(share_i[-3:]) >= np.mean(share_i[:2]) + 0.3, curve


# ---------------------------------------------------------------- the paper recipes

RECIPES = sorted((Path(__file__).resolve().parents[1] / "params").glob("paper-*.yaml"))
RLVER_TRAIN_PROFILES = 500  # train_profile.jsonl of the RLVER release


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_paper_recipe_runs_its_whole_sampler_schedule(recipe):
    cfg = load_config(recipe)  # also refuses settings the learner would refuse
    training = cfg.training
    position, seen = 0, set()
    for _ in range(training.steps):
        indices, position = sample_scenario_indices(RLVER_TRAIN_PROFILES, position, training.scenarios_per_step,
                                                    cfg.seed)
        assert len(set(indices)) == training.scenarios_per_step  # run_rollouts needs unique scenarios
        seen.update(indices)
    assert len(seen) == RLVER_TRAIN_PROFILES
    assert training.warmup_steps > 0 and training.weight_decay == 0.01


# one recipe per algorithm, one of them thinking: a recipe's difficulty only shapes the LLM
# simulator's prompt (these steps run the rule simulator), and the rest of the grid differs in
# think mode and reply budget alone (their sampler schedules and batch plans are all checked above)
STEP_RECIPES = [p for p in RECIPES if p.stem in ("paper-grpo-think-moderate", "paper-ppo-nothink-moderate")]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_paper_recipe_makes_four_optimizer_steps_a_step_on_any_number_of_processes(recipe):
    training = load_config(recipe).training
    dialogues = training.scenarios_per_step * training.group_size
    for processes in (1, 2, 4, 8):
        assert batch_problems(training, processes) == []
        assert len(_global_windows(dialogues, training.mini_batch_size, processes)) == 4


@pytest.mark.slow
@pytest.mark.parametrize("recipe", STEP_RECIPES, ids=lambda p: p.stem)
def test_paper_recipe_takes_a_real_step_on_the_embedded_policy(tmp_path, recipe):
    """The recipe as it is (algorithm, group size, think mode, bf16, LoRA r = 64 on every
    projection, gradient checkpointing, entropy and value coefficients, warmup), on the
    embedded policy and the rule simulator, shrunk to 4 one-turn dialogues a step in
    mini-batches of one dialogue: the recipe's own 4 optimizer steps a step. One
    micro-batch per optimizer step (``grad_accum_steps`` only splits a window for memory):
    the recipe's 4 would add 3 empty micro-batches per window here, at ~3 s each for a
    bf16 forward and backward on CPU."""
    torch.set_num_threads(2)
    recipe_cfg = load_config(recipe)
    steps_per_step = recipe_cfg.training.scenarios_per_step * recipe_cfg.training.group_size \
        // recipe_cfg.training.mini_batch_size
    cfg = load_config(recipe, {
        "output_root": str(tmp_path), "policy.model": EMBEDDED_POLICY, "policy.backend": "transformers",
        "policy.max_new_tokens": 3, "simulator.backend": "rule", "rollout.max_turns": 1,
        "training.steps": 1, "training.scenarios_per_step": steps_per_step // recipe_cfg.training.group_size,
        "training.mini_batch_size": 1, "training.grad_accum_steps": 1})
    trainer = Trainer(cfg, tiny_scenarios(4), simulator=RuleSimulator(hashed_change))
    rows = trainer.train()
    training = cfg.training
    assert steps_per_step == 4
    (row,) = rows
    assert (row["step"], row["dialogues"], row["samples"], row["optimizer_steps"], row["samples_per_update"]) \
        == (1, 4, 4, 4, 1.0), row
    assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0 and row["entropy"] > 0
    # think recipes: 3 tokens cannot close a think block, every reply breaks the format
    assert row["format_violation_rate"] == (1.0 if cfg.policy.think else 0.0)
    if trainer.algorithm.critic:
        assert math.isfinite(row["value_loss"]) and math.isfinite(row["explained_variance"])
    else:
        assert row["zero_variance_group_share"] == 0.0
    assert row["learning_rate"] == pytest.approx(training.learning_rate / training.warmup_steps)
    assert any(float(p.abs().sum()) > 0 for n, p in trainer.model.policy.named_parameters() if "lora_B" in n)
    assert (cfg.run_dir / "train" / "adapter" / "adapter_config.json").is_file()
    assert (cfg.run_dir / "train" / "checkpoints" / "step_000001" / "trainer_state.json").is_file()


def test_ppo_critic_warmup_trains_the_value_head_alone_and_the_value_offset_is_the_first_steps_mean_reward(tmp_path):
    """``training.ppo.critic_warmup_steps: 1`` and ``value_offset: first_step_mean_reward``:
    step 1 leaves every LoRA weight as it was (learning rate 0, no policy terms) while the
    value head moves; step 2 trains the policy. The offset is fixed before step 1's
    scoring, so step 1's values are that constant (value s.d. 0, value mean = the mean
    training reward), and it survives a resume from the step-2 checkpoint."""
    torch.set_num_threads(2)
    cfg = tiny_config(tmp_path, "warmup", algorithm="ppo", steps=3, scenarios_per_step=2, group_size=2,
                      mini_batch_size=2, ppo={"critic_warmup_steps": 1, "value_offset": "first_step_mean_reward",
                                              "value_learning_rate": 1e-2})
    trainer = Trainer(cfg, tiny_scenarios(3), simulator=RuleSimulator(hashed_change))
    lora = {n: p.detach().clone() for n, p in trainer.model.policy.named_parameters() if p.requires_grad}
    head = trainer.model.value_head.weight.detach().clone()
    (row1,) = trainer.train(stop_after=1)
    assert row1["learning_rate"] == 0.0 and row1["optimizer_steps"] == 2
    assert all(torch.equal(p, lora[n]) for n, p in trainer.model.policy.named_parameters() if p.requires_grad)
    assert not torch.equal(trainer.model.value_head.weight, head)
    offset = float(trainer.model.value_offset)
    assert offset == pytest.approx(row1["train_reward_mean"]) and 0.0 < offset < 1.0
    assert row1["value_mean"] == pytest.approx(offset) and row1["value_sd"] == pytest.approx(0.0, abs=1e-6)
    row2 = trainer.train(stop_after=2)[-1]
    assert row2["learning_rate"] == cfg.training.learning_rate
    assert any(not torch.equal(p, lora[n]) for n, p in trainer.model.policy.named_parameters() if p.requires_grad)
    assert float(trainer.model.value_offset) == offset  # fixed once, not re-set on later steps
    trainer.close()
    resumed = Trainer(cfg, tiny_scenarios(3), simulator=RuleSimulator(hashed_change))
    assert resumed.step == 2 and float(resumed.model.value_offset) == offset
    resumed.close()


def test_grpo_has_no_critic_warmup_and_ppo_without_an_offset_has_no_buffer(tmp_path):
    from rlver_lib.algorithm_objects import algorithm_for

    grpo = tiny_config(tmp_path, "g", ppo={"critic_warmup_steps": 3})
    assert algorithm_for(grpo.training).critic_warmup_steps(grpo.training) == 0
    ppo = tiny_config(tmp_path, "p", algorithm="ppo", ppo={"critic_warmup_steps": 3})
    assert algorithm_for(ppo.training).critic_warmup_steps(ppo.training) == 3
    from rlver_lib.learner import build_model

    assert not hasattr(build_model(ppo)[0], "value_offset")
    # a warm-up step's loss is the value term alone: with vf_coef 0 nothing has a gradient
    silent = tiny_config(tmp_path, "silent", algorithm="ppo", steps=1, max_grad_norm=1e6,
                         ppo={"critic_warmup_steps": 1, "vf_coef": 0.0})
    trainer = Trainer(silent, tiny_scenarios(2), simulator=RuleSimulator(hashed_change))
    (row,) = trainer.train()
    trainer.close()
    assert row["optimizer_steps"] == 1 and row["grad_norm"] == 0.0 and row["policy_loss"] != 0.0


def test_step_metrics_count_what_was_cut_to_fit():
    """Three dialogues, by hand: 5 policy replies of which 2 hit max_new_tokens; one
    dialogue ended by the policy's context budget; 4 appraised user turns of which 1 left
    messages out of the simulator's prompt (the opening has no emotion: not counted)."""
    def dialogue(replies, users, termination):
        transcript = [{"role": "user", "content": "Hi."}]
        for cut, dropped in zip(replies, users + [None] * (len(replies) - len(users))):
            transcript.append({"role": "assistant", "content": "ok", "cut": cut})
            if dropped is not None:
                transcript.append({"role": "user", "content": "m", "emotion": 50, "history_dropped": dropped})
        return {"transcript": transcript, "termination": termination, "reward": 0.5, "train_reward": 0.5,
                "trained": True, "group_id": "g", "final_emotion": 50, "policy_turns": len(replies),
                "format_violations": 0}

    records = [dialogue([True, False], [0, 2], "max_turns"), dialogue([False], [0], "context_limit"),
               dialogue([False, True], [0], "max_turns")]
    sums = {"zero_variance_groups": 0, "groups": 1, "policy_tokens": 10, "samples": 5, "gap_sum": 0.0,
            "gap_count": 0, "train_tokens": 10}
    row = step_metrics(records, sums, {}, step=1, data_position=1, num_processes=1, learning_rate=0.0,
                       step_time_s=1.0, rollout_time_s=0.5, update_time_s=0.5)
    assert row["reply_cut_rate"] == pytest.approx(2 / 5)
    assert row["context_limit_rate"] == pytest.approx(1 / 3)
    assert row["user_history_shortened_rate"] == pytest.approx(1 / 4)
