"""The learner loop: LoRA PPO and GRPO over multi-turn dialogues (DESIGN §1 "Learning", §3).

One training step:

1. sample ``training.scenarios_per_step`` scenarios with a seeded, resumable sampler
   (the *data position* counts scenarios consumed; epoch ``e`` is a fixed
   permutation seeded by ``(seed, e)``);
2. roll out ``training.group_size`` dialogues per scenario with
   :func:`rlver_lib.rollout.run_rollouts` (the live LoRA policy generates);
3. reward = final emotion / 100, minus ``training.format_penalty`` for a dialogue with
   any malformed think block; dialogues that ended in ``error`` are left out;
4. recompute old log-probs (and, for PPO, old values; and, when ``kl_coef > 0``,
   reference log-probs with the adapter disabled — ``kl_ref`` is NaN otherwise) on exactly the ids each :class:`~rlver_lib.rollout.TurnSample`
   holds — the context the policy saw plus the ids it sampled;
5. advantages: GRPO — group-normalised dialogue reward given to every policy token
   of the dialogue (all its turns); PPO — GAE over the dialogue's policy tokens, all
   turns chained in order (user/template tokens skipped, see
   :func:`rlver_lib.algorithms.gae`);
6. ``epochs_per_step`` passes of shuffled mini-batches with gradient accumulation,
   gradient clipping, and one LR-scheduler step per training step
   (``transformers.get_scheduler``; ``warmup_steps`` counted in training steps);
7. ``policy_backend.sync_policy(model, step)`` when the backend has it.

Each turn is its own sample (think and non-think alike): the context of turn k is
exactly what the policy saw, which is always correct, and in non-think mode it is
equivalent to one merged sequence per dialogue.

Device placement and data parallelism use ``accelerate``: the same code runs on one
CPU process, ``accelerate launch --num_processes 2 --cpu``, or several GPUs. Each
process rolls out its share of the step's scenarios (whole groups stay on one
process) and gradients are averaged by DDP.

Run folder (``run_dir/train/``): ``metrics.jsonl`` and ``metrics.csv`` (one row per
step), ``dialogues/step_NNNNNN.jsonl``, ``checkpoints/step_NNNNNN/`` (adapter,
value head, optimizer, scheduler, RNG states, step, data position; written to a
temporary folder then renamed; the last ``keep_checkpoints`` kept) and ``adapter/``
(the final LoRA adapter, loadable with ``peft.PeftModel.from_pretrained``). A run
resumes from its latest checkpoint automatically; on CPU the resumed run reproduces
the uninterrupted run's metrics exactly (timings and memory aside).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from . import algorithms as alg
from .backends import ChatBackend, SamplingParams
from .config import RunConfig, dump_config
from .io import atomic_write_json, atomic_write_text, iter_jsonl, write_jsonl

TIMING_METRICS = ("step_time_s", "rollout_time_s", "update_time_s", "tokens_per_s",
                  "generated_tokens_per_s", "peak_memory_mb")


class TrainerError(RuntimeError):
    """A training run that cannot proceed (no usable samples, bad checkpoint)."""


def _step_seed(seed: int, step: int) -> int:
    """A per-step seed derived from the run seed (independent of resume history)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def sample_scenario_indices(n_scenarios: int, position: int, count: int, seed: int) -> tuple[list[int], int]:
    """``count`` scenario indices starting at data ``position``; returns ``(indices, new_position)``.

    Epoch ``e`` (positions ``e*n .. (e+1)*n - 1``) visits a permutation seeded by
    ``(seed, e)``, so the sampler is a pure function of its position and resumes exactly.
    """
    if n_scenarios < 1:
        raise TrainerError("no training scenarios")
    indices: list[int] = []
    while len(indices) < count:
        epoch, offset = divmod(position, n_scenarios)
        perm = np.random.default_rng([seed, epoch]).permutation(n_scenarios)
        take = min(count - len(indices), n_scenarios - offset)
        indices += perm[offset:offset + take].tolist()
        position += take
    return indices, position


