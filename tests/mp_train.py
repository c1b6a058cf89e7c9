"""A small training driver for tests/test_multiprocess.py, launched for real:

    ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node 2 tests/mp_train.py RUN.json

``RUN.json``: a list of ``{"config": {...build_config data...}, "scenarios": N}``,
trained one after the other in the same processes (imports paid once). Each trains
the embedded policy against the rule simulator and writes ``rank<r>.json`` into its
run's ``train/`` folder: the launch as accelerate saw it and a checksum of the
trained LoRA weights. Generation goes one conversation at a time with a seed derived
from the conversation, so a dialogue samples the same tokens whichever process (and
batch) it lands in, and a two-process run is comparable with a one-process run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from rlver_lib.backends import TransformersBackend, conversation_seed
from rlver_lib.config import build_config
from rlver_lib.scenarios import Scenario
from rlver_lib.simulator import RuleSimulator

OPENINGS = ["I had a rough day.", "My friend is mad at me.", "I feel stuck at work.", "Nobody listens to me."]


def scenarios(n: int) -> list[Scenario]:
    return [Scenario(id=f"s{i}", persona=f"Sam {i}, 30, a teacher", situation="Argued with a friend.",
                     personality="negative", hidden_intention="be_heard", opening_line=OPENINGS[i % 4],
                     language="en") for i in range(n)]


def starts_with_i(reply: str) -> int:
    return 10 if reply.lstrip().startswith("I") else -10


class OneByOne:
    """``TransformersBackend`` one conversation at a time; the k-th copy of a
    conversation in a call gets the seed of (call seed, conversation, k)."""

    def __init__(self, backend: TransformersBackend):
        self.backend = backend

    def prompt_ids(self, conversation):
        return self.backend.prompt_ids(conversation)

    def sync_policy(self, model, step):
        self.backend.sync_policy(model, step)

    def generate(self, conversations, sampling, json_schema=None):
        from dataclasses import replace

        seen: dict[str, int] = {}
        out = []
        for conversation in conversations:
            key = json.dumps(conversation, sort_keys=True)
            seen[key] = seen.get(key, 0) + 1
            seed = conversation_seed(sampling.seed, conversation + [{"role": "copy", "content": str(seen[key])}])
            out += self.backend.generate([conversation], replace(sampling, seed=seed), json_schema)
        return out


def train(config: dict, n_scenarios: int) -> list[dict]:
    """Train as configured; returns the metrics rows (and writes ``rank<r>.json``)."""
    from rlver_lib.trainer import Trainer

    cfg = build_config(config)
    trainer = Trainer(cfg, scenarios(n_scenarios), simulator=RuleSimulator(starts_with_i))
    trainer.policy_backend = OneByOne(trainer.policy_backend)
    rows = trainer.train()
    accelerator = trainer.accelerator
    lora = sum(float(p.double().sum()) for n, p in trainer.model.policy.named_parameters() if "lora_" in n)
    info = {"process_index": accelerator.process_index, "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type), "lora_checksum": lora,
            "steps": [r["step"] for r in rows]}
    out = cfg.run_dir / "train" / f"rank{accelerator.process_index}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info), encoding="utf-8")
    return rows


def main() -> None:
    torch.set_num_threads(1)
    for run in json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")):
        train(run["config"], run["scenarios"])


if __name__ == "__main__":
    main()
