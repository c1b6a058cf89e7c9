"""The learner loop: LoRA PPO and GRPO over multi-turn dialogues (the RLVER paper's
training; docs/ARCHITECTURE.md "Code map").

Batch sizes are global and counted in dialogues (:func:`~rlver_lib.learner.batch_problems`), so a recipe
means the same on any number of processes. A step: sample ``scenarios_per_step``
scenarios (:func:`sample_scenario_indices`); each process rolls out ``group_size``
dialogues for each scenario of its equal share (whole GRPO groups stay on one process),
from its own random stream (:func:`process_seed`); reward = final emotion / 100 minus
``format_penalty``; old (and reference) log-probs and old values are scored on exactly
the sampled ids; advantages (GRPO: group-normalised, uninformative groups left out; PPO:
GAE across turns, whitened over all processes); ``epochs_per_step`` passes, each one
optimizer step per ``mini_batch_size`` trained dialogues of all processes
(:func:`~rlver_lib.learner.dialogue_windows`), a process's share split into ``grad_accum_steps``
micro-batches through accelerate's gradient accumulation; one LR-scheduler step; the
policy hand-over to the rollout backend.
Every process takes part in the same collectives and optimizer steps every step
(zero-weight micro-batches where it has no samples); losses are normalised by the
token count of the whole optimizer step over all processes. The maths:
:mod:`rlver_lib.learner`; checkpoints:
:mod:`rlver_lib.checkpoint`; run folder: docs/ARCHITECTURE.md "Run folder".
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from rlver_lib import credit
from rlver_lib.algorithm_objects import algorithm_for
from rlver_lib.backends import Closing, PolicyBackend, close_backend
from rlver_lib.checkpoint import Checkpoints
from rlver_lib.config import ConfigError, RunConfig, TrainingConfig, training_problems
from rlver_lib.files import CheckpointFolder, RunFolder, atomic_directory, atomic_write_text, iter_jsonl, write_jsonl
from rlver_lib.learner import (
    UPDATE_SUMS,
    Collectives,
    Sample,
    assign_advantages,
    batch_notes,
    batch_problems,
    build_model,
    collate,
    credit_turn_rewards,
    dialogue_windows,
    empty_sample,
    explained_variance_after,
    micro_batch_loss,
    optimizer_groups,
    optimizer_steps_per_epoch,
    samples_from_trajectories,
    score_old,
    scoring_batch_size,
    step_metrics,
    train_reward,
    update_metrics,
    window_sizes,
)
from rlver_lib.params import dump_config

TIMING_METRICS = ("step_time_s", "rollout_time_s", "update_time_s", "tokens_per_s",
                  "generated_tokens_per_s", "peak_memory_mb")


class TrainerError(RuntimeError):
    """A training run that cannot proceed (bad launch, too few scenarios, bad checkpoint)."""


def _step_seed(seed: int, step: int) -> int:
    """A per-step seed derived from the run seed (independent of resume history)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def process_seed(seed: int, process_index: int) -> int:
    """The seed process ``process_index`` of a launch draws from, given the launch's
    ``seed``: ``seed`` itself on process 0 (a one-process run samples exactly as it
    always did), one derived from ``(seed, process_index)`` on the others, so no two
    processes share a random stream (backends then seed each dialogue of a batch
    from it: one row of a batched ``generate``, vLLM's per-request seeds)."""
    if process_index == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, 0x5EED, process_index]).generate_state(1)[0])


