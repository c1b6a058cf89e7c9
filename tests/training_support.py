"""What the learner's tests share: tiny scenarios, rule-simulator change functions, a
small training config, a stand-in accelerator. Imported by tests/test_trainer.py,
tests/test_checkpoint.py, tests/test_native.py and the multi-process driver
tests/mp_train.py (run as a script, so plain functions here, no fixtures)."""

from __future__ import annotations

import math
import re
import zlib

from rlver_lib.params import build_config
from rlver_lib.scenarios import Scenario

OPENINGS = ["I had a rough day.", "My friend is mad at me.", "I feel stuck at work.", "Nobody listens to me."]


def tiny_scenarios(n: int, identical: bool = False) -> list[Scenario]:
    """``n`` scenarios ``s0, s1, ...``; ``identical``: they differ only in their ids (the same
    persona, situation and opening line), so two processes roll out the same conversation."""
    return [Scenario(id=f"s{i}", persona=f"Sam {0 if identical else i}, 30, a teacher",
                     situation="Argued with a friend.", personality="negative", hidden_intention="be_heard",
                     opening_line=OPENINGS[0 if identical else i % 4], language="en") for i in range(n)]


def starts_with_i(reply: str) -> int:
    """+10 when the reply starts with the word "I" (I, I'm, I'd ...), else -10."""
    return 10 if re.match(r"\s*I\b", reply) else -10


def hashed_change(reply: str) -> int:
    """A rule-simulator change that differs between almost any two replies (-10..10), so
    GRPO groups carry signal and PPO returns vary."""
    return zlib.crc32(reply.encode("utf-8")) % 21 - 10


def tiny_config(tmp_path, name, **training):
    """A 4-step GRPO run on the embedded policy (float32) and the rule simulator, one turn of
    4 tokens, a checkpoint every 2 steps (``training`` overrides the training section).

    float32, not the default bfloat16: on a CPU without native bf16 (no ``avx512_bf16`` /
    AMX, e.g. an AVX2 AMD EPYC) a LoRA forward and backward of the embedded policy is
    about 20x slower in bf16 (docs/MEASURED.md); the bf16 path has tests of its own."""
    return build_config({
        "run_name": name, "output_root": str(tmp_path), "seed": 3,
        "policy": {"max_new_tokens": 4, "dtype": "float32", "lora": {"r": 4, "alpha": 8}},
        "simulator": {"backend": "rule", "initial_emotion": 50},
        "rollout": {"max_turns": 1},
        "training": {"algorithm": "grpo", "steps": 4, "scenarios_per_step": 1, "group_size": 2,
                     "mini_batch_size": 2, "learning_rate": 1e-3, "checkpoint_every": 2,
                     "keep_checkpoints": 1, **training},
    })


def comparable(row):
    """Everything but timings and memory; NaN (metrics not defined for the step) as None."""
    from rlver_lib.trainer import TIMING_METRICS  # lazily: mp_train.py imports this module before its set-up

    return {k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in row.items() if k not in TIMING_METRICS}


class FakeAccelerator:
    def __init__(self, num_processes=1, deepspeed_config=None, zero_stage=2):
        plugin = None
        if deepspeed_config is not None:
            plugin = type("Plugin", (), {"deepspeed_config": deepspeed_config, "zero_stage": zero_stage})()
        self.state = type("State", (), {"deepspeed_plugin": plugin})()
        self.num_processes = num_processes
        self.distributed_type = "NO"
