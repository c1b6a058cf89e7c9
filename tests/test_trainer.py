"""The learner on the real embedded SmolLM2 policy with a deterministic rule simulator.

Runtime on an idle 2-core machine (2 threads): about 15-20 s per learning test and
about 10 s for the resume test.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from rlver_lib.config import build_config
from rlver_lib.io import iter_jsonl
from rlver_lib.rollout import RuleSimulator
from rlver_lib.scenarios import Scenario
from rlver_lib.trainer import TIMING_METRICS, Trainer, sample_scenario_indices

OPENINGS = ["I had a rough day.", "My friend is mad at me.", "I feel stuck at work.", "Nobody listens to me."]


def _scenarios(n: int) -> list[Scenario]:
    return [Scenario(id=f"s{i}", persona=f"Sam {i}, 30, a teacher", situation="Argued with a friend.",
                     personality="negative", hidden_intention="be_heard", opening_line=OPENINGS[i % 4],
                     language="en") for i in range(n)]


def starts_with_i(reply: str) -> int:
    """+10 when the reply starts with the word "I" (I, I'm, I'd ...), else -10."""
    return 10 if re.match(r"\s*I\b", reply) else -10


def _cfg(tmp_path, name, **training):
    return build_config({
        "run_name": name, "output_root": str(tmp_path), "seed": 3,
        "policy": {"max_new_tokens": 4, "lora": {"r": 4, "alpha": 8}},
        "simulator": {"backend": "rule", "initial_emotion": 50},
        "rollout": {"max_turns": 1},
        "training": {"algorithm": "grpo", "steps": 4, "scenarios_per_step": 1, "group_size": 2,
                     "mini_batch_size": 2, "learning_rate": 1e-3, "checkpoint_every": 2,
                     "keep_checkpoints": 1, **training},
    })


def test_sampler_is_a_pure_function_of_position():
    first, pos = sample_scenario_indices(5, 0, 3, seed=1)
    second, pos2 = sample_scenario_indices(5, pos, 4, seed=1)
    assert pos == 3 and pos2 == 7
    assert sorted(first + second[:2]) == [0, 1, 2, 3, 4]  # epoch 0 visits every scenario once
    again, _ = sample_scenario_indices(5, 3, 4, seed=1)
    assert again == second


def _comparable(row):
    """Everything but timings and memory; NaN (metrics not defined for the step) as None."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in row.items() if k not in TIMING_METRICS}


def test_resume_after_interruption_reproduces_metrics(tmp_path):
    torch.set_num_threads(2)
    sim = RuleSimulator(starts_with_i)
    scenarios = _scenarios(3)
    full = Trainer(_cfg(tmp_path, "full", algorithm="ppo", vf_coef=0.5), scenarios, simulator=sim).train()

    cut = _cfg(tmp_path, "cut", algorithm="ppo", vf_coef=0.5)
    Trainer(cut, scenarios, simulator=sim).train(stop_after=3)  # killed after step 3; checkpoint at 2
    ckpts = sorted((cut.run_dir / "train" / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000002"]
    assert {"adapter", "value_head.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt",
            "trainer_state.json"} <= {p.name for p in ckpts[0].iterdir()}
    resumed = Trainer(cut, scenarios, simulator=sim)
    assert resumed.step == 2 and resumed.data_position == 2
    rows = resumed.train()

    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(full, rows):
        assert _comparable(a) == _comparable(b)
    logged = [row for _, row in iter_jsonl(cut.run_dir / "train" / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert math.isfinite(full[-1]["value_loss"]) and math.isfinite(full[-1]["policy_loss"])

    # the final adapter loads in a plain peft script and carries the trained weights
    from peft import PeftModel
    from rlver_lib.models import load_causal_lm

    base, _ = load_causal_lm("embedded:smollm2-135m-instruct", "bfloat16")
    loaded = PeftModel.from_pretrained(base, str(cut.run_dir / "train" / "adapter"))
    trained = dict(resumed.model.named_parameters())
    for name, p in loaded.named_parameters():
        if "lora_B" in name:
            torch.testing.assert_close(p.float(), trained[name].float())
            assert p.abs().sum() > 0


@pytest.mark.parametrize("algorithm,extra", [
    ("grpo", {}),
    ("ppo", {"vf_coef": 0.1, "value_learning_rate": 1e-3}),
])
def test_learner_raises_reward_of_real_policy(tmp_path, algorithm, extra):
    """Rule simulator: +10 if the reply starts with "I", else -10 (reward 0.6 vs 0.4)."""
    torch.set_num_threads(2)
    cfg = _cfg(tmp_path, algorithm, algorithm=algorithm, steps=6, scenarios_per_step=2, group_size=4,
               mini_batch_size=8, learning_rate=5e-3, checkpoint_every=100, entropy_coef=0.0, **extra)
    rows = Trainer(cfg, _scenarios(4), simulator=RuleSimulator(starts_with_i)).train()
    curve = [round(r["reward_mean"], 3) for r in rows]
    print(f"{algorithm} reward curve: {curve}")
    share_i = [(r - 0.4) / 0.2 for r in curve]  # share of replies starting with "I"
    assert np.mean(share_i[-3:]) >= np.mean(share_i[:2]) + 0.3, curve