def _zero_stage(accelerator: Accelerator) -> int:
    """The DeepSpeed ZeRO stage of this launch (0 when DeepSpeed is not in use)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


class PolicyWithValueHead(nn.Module):
    """The LoRA policy plus (for PPO) a linear value head on the backbone's last hidden state.

    ``forward(input_ids [B, L], attention_mask [B, L], mask [B, L-1])`` returns a dict of
    ``[B, L-1]`` float32 tensors aligned with next-token positions (entry ``t`` scores
    ``input_ids[:, t+1]``): ``logprobs`` (at the sampling temperature), ``entropy``
    (nats) and, with a value head, ``values``. Only positions where ``mask`` is 1 are
    computed (the LM head runs on policy tokens only); the rest are 0.
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear | None, temperature: float):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.temperature = temperature if temperature > 0 else 1.0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor) -> dict:
        base = self.policy.get_base_model()
        hidden = base.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        sel = mask.bool()
        h = hidden[:, :-1][sel]  # [N, H], N = number of policy tokens
        logits = base.get_output_embeddings()(h).float() / self.temperature  # [N, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        targets = input_ids[:, 1:][sel]

        def scatter(values: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
            out[sel] = values
            return out

        out = {
            "logprobs": scatter(logp_all.gather(-1, targets[:, None]).squeeze(-1)),
            "entropy": scatter(-(logp_all.exp() * logp_all).sum(-1)),
        }
        if self.value_head is not None:
            out["values"] = scatter(self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float())
        return out


@dataclass
class _Sample:
    """One policy turn prepared for training; per-position tensors are ``[L-1]``."""

    dialogue: int
    turn: int
    input_ids: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None


def _pad(rows: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(list(rows), batch_first=True, padding_value=value)


def _collate(samples: Sequence[_Sample], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded batch: ``input_ids``/``attention_mask`` ``[B, L]``, the rest ``[B, L-1]``."""
    batch = {
        "input_ids": _pad([s.input_ids for s in samples], pad_id),
        "attention_mask": _pad([torch.ones_like(s.input_ids) for s in samples]),
        "mask": _pad([s.mask for s in samples]),
    }
    for key in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns"):
        if getattr(samples[0], key) is not None:
            batch[key] = _pad([getattr(s, key) for s in samples])
    return {k: v.to(device) for k, v in batch.items()}


def _peak_memory_mb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Trainer:
    """LoRA PPO / GRPO learner for one run (see the module docstring for a step).

    ``cfg``: the run configuration (``training`` selects the algorithm and settings);
    ``train_scenarios``: the scenarios to sample from; ``simulator``: anything with
    ``opening_lines``/``step`` (default: built from ``cfg.simulator`` by
    :func:`rlver_lib.evaluation.build_simulator`); ``policy_backend``: the generation
    backend (default: :func:`rlver_lib.models.make_policy_backend` over the live model).

    Raises :class:`TrainerError` when there are no scenarios or a checkpoint is broken.
    """

    def __init__(self, cfg: RunConfig, train_scenarios: Sequence[Any], *,
                 simulator: Any | None = None, policy_backend: ChatBackend | None = None):
        from accelerate import Accelerator
        from peft import LoraConfig, PeftModel, get_peft_model
        from transformers import get_scheduler

        from .models import load_policy, make_policy_backend

        if not train_scenarios:
            raise TrainerError("no training scenarios")
        self.cfg, self.tcfg = cfg, cfg.training
        self.scenarios = list(train_scenarios)
        self.accelerator = Accelerator()
        if cfg.policy.backend == "vllm" and _zero_stage(self.accelerator) == 3:
            raise TrainerError("vLLM rollouts need the full LoRA weights on every process after each "
                               "update; ZeRO-3 shards them. Use params/accelerate/ddp.yaml or zero2.yaml.")
        self.out_dir = cfg.run_dir / "train"
        self._seed_everything(cfg.seed)

        model, self.tokenizer = load_policy(cfg.policy, trainable=True)
        if not isinstance(model, PeftModel):
            lora = cfg.policy.lora
            model = get_peft_model(model, LoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                target_modules=lora.target_modules, task_type="CAUSAL_LM"))
        if self.tcfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        self.pad_id = self.tokenizer.pad_token_id
        value_head = None
        if self.tcfg.algorithm == "ppo":
            # zero-initialised: the first advantages are then the (whitened) returns, not
            # the noise of a random critic over the backbone's large hidden states
            value_head = nn.Linear(model.config.hidden_size, 1)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        module = PolicyWithValueHead(model, value_head, cfg.policy.temperature)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": self.tcfg.learning_rate}]
        if value_head is not None:
            groups.append({"params": list(value_head.parameters()), "lr": self.tcfg.value_learning_rate})
        optimizer = torch.optim.AdamW(groups)
        self.scheduler = get_scheduler(self.tcfg.lr_schedule, optimizer,
                                       num_warmup_steps=self.tcfg.warmup_steps,
                                       num_training_steps=max(1, self.tcfg.steps))
        self.module, self.optimizer = self.accelerator.prepare(module, optimizer)
        self.core: PolicyWithValueHead = self.accelerator.unwrap_model(self.module)
        self.trainable = [p for group in groups for p in group["params"]]

        self.policy_backend = policy_backend or make_policy_backend(cfg.policy, model, self.tokenizer)
        if simulator is None:
            from .evaluation import build_simulator

            simulator = build_simulator(cfg.simulator, cfg.seed)
        self.simulator = simulator
        self.step = 0
        self.data_position = 0
        self.history: list[dict[str, Any]] = []
        self._writer = None
        self._resume()

    # ------------------------------------------------------------ public

    @property
    def model(self):
        """The live ``peft.PeftModel`` (LoRA policy)."""
        return self.core.policy

    def train(self, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Run up to ``training.steps`` steps (resuming where the run folder left off).

        ``stop_after`` ends this call after that global step without finishing the
        run (no final adapter) — what an interruption looks like. Returns the metrics
        rows of all steps so far.
        """
        last = self.tcfg.steps if stop_after is None else min(stop_after, self.tcfg.steps)
        bar = tqdm(total=self.tcfg.steps, initial=self.step, desc=f"{self.tcfg.algorithm} steps",
                   disable=not self.accelerator.is_main_process)
        while self.step < last:
            self.step += 1
            row = self._train_step()
            self._log(row)
            if self.step % self.tcfg.checkpoint_every == 0 or self.step == self.tcfg.steps:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        bar.close()
        if self.step >= self.tcfg.steps:
            self.save_adapter(self.out_dir / "adapter")
        if self._writer is not None:
            self._writer.flush()
        return self.history

    def save_adapter(self, path: Path) -> Path:
        """Save the LoRA adapter (safetensors) to ``path`` atomically (temp folder, rename)."""
        if self.accelerator.is_main_process:
            with _atomic_dir(path) as tmp:
                self.model.save_pretrained(tmp, safe_serialization=True)
        self.accelerator.wait_for_everyone()
        return path

    # ------------------------------------------------------------ one step

    def _train_step(self) -> dict[str, Any]:
        from .rollout import run_rollouts

        t0 = time.perf_counter()
        step_seed = _step_seed(self.cfg.seed, self.step)
        indices, self.data_position = sample_scenario_indices(
            len(self.scenarios), self.data_position, self.tcfg.scenarios_per_step, self.cfg.seed)
        acc = self.accelerator
        shard = [self.scenarios[i] for i in indices[acc.process_index::acc.num_processes]]
        pol = self.cfg.policy
        self.model.eval()
        trajectories = run_rollouts(
            self.policy_backend, self.simulator, shard, n_per_scenario=self.tcfg.group_size,
            max_turns=self.cfg.rollout.max_turns, initial_emotion=self.cfg.simulator.initial_emotion,
            think=pol.think, seed=step_seed, progress=False, max_context_tokens=pol.max_context_tokens,
            format_violation=pol.format_violation,
            sampling=SamplingParams(temperature=pol.temperature, top_p=pol.top_p,
                                    max_new_tokens=pol.max_new_tokens, seed=step_seed))
        t_rollout = time.perf_counter() - t0

        usable = [t for t in trajectories if t.termination != "error" and t.samples]
        rewards = torch.tensor([self._reward(t) for t in usable], dtype=torch.float32)
        samples = [
            _Sample(d, s.turn, torch.tensor(s.input_ids), torch.tensor(s.loss_mask[1:], dtype=torch.float32))
            for d, t in enumerate(usable) for s in sorted(t.samples, key=lambda s: s.turn)
        ]
        stats: dict[str, Any] = {"zero_variance_groups": 0, "groups": len({t.group_id for t in usable})}
        update: dict[str, float] = {}
        t1 = time.perf_counter()
        if samples:
            self._score_old(samples)
            self._assign_advantages(samples, usable, rewards, stats)
            update = self._update(samples, step_seed)
        self.scheduler.step()
        t_update = time.perf_counter() - t1
        sync = getattr(self.policy_backend, "sync_policy", None)
        if sync is not None:
            sync(self.model, self.step)

        if acc.is_main_process:
            self._write_dialogues(trajectories)
        return self._metrics(trajectories, samples, stats, update, rewards,
                             t_rollout=t_rollout, t_update=t_update, t_total=time.perf_counter() - t0)

    def _reward(self, trajectory) -> float:
        penalty = self.tcfg.format_penalty if trajectory.format_violations else 0.0
        return float(trajectory.reward) - penalty

    def _minibatches(self, samples: Sequence[_Sample], size: int):
        for start in range(0, len(samples), size):
            chunk = samples[start:start + size]
            yield chunk, _collate(chunk, self.pad_id, self.accelerator.device)

    @torch.no_grad()
    def _score_old(self, samples: list[_Sample]) -> None:
        """Old log-probs, reference log-probs (adapter disabled) and old values, per sample."""
        self.core.eval()
        for chunk, batch in self._minibatches(samples, self.tcfg.mini_batch_size):
            args = (batch["input_ids"], batch["attention_mask"], batch["mask"])
            out = self.core(*args)
            ref = None
            if self.tcfg.kl_coef > 0:  # the reference is the same model with the LoRA adapter disabled
                with self.model.disable_adapter():
                    ref = self.core(*args)["logprobs"]
            for i, s in enumerate(chunk):
                n = s.mask.numel()
                s.old_logprobs = out["logprobs"][i, :n].cpu()
                s.ref_logprobs = None if ref is None else ref[i, :n].cpu()
                if "values" in out:
                    s.old_values = out["values"][i, :n].cpu()

    def _assign_advantages(self, samples: list[_Sample], usable, rewards: torch.Tensor, stats: dict) -> None:
        """GRPO: dialogue advantage on every policy token; PPO: GAE over the dialogue's policy tokens."""
        by_dialogue: dict[int, list[_Sample]] = defaultdict(list)
        for s in samples:
            by_dialogue[s.dialogue].append(s)
        if self.tcfg.algorithm == "grpo":
            adv, zero = alg.grpo_advantages(rewards, [t.group_id for t in usable],
                                            scale_rewards=self.tcfg.scale_rewards)
            stats["zero_variance_groups"] = zero
            for s in samples:
                s.advantages = s.mask * adv[s.dialogue]
            return
        # PPO: one row per dialogue holding the old values of its policy tokens, turn after turn.
        dialogues = sorted(by_dialogue)
        rows = [torch.cat([s.old_values[s.mask.bool()] for s in by_dialogue[d]]) for d in dialogues]
        values = _pad(rows)
        mask = _pad([torch.ones_like(r) for r in rows])
        reward_rows = torch.zeros_like(values)
        for i, (d, r) in enumerate(zip(dialogues, rows)):
            reward_rows[i, len(r) - 1] = rewards[d]
        adv, ret = alg.gae(reward_rows, values, mask, gamma=self.tcfg.gamma, lam=self.tcfg.lam)
        if self.tcfg.whiten_advantages:
            adv = alg.masked_whiten(adv, mask)
        for i, d in enumerate(dialogues):
            offset = 0
            for s in by_dialogue[d]:
                sel = s.mask.bool()
                n = int(sel.sum())
                s.advantages = torch.zeros_like(s.mask)
                s.returns = torch.zeros_like(s.mask)
                s.advantages[sel] = adv[i, offset:offset + n]
                s.returns[sel] = ret[i, offset:offset + n]
                offset += n

    def _n_minibatches(self, n_samples: int) -> int:
        """Mini-batches per epoch, equal on every process (DDP needs the same count)."""
        local = torch.tensor([max(1, math.ceil(n_samples / self.tcfg.mini_batch_size))],
                             device=self.accelerator.device)
        return int(self.accelerator.gather(local).min())

    def _update(self, samples: list[_Sample], step_seed: int) -> dict[str, float]:
        tc, acc = self.tcfg, self.accelerator
        generator = torch.Generator().manual_seed(step_seed)
        n_mb = self._n_minibatches(len(samples))
        sums: dict[str, list[float]] = defaultdict(list)
        self.core.train()
        for _ in range(tc.epochs_per_step):
            order = torch.randperm(len(samples), generator=generator).tolist()
            chunks = np.array_split(np.array(order), n_mb)
            for k, chunk_idx in enumerate(chunks):
                window_end = min(len(chunks), (k // tc.grad_accum_steps + 1) * tc.grad_accum_steps)
                window = window_end - (k // tc.grad_accum_steps) * tc.grad_accum_steps
                sync = k + 1 == window_end
                batch = _collate([samples[i] for i in chunk_idx], self.pad_id, acc.device)
                context = acc.no_sync(self.module) if not sync else contextlib.nullcontext()
                with context:
                    loss, parts = self._loss(batch)
                    acc.backward(loss / window)
                for key, val in parts.items():
                    sums[key].append(val)
                if sync:
                    sums["grad_norm"].append(float(acc.clip_grad_norm_(self.trainable, tc.max_grad_norm)))
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
        return {key: float(np.mean(vals)) for key, vals in sums.items()}

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        tc = self.tcfg
        out = self.module(batch["input_ids"], batch["attention_mask"], batch["mask"])
        mask = batch["mask"]
        pol = alg.clipped_policy_loss(out["logprobs"], batch["old_logprobs"], batch["advantages"], mask,
                                      clip_eps=tc.clip_eps, aggregation=tc.loss_aggregation)
        entropy = alg.masked_mean(out["entropy"], mask)
        loss = pol.loss - tc.entropy_coef * entropy
        parts = {"policy_loss": pol.loss.item(), "clip_fraction": pol.clip_fraction.item(),
                 "approx_kl_old": pol.approx_kl.item(), "entropy": entropy.item()}
        if "ref_logprobs" in batch:
            kl = alg.masked_mean(alg.kl_penalty(out["logprobs"], batch["ref_logprobs"], tc.kl_estimator), mask)
            loss = loss + tc.kl_coef * kl
            parts["kl_ref"] = kl.item()
        if "values" in out:
            vloss, vclip = alg.clipped_value_loss(out["values"], batch["old_values"], batch["returns"], mask,
                                                  clip_eps=tc.value_clip_eps)
            loss = loss + tc.vf_coef * vloss
            parts.update(value_loss=vloss.item(), value_clip_fraction=vclip.item())
        return loss, parts

    # ------------------------------------------------------------ metrics and files

    def _metrics(self, trajectories, samples, stats, update, rewards, *, t_rollout, t_update, t_total) -> dict:
        records = self.accelerator.gather_for_metrics(
            [(t.reward, t.final_emotion, t.termination, sum(1 for x in t.turns if x.get("role") == "assistant"),
              t.format_violations) for t in trajectories], use_gather_object=True)
        assistant_turns = [x for t in trajectories for x in t.turns if x.get("role") == "assistant"]
        rew = np.array([r[0] for r in records], dtype=float)
        n = max(1, len(records))
        policy_tokens = sum(int(s.mask.sum()) for s in samples)
        train_tokens = sum(s.input_ids.numel() for s in samples) * self.tcfg.epochs_per_step
        row: dict[str, Any] = {
            "step": self.step,
            "data_position": self.data_position,
            "dialogues": len(records),
            "reward_mean": float(rew.mean()) if len(rew) else float("nan"),
            "reward_std": float(rew.std()) if len(rew) else float("nan"),
            "train_reward_mean": float(rewards.mean()) if len(rewards) else float("nan"),
            "success_rate": sum(r[2] == "success" for r in records) / n,
            "failure_rate": sum(r[2] == "failure" for r in records) / n,
            "error_rate": sum(r[2] == "error" for r in records) / n,
            "final_emotion_mean": float(np.mean([r[1] for r in records])) if records else float("nan"),
            "turns_mean": float(np.mean([r[3] for r in records])) if records else float("nan"),
            "format_violation_rate": sum(r[4] for r in records) / max(1, sum(r[3] for r in records)),
            "zero_variance_group_share": (stats["zero_variance_groups"] / stats["groups"]
                                          if self.tcfg.algorithm == "grpo" and stats["groups"] else 0.0),
            "completion_tokens_mean": policy_tokens / max(1, len(samples)),
            "reply_chars_mean": float(np.mean([len(x.get("content") or "") for x in assistant_turns]))
            if assistant_turns else 0.0,
            "thought_chars_mean": float(np.mean([len(x.get("thought") or "") for x in assistant_turns]))
            if assistant_turns else 0.0,
            "samples": len(samples),
            "learning_rate": self.scheduler.get_last_lr()[0],
            "explained_variance": self._explained_variance(samples),
        }
        row.update({k: update.get(k, float("nan")) for k in (
            "policy_loss", "value_loss", "entropy", "kl_ref", "approx_kl_old", "clip_fraction",
            "value_clip_fraction", "grad_norm")})
        row.update({
            "step_time_s": t_total, "rollout_time_s": t_rollout, "update_time_s": t_update,
            "tokens_per_s": train_tokens / t_update if t_update > 0 else float("nan"),
            "generated_tokens_per_s": policy_tokens / t_rollout if t_rollout > 0 else float("nan"),
            "peak_memory_mb": _peak_memory_mb(),
        })
        return row

    def _explained_variance(self, samples: list[_Sample]) -> float:
        if self.tcfg.algorithm != "ppo" or not samples:
            return float("nan")
        values = torch.cat([s.old_values for s in samples])
        returns = torch.cat([s.returns for s in samples])
        mask = torch.cat([s.mask for s in samples])
        return alg.explained_variance(values, returns, mask)

    def _log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if not self.accelerator.is_main_process:
            return
        write_jsonl(self.out_dir / "metrics.jsonl", self.history)
        atomic_write_text(self.out_dir / "metrics.csv", pd.DataFrame(self.history).to_csv(index=False))
        if self.tcfg.tensorboard:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter  # lazy: optional dependency

                self._writer = SummaryWriter(str(self.out_dir / "tensorboard"))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._writer.add_scalar(f"train/{key}", value, row["step"])

    def _write_dialogues(self, trajectories) -> None:
        write_jsonl(self.out_dir / "dialogues" / f"step_{self.step:06d}.jsonl",
                    [dict(t.to_record(), step=self.step) for t in trajectories])

    # ------------------------------------------------------------ checkpoints

    def _checkpoints(self) -> list[Path]:
        root = self.out_dir / "checkpoints"
        if not root.is_dir():
            return []
        return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
                      and (p / "trainer_state.json").is_file())

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_NNNNNN`` atomically and prune to ``keep_checkpoints``."""
        from safetensors.torch import save_file

        path = self.out_dir / "checkpoints" / f"step_{self.step:06d}"
        if self.accelerator.is_main_process:
            with _atomic_dir(path) as tmp:
                self.model.save_pretrained(tmp / "adapter", safe_serialization=True)
                if self.core.value_head is not None:
                    save_file({k: v.contiguous() for k, v in self.core.value_head.state_dict().items()},
                              str(tmp / "value_head.safetensors"))
                torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
                torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
                torch.save({"python": random.getstate(), "numpy": np.random.get_state(),
                            "torch": torch.get_rng_state(),
                            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                           tmp / "rng.pt")
                atomic_write_json(tmp / "trainer_state.json",
                                  {"step": self.step, "data_position": self.data_position,
                                   "algorithm": self.tcfg.algorithm})
                atomic_write_text(tmp / "config.yaml", dump_config(self.cfg))
            for old in self._checkpoints()[:-self.tcfg.keep_checkpoints]:
                shutil.rmtree(old)
        self.accelerator.wait_for_everyone()
        return path

    def _resume(self) -> None:
        """Load the latest complete checkpoint, if any, and drop metrics logged after it."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        checkpoints = self._checkpoints()
        if not checkpoints:
            return
        path = checkpoints[-1]
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
        if state.get("algorithm") != self.tcfg.algorithm:
            raise TrainerError(f"{path}: checkpoint is for {state.get('algorithm')!r}, "
                               f"config asks for {self.tcfg.algorithm!r}")
        result = set_peft_model_state_dict(self.model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
        if getattr(result, "unexpected_keys", None):
            raise TrainerError(f"{path}: adapter does not fit the model: {result.unexpected_keys[:3]}")
        if self.core.value_head is not None:
            self.core.value_head.load_state_dict(load_file(str(path / "value_head.safetensors")))
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
        rng = torch.load(path / "rng.pt", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step, self.data_position = int(state["step"]), int(state["data_position"])
        metrics = self.out_dir / "metrics.jsonl"
        if metrics.is_file():
            self.history = [row for _, row in iter_jsonl(metrics) if row["step"] <= self.step]

    @staticmethod
    def _seed_everything(seed: int) -> None:
        from transformers import set_seed

        set_seed(seed)


class _atomic_dir:
    """Context manager: yields a temporary sibling folder, renamed to ``path`` on success."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.path.exists():
            shutil.rmtree(self.path)
        os.rename(self.tmp, self.path)
        return False