def sample_scenario_indices(n_scenarios: int, position: int, count: int, seed: int) -> tuple[list[int], int]:
    """``count`` distinct scenario indices for the step starting at data ``position``.

    Returns ``(indices, new_position)``. The data stream is a sequence of epochs of
    ``n_scenarios`` positions each; epoch ``e`` visits the permutation seeded by
    ``(seed, e)``. A step takes the next ``count`` positions of the current epoch; when
    fewer than ``count`` are left it skips them and starts the next epoch (``drop_last``
    in PyTorch's ``DataLoader``), so a step never repeats a scenario and every epoch
    visits ``count * (n_scenarios // count)`` distinct scenarios (the skipped tail
    differs from epoch to epoch). A pure function of ``(n_scenarios, position, count,
    seed)``: a resumed run continues exactly.

    Raises :class:`TrainerError` when there are no scenarios or ``count`` exceeds
    ``n_scenarios`` (a step would have to repeat a scenario: raise
    ``training.group_size`` for more dialogues per scenario instead).
    """
    if n_scenarios < 1:
        raise TrainerError("no training scenarios")
    if count < 1 or position < 0:
        raise TrainerError(f"need count >= 1 and position >= 0, got count={count}, position={position}")
    if count > n_scenarios:
        raise TrainerError(
            f"training.scenarios_per_step={count} exceeds the {n_scenarios} training scenario(s): a step "
            "would repeat a scenario. Lower training.scenarios_per_step (or raise training.group_size "
            "for more dialogues per scenario).")
    epoch, offset = divmod(position, n_scenarios)
    if offset + count > n_scenarios:  # the tail of this epoch is too short: skip it
        epoch, offset = epoch + 1, 0
    perm = np.random.default_rng([seed, epoch]).permutation(n_scenarios)
    return perm[offset:offset + count].tolist(), epoch * n_scenarios + offset + count


# ---------------------------------------------------------------- launch checks


def _zero_stage(accelerator) -> int:
    """The DeepSpeed ZeRO stage of this launch (0 when DeepSpeed is not in use)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def check_launch(accelerator) -> None:
    """Refuse launches that would silently mis-train. Raises :class:`TrainerError` when

    - the environment says ``WORLD_SIZE > 1`` but accelerate runs this process alone
      (plain ``torchrun`` on CPU: every process would train its own copy into the same
      run folder);
    - DeepSpeed ZeRO-3 shards the weights: every rank's generation would have to run in
      lockstep and the LoRA weights could not be handed to a rollout engine.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and accelerator.num_processes == 1:
        raise TrainerError(
            f"WORLD_SIZE={world} in the environment, but accelerate runs this process alone "
            f"({accelerator.distributed_type}): each of the {world} processes would train its own copy into the "
            "same run folder. On GPUs launch with `accelerate launch --config_file params/accelerate/ddp.yaml "
            f"...`; on CPU with `ACCELERATE_USE_CPU=true torchrun --nproc_per_node {world} ...`.")
    if _zero_stage(accelerator) == 3:
        raise TrainerError("DeepSpeed ZeRO-3 is not supported: it shards the weights, so rollouts would need "
                           "every rank to generate in lockstep and the LoRA adapter could not be handed to vLLM. "
                           "Use params/accelerate/ddp.yaml or zero2.yaml.")


def process_group_kwargs(timeout_s: float):
    """accelerate's ``InitProcessGroupKwargs`` for this launch: the collective timeout
    ``timeout_s`` (seconds) of the whole launch (the process group is made once per
    process) and, for a DeepSpeed launch on a machine without CUDA, the ``gloo``
    backend. accelerate leaves the backend unset there (it knows NCCL and the other
    accelerators' libraries only) and then counts one process, so DeepSpeed's batch
    check fails (``train_batch_size ... 1 != 1 * 1 * 2``); DeepSpeed's CPU accelerator
    itself communicates over gloo when oneCCL is absent."""
    from accelerate.utils import InitProcessGroupKwargs

    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=timeout_s)}
    deepspeed_launch = (os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
                        and int(os.environ.get("LOCAL_RANK", "-1")) != -1)
    if deepspeed_launch and not torch.cuda.is_available():
        kwargs["backend"] = "gloo"
    return InitProcessGroupKwargs(**kwargs)


