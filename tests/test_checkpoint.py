"""Checkpoints (rlver_lib.checkpoint): what a checkpoint folder holds, loading one
written by another number of processes, and a run resumed from one reproducing the
uninterrupted run. The multi-process resumes (DDP killed with SIGKILL, ZeRO-2) are in
tests/test_zero2_and_resume.py."""

from __future__ import annotations

import math

import pytest
import torch
from training_support import FakeAccelerator, comparable, starts_with_i, tiny_config, tiny_scenarios

from rlver_lib.files import iter_jsonl
from rlver_lib.simulator import RuleSimulator
from rlver_lib.trainer import Trainer


class _CheckpointAccelerator(FakeAccelerator):
    """What ``Checkpoints`` uses of an accelerator; ``load_state`` records its calls."""

    def __init__(self, num_processes, deepspeed):
        super().__init__(num_processes, deepspeed_config={} if deepspeed else None)
        self.loaded = []

    def register_save_state_pre_hook(self, hook):
        pass

    def register_load_state_pre_hook(self, hook):
        pass

    def load_state(self, path, **kwargs):
        self.loaded.append((path, kwargs))


def test_a_zero_checkpoint_of_another_process_count_is_refused_before_deepspeed_loads_it(tmp_path):
    from rlver_lib.checkpoint import STATE_FILE, CheckpointError, Checkpoints

    folder = tmp_path / "step_000001"
    folder.mkdir()
    (folder / "random_states_0.pkl").write_bytes(b"")
    (folder / STATE_FILE).write_text('{"step": 1, "num_processes": 2}', encoding="utf-8")
    # DeepSpeed cannot re-partition ZeRO's optimizer states (it raises only after loading the model)
    accelerator = _CheckpointAccelerator(1, deepspeed=True)
    with pytest.raises(CheckpointError, match=r"written by 2 process\(es\) under DeepSpeed ZeRO, resumed on 1.*"
                                              r"policy.adapter: .*step_000001/adapter"):
        Checkpoints(accelerator, tmp_path, torch.nn.Linear(1, 1), keep=1).load(folder)
    assert accelerator.loaded == []
    accelerator = _CheckpointAccelerator(2, deepspeed=True)
    Checkpoints(accelerator, tmp_path, torch.nn.Linear(1, 1), keep=1).load(folder)
    assert accelerator.loaded == [(str(folder), {"load_module_strict": False})]
    accelerator = _CheckpointAccelerator(1, deepspeed=False)  # without DeepSpeed: a warning
    with pytest.warns(UserWarning, match="RNG states of ranks without a saved state are not restored"):
        Checkpoints(accelerator, tmp_path, torch.nn.Linear(1, 1), keep=1).load(folder)
    assert len(accelerator.loaded) == 1


@pytest.mark.slow
def test_resume_after_interruption_reproduces_metrics(tmp_path):
    torch.set_num_threads(2)
    sim = RuleSimulator(starts_with_i)
    scenarios = tiny_scenarios(3)
    full = Trainer(tiny_config(tmp_path, "full", algorithm="ppo", ppo={"vf_coef": 0.5}), scenarios,
                   simulator=sim).train()

    cut = tiny_config(tmp_path, "cut", algorithm="ppo", ppo={"vf_coef": 0.5})
    Trainer(cut, scenarios, simulator=sim).train(stop_after=3)  # killed after step 3; checkpoint at 2
    ckpts = sorted((cut.run_dir / "train" / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000002"]
    assert {"adapter", "model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl",
            "trainer_state.json", "config.yaml"} <= {p.name for p in ckpts[0].iterdir()}
    from safetensors.torch import load_file

    saved = load_file(str(ckpts[0] / "model.safetensors"))  # trainable weights only: LoRA and value head
    assert saved and all("lora_" in k or k.startswith("value_head.") for k in saved)
    resumed = Trainer(cut, scenarios, simulator=sim)
    assert resumed.step == 2 and resumed.data_position == 2
    rows = resumed.train()

    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(full, rows):
        assert comparable(a) == comparable(b)
    logged = [row for _, row in iter_jsonl(cut.run_dir / "train" / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert math.isfinite(full[-1]["value_loss"]) and math.isfinite(full[-1]["policy_loss"])

    # the final adapter loads in a plain peft script and carries the trained weights
    from peft import PeftModel

    from rlver_lib.models import load_causal_lm

    base, _ = load_causal_lm("embedded:smollm2-135m-instruct", "float32")
    loaded = PeftModel.from_pretrained(base, str(cut.run_dir / "train" / "adapter"))
    trained = dict(resumed.model.policy.named_parameters())
    for name, p in loaded.named_parameters():
        if "lora_B" in name:
            torch.testing.assert_close(p.float(), trained[name].float())
            assert p.abs().sum() > 0
