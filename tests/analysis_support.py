"""What the tests of rlver_lib.analysis share: a stored dialogue record and a fake run
folder (config, benchmark summaries, training dialogues and metrics); conftest's ``runs``
fixture makes two of them."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlver_lib.files import atomic_write_json, write_jsonl


def dialogue_record(did, replies, emotions, scenario_id="s0"):
    turns = [{"role": "user", "content": "I had a bad day."}]
    before = 40
    for reply, e in zip(replies, emotions):
        turns += [{"role": "assistant", "content": reply},
                  {"role": "user", "content": "hm", "change": e - before, "emotion_before": before, "emotion": e}]
        before = e
    return {"dialogue_id": did, "scenario_id": scenario_id, "initial_emotion": 40, "turns": turns,
            "final_emotion": before, "reward": before / 100, "termination": "max_turns"}


def make_run(root: Path, name: str, algorithm: str, think: bool, difficulty: str, score: float) -> Path:
    run = root / name
    (run / "config.yaml").parent.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"training": {"algorithm": algorithm},
                                                     "policy": {"think": think},
                                                     "simulator": {"difficulty": difficulty}}))
    for label, value in (("baseline", 20.0), ("trained", score)):
        est = {"value": value, "low": value - 5, "high": value + 5, "confidence": 0.95}
        atomic_write_json(run / "eval" / label / "summary.json",
                          {"label": label, "n": 10, "sentient_score": est, "success_rate": est,
                           "failure_rate": est, "mean_turns": est})
    for step, emo in ((1, [50, 45]), (2, [60, 70])):
        write_jsonl(run / "train" / "dialogues" / f"step_{step:06d}.jsonl",
                    [dialogue_record(f"{step}-{i}", ["Why?"], [e]) for i, e in enumerate(emo)])
    write_jsonl(run / "train" / "metrics.jsonl", [{"step": 1, "reward_mean": 0.475}, {"step": 2, "reward_mean": 0.65}])
    return run


def legend_labels(ax):
    """The texts of a matplotlib axis's legend, in order."""
    return [t.get_text() for t in ax.get_legend().get_texts()]
