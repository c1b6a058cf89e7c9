"""Judge agreement with SAGE's stored judgements (rlver_lib.agreement, `rlver judge-agreement`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference_data import reference_file

from rlver_lib.agreement import (
    agreement_metrics,
    bucket,
    judge_agreement,
    lane_order,
    load_replay,
    replay_turns,
    sample_dialogues,
    sample_turns,
)
from rlver_lib.cli import main
from rlver_lib.simulator import SimulatorTurn, apply_change, mood_for

SCENE = "## 剧本背景故事\n王小云和朋友吵架了。\n####隐藏主题:\n***你希望对方用心倾听你的情绪宣泄"


def _dialogue(rid: str, start: int, steps: list[tuple[str, int]]) -> dict:
    """A SAGE result record: opening at ``start``, then per (reply, recorded change) an
    assistant message and a user message with the emotion after it."""
    history = [{"role": "user", "content": "我心里很乱。", "emotion-point": start}]
    e = start
    for reply, change in steps:
        e = max(0, min(100, e + change))
        history += [{"role": "assistant", "content": reply},
                    {"role": "user", "content": "嗯。", "emotion-point": e,
                     "planning": {"analyse": "...", "change": change}}]
    return {"id": rid, "emo_point": e, "player": "* 姓名：王小云\n* 年龄：23岁", "scene": SCENE,
            "character": "被动型", "task": "你希望对方用心倾听你的情绪宣泄", "history": history}


# Two dialogues; our judge gives the change written in the reply ("c=N").
# recorded: [5, -3, 0] and [-6, 8]; ours: [2, -1, 4] and [-2, 10].
TWO = [_dialogue("A", 40, [("c=2", 5), ("c=-1", -3), ("c=4", 0)]),
       _dialogue("B", 30, [("c=-2", -6), ("c=10", 8)])]


class ScriptedJudge:
    """Appraises by the number in the reply and records every request it saw."""

    def __init__(self):
        self.requests = []

    def appraise(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            raw = int(r.history[-1]["content"].split("=")[1])
            change, e = apply_change(r.emotion, raw)
            out.append(SimulatorTurn(r.dialogue_id, change, raw, r.emotion, e, mood_for(e), {}, None, False))
        return out


@pytest.fixture
def two_file(tmp_path):
    path = tmp_path / "two_result.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in TWO), encoding="utf-8")
    return path


def test_two_dialogue_case_with_known_rho_and_mae(two_file):
    turns, scenarios = load_replay([two_file])
    assert [(t.dialogue, t.turn, t.emotion_before, t.recorded_change) for t in turns] == [
        ("two_result.jsonl:A", 0, 40, 5), ("two_result.jsonl:A", 1, 45, -3), ("two_result.jsonl:A", 2, 42, 0),
        ("two_result.jsonl:B", 0, 30, -6), ("two_result.jsonl:B", 1, 24, 8)]
    judge = ScriptedJudge()
    result = judge_agreement(turns, scenarios, judge, n_boot=200, seed=0, progress=False)
    # ranks by hand: recorded [5,-3,0,-6,8] -> [4,2,3,1,5]; ours [2,-1,4,-2,10] -> [3,2,4,1,5]
    # sum d^2 = 1 + 0 + 1 + 0 + 0 = 2; rho = 1 - 6 * 2 / (5 * (25 - 1)) = 0.9
    assert result["spearman"] == pytest.approx(0.9)
    # |2-5| + |-1+3| + |4-0| + |-2+6| + |10-8| = 3 + 2 + 4 + 4 + 2 = 15 over 5 turns
    assert result["mae"] == pytest.approx(3.0)
    # signs agree on 4 of 5 turns (0 vs +4 disagrees)
    assert result["sign_agreement"] == pytest.approx(0.8)
    r, o = np.array([5, -3, 0, -6, 8.0]), np.array([2, -1, 4, -2, 10.0])
    dr, do = r - r.mean(), o - o.mean()
    pearson = (dr * do).sum() / np.sqrt((dr ** 2).sum() * (do ** 2).sum())
    assert result["pearson"] == pytest.approx(pearson)
    assert (result["n_turns"], result["n_dialogues"], result["n_failed"]) == (5, 2, 0)
    counts = dict(zip(result["confusion"]["buckets"], result["confusion"]["counts"]))
    # recorded bucket -> our bucket: 5->1..4, -3->-4..-1, 0->1..4, -6->-4..-1, 8->>=5
    assert counts[">=5"] == [0, 0, 0, 1, 1] and counts["-4..-1"] == [0, 1, 0, 0, 0]
    assert counts["0"] == [0, 0, 0, 1, 0] and counts["<=-5"] == [0, 1, 0, 0, 0]
    # each appraisal saw the recorded emotion before it and the history up to its reply only
    seen = next(q for q in judge.requests if q.dialogue_id.endswith(":A@1"))
    assert seen.emotion == 45 and seen.history[-1] == {"role": "assistant", "content": "c=-1"}
    assert [m["role"] for m in seen.history] == ["user", "assistant", "user", "assistant"]
    assert seen.scenario.hidden_intention == "be_heard" and "####" not in seen.scenario.situation_text
    # the rule floor: +10 for a question, else -5 -> all -5 here
    assert [t["rule"] for t in result["turns"]] == [-5] * 5
    assert result["floor_rule"]["mae"] == pytest.approx(np.abs(r + 5).mean())
    assert result["floor_rule"]["spearman"] is None  # a constant judge has no rank correlation


def test_failed_appraisals_are_left_out_and_their_reasons_kept(two_file):
    class FailsOnZeroTurn(ScriptedJudge):
        def appraise(self, requests):
            out = super().appraise(requests)
            for turn, r in zip(out, requests):
                if r.history[-1]["content"] == "c=4":
                    turn.change, turn.error = None, "appraisal unusable after retries: invalid JSON"
            return out

    turns, scenarios = load_replay([two_file])
    result = judge_agreement(turns, scenarios, FailsOnZeroTurn(), n_boot=50, progress=False)
    assert (result["n_turns"], result["n_failed"]) == (4, 1)
    # without the (0 recorded, 4 ours) turn: |2-5| + |-1+3| + |-2+6| + |10-8| = 11 over 4
    assert result["mae"] == pytest.approx(11 / 4)
    assert [t["error"] for t in result["turns"]] == [None, None, "appraisal unusable after retries: invalid JSON",
                                                     None, None]


def test_intervals_resample_dialogues_and_control_is_near_chance():
    rng = np.random.default_rng(0)
    recorded = rng.integers(-10, 11, size=300)
    ours = np.clip(recorded + rng.integers(-3, 4, size=300), -10, 10)
    clusters = np.repeat(np.arange(30), 10).tolist()
    m = agreement_metrics(recorded, ours, clusters, n_boot=300, seed=1)
    assert m["spearman_ci"][0] < m["spearman"] < m["spearman_ci"][1]
    assert m["spearman"] > 0.8
    from rlver_lib.agreement import shuffled_control

    control = shuffled_control(recorded, ours, n_shuffles=100, seed=0)
    assert abs(control["spearman"]) < 0.05 and control["mae"] > m["mae"]


def test_buckets_and_sampling():
    assert [bucket(c) for c in (-10, -5, -4, -1, 0, 1, 4, 5, 10)] == [
        "<=-5", "<=-5", "-4..-1", "-4..-1", "0", "1..4", "1..4", ">=5", ">=5"]
    turns = replay_turns(TWO[0], "f") + replay_turns(TWO[1], "f")
    picked = sample_turns(turns, 3, seed=1)
    assert len(picked) == 3 and picked == [t for t in turns if t in picked]  # file order kept
    assert sample_turns(turns, 3, seed=1) == picked and sample_turns(turns, None, 0) == turns


def test_dialogue_sample_keeps_whole_dialogues():
    turns = replay_turns(TWO[0], "f") + replay_turns(TWO[1], "f")
    picked = sample_dialogues(turns, 1, seed=0)
    assert picked in (turns[:3], turns[3:])  # all of A's 3 turns or all of B's 2
    assert sample_dialogues(turns, 5, seed=0) == turns
    with pytest.raises(ValueError):
        sample_dialogues(turns, 0, seed=0)


def test_files_with_one_name_in_two_folders_stay_apart(tmp_path, two_file):
    other = tmp_path / "other"
    other.mkdir()
    second = other / two_file.name
    record = _dialogue("A", 70, [("c=1", 2)])  # same id and file name, another dialogue
    second.write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    turns, scenarios = load_replay([two_file, second])
    keys = [t.dialogue for t in turns]
    assert keys == [f"{two_file}:A"] * 3 + [f"{two_file}:B"] * 2 + [f"{second}:A"]
    assert len(scenarios) == 3
    assert [t.emotion_before for t in turns if t.dialogue == f"{second}:A"] == [70]
    with pytest.raises(ValueError, match="given twice"):
        load_replay([two_file, tmp_path / ".." / tmp_path.name / two_file.name])


def test_lane_order_one_turn_per_dialogue_per_batch_in_order(two_file):
    # dialogues A (turns 0-2), B (3-4), C (5); two lanes: A and B start, C takes B's lane
    turns = replay_turns(TWO[0], "f") + replay_turns(TWO[1], "f") + [
        t for t in replay_turns(TWO[1], "g")][:1]
    assert lane_order(turns, 2) == [[0, 3], [1, 4], [2, 5]]
    assert lane_order(turns, 1) == [[0], [1], [2], [3], [4], [5]]
    assert lane_order(turns, 8) == [[0, 3, 5], [1, 4], [2]]
    # the judge sees each dialogue's turns in order, and results land on their own turns
    judge = ScriptedJudge()
    result = judge_agreement(turns, {t.dialogue: None for t in turns}, judge, n_boot=50, batch_size=2,
                             progress=False)
    assert [r.dialogue_id for r in judge.requests] == ["f:A@0", "f:B@0", "f:A@1", "f:B@1", "f:A@2", "g:B@0"]
    assert [row["judge"] for row in result["turns"]] == [2, -1, 4, -2, 10, -2]


def test_cli_rule_judge_on_stored_sage_dialogues(tmp_path, capsys):
    out = tmp_path / "agree.json"
    gpt = reference_file("sage_results", "gpt-4.1_result.jsonl")
    code = main(["judge-agreement", str(gpt), "--set", "evaluation.judge.backend=rule",
                 "--sample", "40", "--seed", "3", "--json", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["n_turns"] == 40 and data["judge"]["backend"] == "rule"
    for key in ("spearman", "spearman_ci", "sign_agreement", "mae", "pearson", "confusion",
                "floor_rule", "control_shuffled"):
        assert key in data
    # recompute from the raw file: each sampled turn's recorded change, and the rule's change
    raw = {}
    for line in gpt.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        raw[rec["id"]] = rec["history"]
    for t in data["turns"]:
        history = raw[t["dialogue"].split(":", 1)[1]]
        assistants = [i for i, m in enumerate(history) if m["role"] == "assistant"]
        i = assistants[t["turn"]]
        assert t["recorded"] == history[i + 1]["planning"]["change"]
        assert t["emotion_before"] == history[i - 1]["emotion-point"]
        assert t["judge"] == (10 if history[i]["content"].rstrip().endswith(("?", "？")) else -5)
    ours = np.array([t["judge"] for t in data["turns"]], dtype=float)
    rec = np.array([t["recorded"] for t in data["turns"]], dtype=float)
    assert data["mae"] == pytest.approx(np.abs(ours - rec).mean())
    assert "shuffled pairs" in capsys.readouterr().out
    assert main(["judge-agreement", str(tmp_path / "missing.jsonl"), "--set", "evaluation.judge.backend=rule"]) == 2