def configure_deepspeed(accelerator, training: TrainingConfig) -> None:
    """Under DeepSpeed, put the accumulation, clipping and micro-batch settings of
    ``training`` into the DeepSpeed config before ``prepare``: the engine, not the
    trainer, accumulates and clips there (``accelerator.clip_grad_norm_`` only reports
    its norm). A value the DeepSpeed config sets explicitly must agree, else
    :class:`TrainerError`.

    accelerate hands every later ``Accelerator`` of a process the first one's plugin
    (``rlver ablate`` trains several runs in one process), whose config accelerate and
    this function filled in for the first run (``train_batch_size`` too); the launch's
    config is therefore kept on first sight (``plugin.launch_config``) and restored,
    in place, before each run's settings go in."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    launch = plugin.__dict__.setdefault("launch_config", copy.deepcopy(plugin.deepspeed_config))
    plugin.deepspeed_config.clear()
    plugin.deepspeed_config.update(copy.deepcopy(launch))
    # DeepSpeed's nominal micro-batch (its batch-size bookkeeping only: the trainer feeds the
    # engine itself): a process's dialogues per micro-batch, at least 1
    micro = max(1, training.mini_batch_size // (accelerator.num_processes * training.grad_accum_steps))
    wanted = {"gradient_accumulation_steps": ("grad_accum_steps", training.grad_accum_steps),
              "gradient_clipping": ("max_grad_norm", training.max_grad_norm),
              "train_micro_batch_size_per_gpu": ("mini_batch_size", micro)}
    config = plugin.deepspeed_config
    for key, (name, value) in wanted.items():
        current = config.get(key, "auto")
        if current in ("auto", None):
            config[key] = value
        elif float(current) != float(value):
            raise TrainerError(f"the DeepSpeed config sets {key}={current} but training.{name} is {value}; "
                               f"set {key}: auto in the DeepSpeed config")


def lr_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig):
    """The LR schedule (``transformers.get_scheduler``: ``constant`` means
    ``constant_with_warmup``, so ``warmup_steps`` is honoured by every schedule).

    Stepped once here, so that training step ``s`` (1-based) runs at the schedule's
    value at ``s``: step 1 is not at LR 0; warmup reaches the peak at step
    ``warmup_steps``; linear/cosine decay reach 0 one step after the last. A PPO critic
    warm-up (``training.ppo.critic_warmup_steps``) holds the first group's (the LoRA
    weights') rate at 0 through its steps; the value head's group follows the schedule.
    """
    from transformers import get_scheduler

    name = "constant_with_warmup" if training.lr_schedule == "constant" else training.lr_schedule
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=training.warmup_steps,
                              num_training_steps=training.steps + 1)
    warmup = algorithm_for(training).critic_warmup_steps(training)
    if warmup:
        policy_factor = scheduler.lr_lambdas[0]
        scheduler.lr_lambdas[0] = lambda step: 0.0 if step <= warmup else policy_factor(step)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
        scheduler.step()
    return scheduler


def rest_rollout_backend(backend: Any) -> None:
    """Let the rollout ``backend`` free its device memory while the learner scores and
    updates (its ``sleep``, where it has one: vLLM's sleep mode,
    ``policy.vllm_sleep_mode``); it wakes up at its next ``generate``."""
    sleep = getattr(backend, "sleep", None)
    if sleep is not None:
        sleep()



# ---------------------------------------------------------------- the learner


class Trainer(Closing):
    """LoRA PPO / GRPO learner for one run (see the module docstring for a step).

    ``cfg``: the run configuration (``training`` selects the algorithm and settings);
    ``train_scenarios``: the scenarios to sample from; ``simulator``: anything with
    ``opening_lines``/``step`` (default: built from ``cfg.simulator``);
    ``policy_backend``: the generation backend, a
    :class:`~rlver_lib.backends.PolicyBackend` that is handed the policy after every
    update (default: :func:`rlver_lib.models.make_policy_backend` over the live model).

    ``algorithm`` is the :class:`~rlver_lib.algorithm_objects.Algorithm` that
    ``training.algorithm`` names, chosen once here; the learner's functions ask the same
    object (:func:`~rlver_lib.algorithm_objects.algorithm_for`).
    ``model`` is the :class:`~rlver_lib.learner.PolicyWithValueHead` (its ``policy`` the live
    ``peft.PeftModel``); ``prepared`` is what ``accelerator.prepare`` made of it (a DDP
    or DeepSpeed wrapper, or the model itself), used for the update's forward and
    backward passes. Dropout is switched off in the whole model (as TRL's
    ``disable_dropout``) so old and new log-probs come from the same function. The KL
    reference (``kl_coef > 0``) is the base model with the adapter disabled, also when
    the run starts from ``policy.adapter``.

    Raises :class:`~rlver_lib.config.ConfigError` for settings the learner refuses
    (:func:`~rlver_lib.config.training_problems`) and :class:`TrainerError` for a bad
    launch (:func:`check_launch`), a ``policy_backend`` without ``sync_policy``, too few
    scenarios or a broken checkpoint.

    ``with Trainer(...) as trainer:`` (or :meth:`close`) stops the servers the trainer
    started itself (the simulator's, a served policy's); those passed in stay open.
    """

    def __init__(self, cfg: RunConfig, train_scenarios: Sequence[Any], *,
                 simulator: Any | None = None, policy_backend: PolicyBackend | None = None):
        from accelerate import Accelerator
        from transformers import set_seed

        from rlver_lib.models import make_policy_backend

        problems = training_problems(cfg)
        if problems:
            raise ConfigError("; ".join(problems))
        if policy_backend is not None and not isinstance(policy_backend, PolicyBackend):
            raise TrainerError(f"policy_backend {type(policy_backend).__name__} has no sync_policy(model, step): "
                               "the trainer could not hand it the updated policy (rlver_lib.backends.PolicyBackend)")
        training = cfg.training
        self.algorithm = algorithm_for(training)
        self._critic_warmup = self.algorithm.critic_warmup_steps(training)
        note = credit.one_turn_note(training.credit, self.algorithm.name) if cfg.rollout.max_turns == 1 else None
        if note:
            warnings.warn(note, stacklevel=2)
        sample_scenario_indices(len(train_scenarios), 0, training.scenarios_per_step, cfg.seed)  # fail early
        self.cfg, self.training, self.scenarios = cfg, training, list(train_scenarios)
        self.accelerator = Accelerator(gradient_accumulation_steps=training.grad_accum_steps,
                                       kwargs_handlers=[process_group_kwargs(cfg.distributed.timeout_s)])
        self.accelerator.gradient_accumulation_steps = training.grad_accum_steps  # over any launcher default
        check_launch(self.accelerator)
        problems = batch_problems(training, self.accelerator.num_processes)
        if problems:
            raise ConfigError("; ".join(problems))
        for batch_note in batch_notes(training, self.accelerator.num_processes):
            warnings.warn(batch_note, stacklevel=2)
        configure_deepspeed(self.accelerator, training)
        self.folder = RunFolder(cfg.run_dir)
        set_seed(cfg.seed)

        self.model, self.tokenizer = build_model(cfg)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(optimizer_groups(self.model, training), weight_decay=training.weight_decay)
        self.scheduler = lr_scheduler(optimizer, training)  # stepped once per training step, not per process
        self.prepared, self.optimizer = self.accelerator.prepare(self.model, optimizer)
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.collect = Collectives(self.accelerator)
        self.checkpoints = Checkpoints(self.accelerator, self.folder.checkpoints, self.model,
                                       training.keep_checkpoints)
        self.pad_id = self.tokenizer.pad_token_id
        self.policy_backend = policy_backend or make_policy_backend(cfg.policy, self.model.policy, self.tokenizer)
        self._started = [] if policy_backend else [self.policy_backend]
        if simulator is None:
            from rlver_lib.models import build_simulator

            simulator = build_simulator(cfg.simulator, process_seed(cfg.seed, self.accelerator.process_index))
            self._started.append(simulator)
        self.simulator = simulator
        self.step, self.data_position = 0, 0
        self.history: list[dict[str, Any]] = []
        self._writer = None
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ public

    def close(self) -> None:
        """Stop what this trainer started (the simulator's server, a served policy)."""
        for held in self._started:
            close_backend(held)

    def train(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Run up to ``training.steps`` steps (resuming where the run folder left off).

        ``stop_after`` ends this call after that global step without finishing the
        run (no final adapter) — what an interruption looks like. Returns the metrics
        rows of all steps so far.
        """
        training = self.training
        last = training.steps if stop_after is None else min(stop_after, training.steps)
        bar = tqdm(total=training.steps, initial=self.step, desc=f"{self.algorithm.name} steps",
                   disable=not self.accelerator.is_main_process)
        while self.step < last:
            self.step += 1
            row = self._train_step()
            self._log(row)
            if self.step % training.checkpoint_every == 0 or self.step == training.steps:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        bar.close()
        if self.step >= training.steps:
            self.save_adapter(self.folder.adapter)
        if self._writer is not None:
            self._writer.flush()
        return self.history

    def save_adapter(self, path: Path) -> Path:
        """Save the LoRA adapter (safetensors) to ``path`` atomically."""
        if self.accelerator.is_main_process:
            with atomic_directory(path) as tmp:
                self.model.policy.save_pretrained(tmp, safe_serialization=True)
        self.accelerator.wait_for_everyone()
        return path

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN`` (:class:`~rlver_lib.checkpoint.Checkpoints`)."""
        def extras(folder: Path) -> None:
            self.model.policy.save_pretrained(CheckpointFolder(folder).adapter, safe_serialization=True)
            atomic_write_text(CheckpointFolder(folder).config, dump_config(self.cfg))

        state = {"step": self.step, "data_position": self.data_position, "algorithm": self.algorithm.name,
                 "num_processes": self.accelerator.num_processes}
        if hasattr(self.model, "value_offset"):  # a buffer, not a trainable weight: kept here
            state["value_offset"] = float(self.model.value_offset)
        return self.checkpoints.save(self.step, state, extras)

    # ------------------------------------------------------------ one step

    def _train_step(self) -> dict[str, Any]:
        from rlver_lib.rollout import run_rollouts

        training, policy_cfg, accelerator = self.training, self.cfg.policy, self.accelerator
        start = time.perf_counter()
        step_seed = _step_seed(self.cfg.seed, self.step)
        indices, self.data_position = sample_scenario_indices(
            len(self.scenarios), self.data_position, training.scenarios_per_step, self.cfg.seed)
        shard = [self.scenarios[i] for i in indices[accelerator.process_index::accelerator.num_processes]]
        # every process samples from its own stream (rank 0's is the one-process stream)
        rollout_seed = process_seed(step_seed, accelerator.process_index)
        trajectories = run_rollouts(
            self.policy_backend, self.simulator, shard, n_per_scenario=training.group_size,
            max_turns=self.cfg.rollout.max_turns, initial_emotion=self.cfg.simulator.initial_emotion,
            think=policy_cfg.think, seed=rollout_seed, progress=False,
            max_context_tokens=policy_cfg.max_context_tokens,
            format_violation=policy_cfg.format_violation, sampling=policy_cfg.sampling(rollout_seed))
        rollout_s = time.perf_counter() - start
        rest_rollout_backend(self.policy_backend)
        self._stop_if_simulator_died(trajectories)

        rewards = {t.dialogue_id: train_reward(t, training.format_penalty, training.reward_scale)
                   for t in trajectories}
        turn_rewards = credit_turn_rewards(trajectories, training)
        trained = [t for t in trajectories if t.samples and (t.termination != "error" or training.credit == "per_turn"
                                                             or training.error_dialogues == "zero_reward")]
        samples = samples_from_trajectories(trained)
        update_start = time.perf_counter()
        if self.step == 1 and hasattr(self.model, "value_offset"):  # training.ppo.value_offset, fixed once
            total, count = self.collect.sum(torch.tensor(
                [sum(rewards[t.dialogue_id] for t in trained), len(trained)], dtype=torch.float64)).tolist()
            self.model.value_offset.fill_(total / count if count else 0.0)
        score_old(self.model, samples, batch_size=scoring_batch_size(samples, training, accelerator.num_processes),
                  pad_id=self.pad_id,
                  device=accelerator.device, reference=training.kl_coef > 0)
        samples, sums, extra = assign_advantages(samples, rewards, training, self.collect, turn_rewards)
        update = self._update(samples, step_seed)
        if self.algorithm.critic:
            extra["explained_variance_after"] = explained_variance_after(
                self.model, samples, self.collect, pad_id=self.pad_id, device=accelerator.device,
                batch_size=scoring_batch_size(samples, training, accelerator.num_processes))
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the rate this step's update used
        self.scheduler.step()
        update_s = time.perf_counter() - update_start
        self.policy_backend.sync_policy(self.model.policy, self.step)

        ids = {t.dialogue_id for t in trained}
        records = self.collect.gather([dict(t.to_record(), train_reward=rewards[t.dialogue_id],
                                     trained=t.dialogue_id in ids) for t in trajectories])
        if accelerator.is_main_process:
            write_jsonl(self.folder.step_dialogues_file(self.step),
                        [{k: v for k, v in r.items() if k not in ("train_reward", "trained")} | {"step": self.step}
                         for r in records])
        return step_metrics(records, sums, update, step=self.step, data_position=self.data_position,
                            num_processes=accelerator.num_processes, learning_rate=learning_rate,
                            rollout_time_s=rollout_s, update_time_s=update_s,
                            step_time_s=time.perf_counter() - start, **extra)

    def _stop_if_simulator_died(self, trajectories) -> None:
        """Raise :class:`TrainerError` on every process when any process's simulated user
        lost its backend (its server process died): the step's dialogues, those in
        flight ending in ``error``, are written first; nothing of the step is trained
        and the last checkpoint stays, so running the same command again resumes."""
        fatal = getattr(self.simulator, "fatal_error", None)
        if not int(self.collect.max(torch.tensor([float(fatal is not None)]))):
            return
        records = self.collect.gather([t.to_record() | {"step": self.step} for t in trajectories])
        if self.accelerator.is_main_process:
            write_jsonl(self.folder.step_dialogues_file(self.step, failed=True), records)
        last = self.checkpoints.latest()
        raise TrainerError(
            f"step {self.step}: the simulated user's backend died ({fatal or 'on another process'}); "
            f"nothing of this step was trained; its dialogues are in "
            f"{self.folder.step_dialogues_file(self.step, failed=True)}; "
            f"last checkpoint: {last or 'none yet'}; run the same command again to resume")

    def _update(self, samples: list[Sample], step_seed: int) -> dict[str, float]:
        """``epochs_per_step`` passes; each pass deals the trained dialogues of all processes
        into :func:`~rlver_lib.learner.optimizer_steps_per_epoch` windows of about ``mini_batch_size`` dialogues
        (:func:`~rlver_lib.learner.dialogue_windows`), one optimizer step per window; each process splits its
        share of a window (all turns of its dialogues there) into ``grad_accum_steps``
        micro-batches (accelerate's ``accumulate``). Returns the step's update statistics
        over all processes (``{}`` when no process has samples)."""
        training, accelerator = self.training, self.accelerator
        accumulation = training.grad_accum_steps
        by_dialogue: dict[str, list[Sample]] = defaultdict(list)
        for s in samples:
            by_dialogue[s.dialogue_id].append(s)
        dialogues = list(by_dialogue)
        rank, processes = accelerator.process_index, accelerator.num_processes
        counts = torch.zeros(processes, dtype=torch.float64)
        counts[rank] = len(dialogues)
        counts = self.collect.sum(counts)  # every process's trained dialogues
        total = int(counts.sum())
        if total == 0:  # every process skips alike: nobody has anything to learn from
            return {}
        n_windows = optimizer_steps_per_epoch(total, training.mini_batch_size)  # the same on every process
        offset = int(counts[:rank].sum())
        generator = torch.Generator().manual_seed(step_seed)
        keys = UPDATE_SUMS + self.algorithm.update_sums
        totals = dict.fromkeys(keys, 0.0)
        grad_norms: list[float] = []
        window_samples: list[float] = []
        self.prepared.train()
        for _ in range(training.epochs_per_step):
            order = torch.randperm(len(dialogues), generator=generator).tolist()
            windows: list[list[Sample]] = [[] for _ in range(n_windows)]
            for d, w in zip(order, dialogue_windows(len(dialogues), offset, n_windows)):
                windows[w].extend(by_dialogue[dialogues[d]])
            chunks = [[window[i] for i in part] for window in windows
                      for part in np.array_split(np.arange(len(window)), accumulation)]
            sizes = self.collect.sum(window_sizes(chunks, accumulation))  # each window's loss normalisers
            for k, chunk in enumerate(chunks):
                tokens, rows = sizes[k // accumulation].tolist()
                if rows == 0:  # an empty window on every process: no optimizer step
                    continue
                batch = collate(chunk or [empty_sample(self.pad_id)], self.pad_id, accelerator.device)
                with accelerator.accumulate(self.prepared):
                    loss, parts = micro_batch_loss(self.prepared, batch, training, tokens=tokens, rows=rows,
                                                   max_new_tokens=self.cfg.policy.max_new_tokens,
                                                   critic_only=self.step <= self._critic_warmup)
                    # accelerator.backward divides by grad_accum_steps and DDP / ZeRO average
                    # the gradients over processes; the loss's normalisers already are the
                    # whole window's, so scaling back up makes the summed gradient exactly
                    # that of the window's loss (one token mean over the global batch)
                    accelerator.backward(loss * accumulation * accelerator.num_processes)
                    if accelerator.sync_gradients:  # the window's last micro-batch
                        norm = accelerator.clip_grad_norm_(self.trainable, training.max_grad_norm)
                        if norm is not None:
                            grad_norms.append(float(norm))
                    self.optimizer.step()  # a no-op until the window is complete
                    self.optimizer.zero_grad(set_to_none=True)
                for key, value in parts.items():
                    totals[key] += value
            window_samples += [rows for _, rows in sizes.tolist() if rows > 0]
        summed = self.collect.sum(torch.tensor([totals[k] for k in keys], dtype=torch.float64))
        update = update_metrics(dict(zip(keys, summed.tolist())), grad_norms, training,
                                windows=len(window_samples))
        update.update(optimizer_steps=len(window_samples), samples_per_update=float(np.mean(window_samples)),
                      dialogues_per_update=total * training.epochs_per_step / len(window_samples))
        return update

    # ------------------------------------------------------------ collectives, files

    def _log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if not self.accelerator.is_main_process:
            return
        write_jsonl(self.folder.metrics, self.history)
        atomic_write_text(self.folder.metrics_csv, pd.DataFrame(self.history).to_csv(index=False))
        if self.training.tensorboard:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

                self._writer = SummaryWriter(str(self.folder.tensorboard))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, row["step"])

    def _resume(self) -> None:
        """Load the latest complete checkpoint, if any, and drop metrics logged after it."""
        path = self.checkpoints.latest()
        if path is None:
            return
        state = self.checkpoints.state(path)
        if state.get("algorithm") != self.algorithm.name:
            raise TrainerError(f"{path}: checkpoint is for {state.get('algorithm')!r}, "
                               f"config asks for {self.algorithm.name!r}")
        self.checkpoints.load(path)
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        if hasattr(self.model, "value_offset"):
            self.model.value_offset.fill_(float(state["value_offset"]))
        # a fresh rollout engine must sample from the restored adapter
        self.policy_backend.sync_policy(self.model.policy, self.step)
        metrics = self.folder.metrics
        if metrics.is_file():
            self.history = [row for _, row in iter_jsonl(metrics) if row["step"] <= self.step]

