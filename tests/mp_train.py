"""A small driver for tests/test_multiprocess.py, launched for real:

    ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node 2 tests/mp_train.py RUN.json

``RUN.json``: a list of runs done one after the other in the same processes (imports
paid once). A training run is ``{"config": {...build_config data...}, "scenarios": N}``
plus optional keys:

- ``identical``: the N scenarios differ only in their ids (the same persona, situation
  and opening line), so two processes roll out the same conversation;
- ``one_by_one`` (default true): generate one conversation at a time with a seed of
  its own (:class:`OneByOne`), so a dialogue samples the same tokens whichever process
  (and batch) it lands in and a two-process run is comparable with a one-process run;
  false: the trainer's own batched backend and seeds;
- ``change``: the rule simulator's change function (tests/training_support.py), ``hashed``
  (default: almost any two replies differ, so GRPO groups carry signal) or ``starts_with_i``;
- ``error_on_rank``: that process's simulated user fails every dialogue (it then has
  nothing to train: zero-weight micro-batches);
- ``expect_error``: the trainer must refuse the config (the message is recorded);
- ``interrupt_after``: train that many steps, drop the trainer, and let a new one (in
  the same processes) resume from the checkpoint and finish the run;
- ``hang_in_checkpoint``: while the checkpoint of that step is being written (all of it
  in its ``.step_NNNNNN.partial`` folder, ``trainer_state.json`` included, not yet renamed
  into place), rank 0 hangs after writing ``train/hanging_in_checkpoint``: a fixed point
  for the test to kill the launch at.

Each run writes ``rank<r>.json`` into its ``train/`` folder: the launch as accelerate
saw it, the ``torch.optim.AdamW.step`` calls of its last ``train()`` (counted by a
wrapper), the process group's collective timeout, a checksum of the trained LoRA
weights, the step the run resumed from, the dtypes of the trainable weights (and,
under DeepSpeed, of ZeRO's master copy), the step-1 replies of this process and the
scenarios whose dialogues failed.

Under DeepSpeed (``accelerate launch --config_file params/accelerate/zero2.yaml``) the
driver turns off DeepSpeed's shared-memory all-reduce, a C++ op it would otherwise
compile at start-up on CPU and uses only for inference (training collectives go
through gloo), so no native code is built.

A pipeline run is ``{"pipeline": {...build_config data...}}``: every process calls
``rlver_lib.pipeline.run.run_pipeline`` (the notebooks come from ``$RLVER_NOTEBOOKS``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from training_support import hashed_change, starts_with_i, tiny_scenarios

from rlver_lib.backends import TransformersBackend, conversation_seed, derive_seed
from rlver_lib.config import ConfigError
from rlver_lib.files import iter_jsonl
from rlver_lib.params import build_config
from rlver_lib.simulator import RuleSimulator, SimulatorTurn


class FailingFor(RuleSimulator):
    """The rule simulator, except that dialogues of the given scenarios (all, when ``None``)
    end in a simulator error at their first turn."""

    def __init__(self, change_fn, scenario_ids: set[str] | None = None):
        super().__init__(change_fn)
        self.scenario_ids = scenario_ids
        self.failed: set[str] = set()

    def step(self, requests):
        turns = super().step(requests)
        out = []
        for request, turn in zip(requests, turns):
            scenario = request.dialogue_id.split("#")[0]
            if self.scenario_ids is None or scenario in self.scenario_ids:
                self.failed.add(scenario)
                turn = SimulatorTurn(request.dialogue_id, None, None, request.emotion, request.emotion, "B", {},
                                     None, False, error="outage")
            out.append(turn)
        return out


class OneByOne:
    """``TransformersBackend`` one conversation at a time; the k-th copy of a conversation
    in a call gets a seed of (policy step, conversation, k), whatever the call's seed (a
    process's stream): a dialogue then samples the same on every process."""

    def __init__(self, backend: TransformersBackend, step: int = 0):
        self.backend = backend
        self.step = step  # the policy's step (a resumed trainer's)

    def prompt_ids(self, conversation):
        return self.backend.prompt_ids(conversation)

    def sync_policy(self, model, step):
        self.backend.sync_policy(model, step)
        self.step = step

    def generate(self, conversations, sampling, json_schema=None):
        from dataclasses import replace

        seen: dict[str, int] = {}
        out = []
        for conversation in conversations:
            key = json.dumps(conversation, sort_keys=True)
            seen[key] = seen.get(key, 0) + 1
            seed = conversation_seed(derive_seed("one-by-one", self.step),
                                     conversation + [{"role": "copy", "content": str(seen[key])}])
            out += self.backend.generate([conversation], replace(sampling, seed=seed), json_schema)
        return out


