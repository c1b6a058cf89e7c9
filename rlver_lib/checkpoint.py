"""Checkpoints of a training run, on accelerate's ``save_state`` / ``load_state``
(docs/ARCHITECTURE.md "Run folder").

``checkpoints/step_NNNNNN/`` holds what accelerate saves — the optimizer
(``optimizer.bin``; under DeepSpeed every rank's ZeRO partition in ``pytorch_model/``,
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``), the LR scheduler
(``custom_checkpoint_0.pkl``), every rank's RNG states (``random_states_<rank>.pkl``)
and the trainable weights only (``model.safetensors``; under DeepSpeed
``pytorch_model/mp_rank_00_model_states.pt``: LoRA and value head; the frozen base
model is never copied) — plus ``adapter/``
(``peft`` ``save_pretrained``, for reading or evaluating a checkpoint), ``config.yaml``
and ``trainer_state.json`` (step, data position, algorithm, number of processes).
Every rank writes into ``.step_NNNNNN.partial``, which rank 0 renames into place
once all have finished, so a checkpoint folder is complete or absent.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlver_lib.files import CheckpointFolder, RunFolder, atomic_write_json, commit_directory

STATE_FILE = CheckpointFolder(Path()).state.name  # "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run."""


class Checkpoints:
    """The checkpoint folders of one run under ``root`` (``.../train/checkpoints``).

    ``accelerator``: the run's ``accelerate.Accelerator`` (its prepared optimizer and
    the objects registered with ``register_for_checkpointing`` are saved);
    ``model``: the unwrapped module whose ``requires_grad`` parameters are the
    trainable state; ``keep``: how many complete checkpoints to keep (oldest pruned).
    Every method is called on every process.
    """

    def __init__(self, accelerator, root: Path, model: nn.Module, keep: int):
        self.accelerator, self.root, self.model, self.keep = accelerator, Path(root), model, keep
        self.deepspeed = getattr(accelerator.state, "deepspeed_plugin", None) is not None
        accelerator.register_save_state_pre_hook(self._keep_trainable_weights)
        accelerator.register_load_state_pre_hook(self._load_trainable_weights)

    def _trainable(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters() if p.requires_grad}

    def _keep_trainable_weights(self, models: list, weights: list, output_dir: str) -> None:
        # accelerate would save each model's full state dict; keep the trainable part only,
        # under the unwrapped model's names (the same with or without a DDP wrapper)
        for i in range(len(weights)):
            weights[i] = {name: t.contiguous() for name, t in self._trainable().items()}

    def _load_trainable_weights(self, models: list, input_dir: str) -> None:
        if not models:  # DeepSpeed: the engine loaded its own checkpoint
            return
        from accelerate.utils import SAFE_WEIGHTS_NAME
        from safetensors.torch import load_file

        state = load_file(str(Path(input_dir) / SAFE_WEIGHTS_NAME))
        trainable = self._trainable()
        if set(state) != set(trainable):
            missing, unexpected = sorted(set(trainable) - set(state)), sorted(set(state) - set(trainable))
            raise CheckpointError(f"{input_dir}: weights do not fit the model (missing {missing[:3]}, "
                                  f"unexpected {unexpected[:3]})")
        with torch.no_grad():
            for name, tensor in trainable.items():
                tensor.copy_(state[name])
        models.clear()  # loaded here; accelerate must not load a full state dict

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir()
                      if p.is_dir() and p.name.startswith("step_") and CheckpointFolder(p).state.is_file())

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        found = self.complete()
        return found[-1] if found else None

    def save(self, step: int, state: dict[str, Any], write_extras: Callable[[Path], None]) -> Path:
        """Write ``step_NNNNNN``: accelerate's state from every rank, then (rank 0)
        ``write_extras(folder)`` and ``state`` as ``trainer_state.json``; rename into
        place and prune to ``keep``. Returns the folder."""
        accelerator = self.accelerator
        path = self.root / RunFolder.step_name(step)
        partial = self.root / f".{path.name}.partial"
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        accelerator.wait_for_everyone()
        kwargs = {"exclude_frozen_parameters": True} if self.deepspeed else {}
        accelerator.save_state(str(partial), **kwargs)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_extras(partial)
            atomic_write_json(CheckpointFolder(partial).state, state)
            commit_directory(partial, path)
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return path

    @staticmethod
    def state(path: Path) -> dict[str, Any]:
        """The ``trainer_state.json`` of checkpoint ``path``."""
        return json.loads(CheckpointFolder(path).state.read_text(encoding="utf-8"))

    def load(self, path: Path) -> None:
        """Restore accelerate's state from ``path`` on every rank. Raises
        :class:`CheckpointError` on a folder this version cannot read, and under
        DeepSpeed on a checkpoint written by another number of processes: ZeRO's
        optimizer partitions are per rank, and DeepSpeed 0.19 refuses them
        (``ZeRORuntimeException: ... DP world size of 2 but the current world size
        is 1``) only after the model is loaded. Elsewhere that is a warning: the
        RNG states of ranks without a saved state are not restored."""
        path = Path(path)
        if not (path / "random_states_0.pkl").is_file():
            raise CheckpointError(f"{path}: not an accelerate checkpoint (written by an older version?); "
                                  "move it away to start the run afresh")
        saved_processes = int(self.state(path).get("num_processes", 1))
        if self.deepspeed and saved_processes != self.accelerator.num_processes:
            raise CheckpointError(
                f"{path}: written by {saved_processes} process(es) under DeepSpeed ZeRO, resumed on "
                f"{self.accelerator.num_processes}: ZeRO's optimizer states are partitioned per process and "
                f"DeepSpeed cannot re-partition them. Resume with {saved_processes} processes, or move the "
                f"checkpoints folder away and start a new run from its adapter "
                f"(policy.adapter: {CheckpointFolder(path).adapter}; the optimizer state is lost)")
        if saved_processes != self.accelerator.num_processes:
            warnings.warn(f"{path}: written by {saved_processes} process(es), resumed on "
                          f"{self.accelerator.num_processes}: the RNG states of ranks without a saved state "
                          "are not restored", stacklevel=2)
        kwargs = {"load_module_strict": False} if self.deepspeed else {}
        self.accelerator.load_state(str(path), **kwargs)