def _process_group_timeout_s() -> float | None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    group = torch.distributed.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


ADAMW_STEPS = [0]
"""``torch.optim.AdamW.step`` calls in this process since the last reset (:func:`count_adamw_steps`)."""


def count_adamw_steps() -> None:
    """Count every ``torch.optim.AdamW.step`` (the trainer's one optimizer; under DeepSpeed
    ZeRO's optimizer steps it): the updates that really happened, not the trainer's count."""
    step = torch.optim.AdamW.step

    def counted(self, *args, **kwargs):
        ADAMW_STEPS[0] += 1
        return step(self, *args, **kwargs)

    torch.optim.AdamW.step = counted


def hang_in_checkpoint(step: int, marker: Path) -> None:
    """Make rank 0 hang just before it renames step ``step``'s finished partial checkpoint
    into place (after writing ``marker``): a kill there lands mid-write."""
    from rlver_lib import checkpoint

    commit = checkpoint.commit_directory

    def hanging(partial, path):
        if Path(path).name == f"step_{step:06d}":
            marker.write_text(str(partial), encoding="utf-8")
            time.sleep(3600)
        commit(partial, path)

    checkpoint.commit_directory = hanging


def train(run: dict) -> list[dict]:
    """Train as ``run`` says; returns the metrics rows (and writes ``rank<r>.json``)."""
    from rlver_lib.trainer import Trainer

    cfg = build_config(run["config"])
    change = {"hashed": hashed_change, "starts_with_i": starts_with_i}[run.get("change", "hashed")]
    rank = int(os.environ.get("RANK", "0"))
    failing = run.get("failing_scenarios")
    simulator = FailingFor(change, None if run.get("error_on_rank") == rank else set(failing or []))
    out = cfg.run_dir / "train" / f"rank{rank}.json"
    if run.get("hang_in_checkpoint"):
        (cfg.run_dir / "train").mkdir(parents=True, exist_ok=True)
        hang_in_checkpoint(run["hang_in_checkpoint"], cfg.run_dir / "train" / "hanging_in_checkpoint")
    try:
        trainer = Trainer(cfg, tiny_scenarios(run["scenarios"], run.get("identical", False)), simulator=simulator)
    except ConfigError as err:
        if not run.get("expect_error"):
            raise
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"error": str(err)}), encoding="utf-8")
        return []
    if run.get("one_by_one", True):
        trainer.policy_backend = OneByOne(trainer.policy_backend, trainer.step)
    if run.get("interrupt_after"):
        trainer.train(stop_after=run["interrupt_after"])
        trainer.accelerator.wait_for_everyone()
        del trainer
        trainer = Trainer(cfg, tiny_scenarios(run["scenarios"], run.get("identical", False)), simulator=simulator)
        if run.get("one_by_one", True):
            trainer.policy_backend = OneByOne(trainer.policy_backend, trainer.step)
    resumed_from = trainer.step
    ADAMW_STEPS[0] = 0
    rows = trainer.train()
    accelerator = trainer.accelerator
    lora = sum(float(p.double().sum()) for n, p in trainer.model.policy.named_parameters() if "lora_" in n)
    zero = getattr(trainer.optimizer, "optimizer", None)  # under DeepSpeed: the ZeRO optimizer
    masters = getattr(zero, "single_partition_of_fp32_groups", None)
    dialogues = [r for _, r in iter_jsonl(cfg.run_dir / "train" / "dialogues" / "step_000001.jsonl")]
    info = {"process_index": accelerator.process_index, "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type), "lora_checksum": lora,
            "steps": [r["step"] for r in rows], "timeout_s": _process_group_timeout_s(),
            "resumed_from": resumed_from, "optimizer": type(zero).__name__, "adamw_steps": ADAMW_STEPS[0],
            "trainable_dtypes": {n: str(p.dtype) for n, p in trainer.model.named_parameters()
                                 if p.requires_grad and ("lora_A" in n and "layers.0." in n or "value_head" in n)},
            "master_dtypes": sorted({str(t.dtype) for t in masters}) if masters else None,
            "failed_scenarios": sorted(simulator.failed),
            "replies": {d["dialogue_id"]: [x["content"] for x in d["transcript"] if x["role"] == "assistant"]
                        for d in dialogues}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info), encoding="utf-8")
    return rows


def pipeline(config: dict) -> None:
    from rlver_lib.pipeline.run import run_pipeline

    run_pipeline(build_config(config), progress=False)


def main() -> None:
    torch.set_num_threads(1)
    count_adamw_steps()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT-compiled C++
    for run in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
        if "pipeline" in run:
            pipeline(run["pipeline"])
        else:
            train(run)


if __name__ == "__main__":
    main()
