"""Judge agreement with SAGE's stored judgements (rlver_lib.evaluation.agreement, `rlver judge-agreement`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reference_data import reference_file
from scipy.stats import spearmanr

from rlver_lib.appraisal import mood_for
from rlver_lib.cli import main
from rlver_lib.evaluation.agreement import (
    ReplayTurn,
    format_report,
    judge_agreement,
    lane_order,
    load_replay,
    replay_turns,
    retest_noise,
    sample_dialogues,
    sample_turns,
)
from rlver_lib.evaluation.agreement_stats import agreement_metrics, bucket
from rlver_lib.evaluation.reply_blind import reply_blind_predictors
from rlver_lib.simulator import SimulatorTurn
from rlver_lib.stats import cluster_bootstrap, partial_spearman, permutation_test_partial

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
    """Appraises by the number after "c=" in the reply (an int, or a float such as -3.7),
    clamps it to [-10, 10] like the update rule, and records every request it saw."""

    def __init__(self):
        self.requests = []

    def appraise(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            text = r.history[-1]["content"].split("=")[1].split()[0]
            raw = float(text) if "." in text else int(text)
            change = max(-10, min(10, raw))
            e = max(0, min(100, r.emotion + change))
            out.append(SimulatorTurn(dialogue_id=r.dialogue_id, change=change, raw_change=raw,
                                     emotion_before=r.emotion, emotion=e, mood=mood_for(e), appraisal={},
                                     reply=None, goodbye=False))
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
    assert counts["[4.5,inf)"] == [0, 0, 0, 1, 1] and counts["(-4.5,-0.5)"] == [0, 1, 0, 0, 0]
    assert counts["[-0.5,0.5]"] == [0, 0, 0, 1, 0] and counts["(-inf,-4.5]"] == [0, 1, 0, 0, 0]
    # negative: ours -1, -2 of 5; SAGE's -3, -6 of 5
    assert result["share_negative"] == {"judge": pytest.approx(0.4), "recorded": pytest.approx(0.4)}
    # each appraisal saw the recorded emotion before it and the history up to its reply only
    seen = next(q for q in judge.requests if q.dialogue_id.endswith(":A@1"))
    assert seen.emotion == 45 and seen.history[-1] == {"role": "assistant", "content": "c=-1"}
    assert [m["role"] for m in seen.history] == ["user", "assistant", "user", "assistant"]
    assert seen.scenario.hidden_intention == "be_heard" and "####" not in seen.scenario.situation_text
    assert "floor_rule" not in result and "control_shuffled" not in result
    assert [t["reply_chars"] for t in result["turns"]] == [3, 4, 3, 4, 4]


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


def test_real_changes_kept_and_every_failure_counted(tmp_path):
    # C: a real-valued appraisal (-3.7, 2.5), then an output cut by the token budget;
    # D: an int, then a non-finite change; E: a conversation too long for the server, which
    # makes the whole batch call raise: it must fail alone.
    records = [_dialogue("C", 40, [("c=-3.7", -5), ("c=2.5", 5), ("c=1", 0)]),
               _dialogue("D", 50, [("c=4", -5), ("c=-2", -10)]),
               _dialogue("E", 60, [("c=3 TOOLONG", 5)])]
    path = tmp_path / "mixed_result.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")

    class Flaky(ScriptedJudge):
        def appraise(self, requests):
            if any("TOOLONG" in r.history[-1]["content"] for r in requests):
                raise ValueError("request (4309 tokens) exceeds the available context size (4096 tokens)")
            out = super().appraise(requests)
            for turn, r in zip(out, requests):
                if r.history[-1]["content"] == "c=1":  # finish_reason length: JSON cut, unparseable
                    turn.error = "appraisal unusable after retries: output truncated (finish_reason=length)"
                if r.history[-1]["content"] == "c=-2":
                    turn.change = float("nan")
            return out

    turns, scenarios = load_replay([path])
    result = judge_agreement(turns, scenarios, Flaky(), n_boot=50, permutation_resamples=50, progress=False)
    judged = [t["judge"] for t in result["turns"]]
    assert judged == [-3.7, 2.5, None, 4, None, None]
    assert isinstance(judged[0], float) and isinstance(judged[3], int)  # reals stay reals, ints ints
    errors = [t["error"] for t in result["turns"]]
    assert errors[0] is None and errors[1] is None and errors[3] is None
    assert "finish_reason=length" in errors[2] and "not finite" in errors[4]
    assert errors[5].startswith("ValueError: request (4309 tokens) exceeds")
    assert (result["n_turns"], result["n_failed"]) == (3, 3)
    # kept: (-5 recorded, -3.7 ours), (5, 2.5), (-5, 4): |1.3| + |2.5| + |9| = 12.8 over 3
    assert result["mae"] == pytest.approx(12.8 / 3)
    assert result["sign_agreement"] == pytest.approx(2 / 3)
    assert result["share_negative"] == {"judge": pytest.approx(1 / 3), "recorded": pytest.approx(2 / 3)}
    counts = dict(zip(result["confusion"]["buckets"], result["confusion"]["counts"]))
    assert counts["(-inf,-4.5]"] == [0, 1, 0, 1, 0]  # -3.7 -> (-4.5,-0.5); 4 -> (0.5,4.5)
    assert counts["[4.5,inf)"] == [0, 0, 0, 1, 0]  # 2.5 -> (0.5,4.5)


# Baselines case: P starts at 50 (emotions before 50, 45, 55), Q at 30 (30, 25); R's only
# turn (emotion before 40) fails and must be left out of every row.
BASE = [_dialogue("P", 50, [("c=5 sure", -5), ("c=-5 I hear you, that sounds hard", 10), ("c=0 hmm", -10)]),
        _dialogue("Q", 30, [("c=-10 calm down", -5), ("c=5 tell me more about it", -5)]),
        _dialogue("R", 40, [("c=1 FAIL", 10)])]


def test_reply_blind_baselines_on_the_judged_turns(tmp_path):
    path = tmp_path / "base_result.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in BASE), encoding="utf-8")

    class FailsR(ScriptedJudge):
        def appraise(self, requests):
            out = super().appraise(requests)
            for turn, r in zip(out, requests):
                if "FAIL" in r.history[-1]["content"]:
                    turn.change, turn.error = None, "invalid JSON"
            return out

    turns, scenarios = load_replay([path])
    result = judge_agreement(turns, scenarios, FailsR(), n_boot=100, permutation_resamples=50, progress=False)
    assert (result["n_turns"], result["n_failed"]) == (5, 1)
    # ours [5, -5, 0, -10, 5]: 2 of 5 below 0 (a 0 is not negative); SAGE's: 4 of 5
    assert result["share_negative"] == {"judge": pytest.approx(0.4), "recorded": pytest.approx(0.8)}
    b = result["baselines"]
    assert list(b) == ["emotion_before", "threshold_rule", "reply_length", "constant"]
    rec = np.array([-5, 10, -10, -5, -5.0])
    before = np.array([50, 45, 55, 30, 25.0])
    # emotion before: ranks [4,3,5,2,1] vs recorded ranks [3,5,1,3,3]; centred [1,0,2,-1,-2] and
    # [0,2,-2,0,0]: rho = -4 / sqrt(10 * 8)
    assert b["emotion_before"]["spearman"] == pytest.approx(-4 / np.sqrt(80))
    assert b["emotion_before"]["sign_agreement"] is None and b["emotion_before"]["mae"] is None
    assert b["emotion_before"]["mae_ci"] == [None, None]
    # threshold rule [+5, +5, +5, -5, -5]: signs agree on turns 2, 4, 5; |10| + |5| + |15| + 0 + 0 = 30 / 5
    assert b["threshold_rule"]["sign_agreement"] == pytest.approx(0.6)
    assert b["threshold_rule"]["mae"] == pytest.approx(6.0)
    assert b["threshold_rule"]["spearman"] == pytest.approx(spearmanr([5, 5, 5, -5, -5], rec).statistic)
    # constant +5: only turn 2 agrees in sign; 10 + 5 + 15 + 10 + 10 = 50 / 5; no rank correlation
    assert b["constant"]["sign_agreement"] == pytest.approx(0.2)
    assert b["constant"]["mae"] == pytest.approx(10.0)
    assert b["constant"]["spearman"] is None and b["constant"]["spearman_ci"] == [None, None]
    lengths = [len(s) for s in ("c=5 sure", "c=-5 I hear you, that sounds hard", "c=0 hmm", "c=-10 calm down",
                                "c=5 tell me more about it")]
    assert b["reply_length"]["spearman"] == pytest.approx(spearmanr(-np.array(lengths), rec).statistic)
    assert b["reply_length"]["sign_agreement"] is None and b["reply_length"]["mae"] is None
    for block in b.values():  # every metric has its interval; a meaningless one is None with it
        for m in ("spearman", "sign_agreement", "mae"):
            assert len(block[f"{m}_ci"]) == 2
            if block[m] is None:
                assert block[f"{m}_ci"] == [None, None]
    # the judge's partial Spearman given the emotion before, by the textbook formula
    ours = np.array([5, -5, 0, -10, 5.0])
    rxy, rxz, ryz = (spearmanr(a, c).statistic for a, c in ((ours, rec), (ours, before), (rec, before)))
    assert result["partial_spearman"] == pytest.approx((rxy - rxz * ryz) / np.sqrt((1 - rxz**2) * (1 - ryz**2)))
    report = format_report(result)
    lines = [line.strip() for line in report.splitlines()]
    first = next(i for i, line in enumerate(lines) if line.startswith("judge (ours)"))
    assert [line.split(":")[0] for line in lines[first + 1:first + 5]] == ["baseline"] * 4
    assert "constant +5" in report and "+5 if emotion before >= 40, else -5" in report
    # the threshold is inclusive at 40
    mk = [ReplayTurn("d", "d", k, e, 0, ({"role": "assistant", "content": "x" * (k + 1)},))
          for k, e in enumerate((39, 40, 41))]
    pred = reply_blind_predictors(mk)
    assert pred["threshold_rule"].tolist() == [-5, 5, 5] and pred["reply_length"].tolist() == [-1, -2, -3]
    assert pred["emotion_before"].tolist() == [39, 40, 41] and pred["constant"].tolist() == [5, 5, 5]


def _formula_partial(x, y, z):
    rxy, rxz, ryz = (spearmanr(a, b).statistic for a, b in ((x, y), (x, z), (y, z)))
    return (rxy - rxz * ryz) / np.sqrt((1 - rxz**2) * (1 - ryz**2))


def test_partial_spearman_matches_the_textbook_formula():
    for seed in range(5):
        rng = np.random.default_rng(seed)
        z = rng.integers(0, 100, size=60)
        y = np.round(z / 10 + rng.normal(0, 3, size=60))  # ties, and tied to z
        x = np.round(0.5 * y + z / 20 + rng.normal(0, 3, size=60))
        assert partial_spearman(x, y, z) == pytest.approx(_formula_partial(x, y, z), abs=1e-12)
    # a constant z: the plain Spearman; x a monotone function of z: nothing left (NaN)
    x, y = [1, 3, 2, 5, 4], [2, 1, 4, 3, 5]
    assert partial_spearman(x, y, [7] * 5) == pytest.approx(spearmanr(x, y).statistic)
    assert np.isnan(partial_spearman([1, 2, 3, 4, 5], y, [10, 20, 30, 40, 50]))
    assert np.isnan(partial_spearman([1, 2], [2, 1], [0, 1]))
    with pytest.raises(ValueError):
        partial_spearman([1, 2, 3], [1, 2], [1, 2, 3])


def _synthetic_turns(n_dialogues: int, per: int, seed: int, judge_fn):
    """``ReplayTurn``s whose reply carries the judge's change: ``judge_fn(recorded, before, rng)``."""
    rng = np.random.default_rng(seed)
    turns = []
    for d in range(n_dialogues):
        for k in range(per):
            before = int(rng.integers(0, 101))
            recorded = int(rng.choice([-10, -5, 5, 10]))
            ours = int(np.clip(judge_fn(recorded, before, rng), -10, 10))
            history = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": f"c={ours}"})
            turns.append(ReplayTurn(f"f:{d}", str(d), k, before, recorded, history))
    return turns


def test_partial_spearman_interval_resamples_dialogues():
    turns = _synthetic_turns(12, 5, 0, lambda r, e, rng: round(0.5 * r + (e - 50) / 10 + rng.normal(0, 3)))
    result = judge_agreement(turns, {t.dialogue: None for t in turns}, ScriptedJudge(), n_boot=300, seed=4,
                             permutation_resamples=100, progress=False)
    j = np.array([int(t.history[-1]["content"][2:]) for t in turns], dtype=float)
    r = np.array([t.recorded_change for t in turns], dtype=float)
    z = np.array([t.emotion_before for t in turns], dtype=float)
    assert result["partial_spearman"] == pytest.approx(_formula_partial(j, r, z))
    # the same resamples of dialogues (cluster_bootstrap, same seed) with the formula as the statistic
    est = cluster_bootstrap(lambda idx: _formula_partial(j[idx], r[idx], z[idx]), len(turns),
                            [t.dialogue for t in turns], n_boot=300, seed=4)
    assert result["partial_spearman_ci"] == pytest.approx([est.low, est.high])
    assert result["partial_spearman_ci"][0] < result["partial_spearman"] < result["partial_spearman_ci"][1]


def test_judge_agreement_records_the_permutation_test():
    turns = _synthetic_turns(10, 4, 1, lambda r, e, rng: r + round(rng.normal(0, 4)))
    result = judge_agreement(turns, {t.dialogue: None for t in turns}, ScriptedJudge(), n_boot=50, seed=2,
                             permutation_resamples=500, progress=False)
    j = [int(t.history[-1]["content"][2:]) for t in turns]
    expected = permutation_test_partial(j, [t.recorded_change for t in turns], [t.emotion_before for t in turns],
                                        [t.dialogue for t in turns], n_resamples=500, seed=2)
    assert result["permutation_resamples"] == 500 and result["permutation_p"] == expected
    assert result["permutation_p"] < 0.01  # this judge follows SAGE turn by turn


def test_retest_noise_on_a_hand_computed_case():
    def t(d, k, before):
        return ReplayTurn(d, d, k, before, 0, ({"role": "assistant", "content": "r"},))

    # X from 95: a [+8, +10, -3.5] -> 100 (clamped), 100, 96.5; b [+15 -> +10, -20 -> -10, +2] -> 100, 90, 92
    # Y from 5 (its turn 0; listed after turn 1): a [-10, +2.5] -> 0, 2.5; b [-2, +6] -> 3, 9
    # Z: a failed appraisal in run b -> left out
    turns = [t("X", 0, 95), t("X", 1, 99), t("X", 2, 99), t("Y", 1, 0), t("Y", 0, 5), t("Z", 0, 50)]
    a = [8, 10, -3.5, 2.5, -10, 5]
    b = [15, -20, 2, 6, -2, None]
    out = retest_noise(a, b, turns)
    assert (out["n_dialogues"], out["n_dropped"]) == (2, 1)
    assert out["dialogues"] == [{"dialogue": "X", "final_a": 96.5, "final_b": 92.0},
                                {"dialogue": "Y", "final_a": 2.5, "final_b": 9.0}]
    # |96.5 - 92| = 4.5, |2.5 - 9| = 6.5
    assert out["mean_abs_diff"] == pytest.approx(5.5)
    assert out["sd"] == pytest.approx(np.mean([np.std([96.5, 92], ddof=1), np.std([2.5, 9], ddof=1)]))
    assert out["sd"] == pytest.approx(5.5 / np.sqrt(2))
    assert out["pooled_sd"] == pytest.approx(np.sqrt((4.5**2 + 6.5**2) / 4))
    assert retest_noise([None], [1], turns[:1])["sd"] is None
    with pytest.raises(ValueError):
        retest_noise(a, b[:-1], turns)


def test_judge_agreement_with_a_retest_judge(two_file):
    class OneHigher(ScriptedJudge):
        def appraise(self, requests):
            out = super().appraise(requests)
            for turn in out:
                turn.change = max(-10, min(10, turn.raw_change + 1))
            return out

    turns, scenarios = load_replay([two_file])
    result = judge_agreement(turns, scenarios, ScriptedJudge(), n_boot=50, permutation_resamples=50,
                             progress=False, retest=OneHigher())
    # A from 40: ours 2, -1, 4 -> 45; again 3, 0, 5 -> 48.  B from 30: ours -2, 10 -> 38; again -1, 10 -> 39
    assert [row["judge_retest"] for row in result["turns"]] == [3, 0, 5, -1, 10]
    assert result["retest"]["dialogues"] == [{"dialogue": "two_result.jsonl:A", "final_a": 45.0, "final_b": 48.0},
                                             {"dialogue": "two_result.jsonl:B", "final_a": 38.0, "final_b": 39.0}]
    assert result["retest"]["mean_abs_diff"] == pytest.approx(2.0)
    assert result["retest"]["sd"] == pytest.approx(2 / np.sqrt(2))
    assert result["retest"]["n_failed"] == 0
    assert "test-retest noise" in format_report(result)


def test_intervals_resample_dialogues():
    rng = np.random.default_rng(0)
    recorded = rng.integers(-10, 11, size=300)
    ours = np.clip(recorded + rng.integers(-3, 4, size=300), -10, 10)
    clusters = np.repeat(np.arange(30), 10).tolist()
    m = agreement_metrics(recorded, ours, clusters, n_boot=300, seed=1)
    assert m["spearman_ci"][0] < m["spearman"] < m["spearman_ci"][1]
    assert m["spearman"] > 0.8
    assert m["mae_ci"][0] <= m["mae"] <= m["mae_ci"][1]


def test_buckets_and_sampling():
    low, mid_neg, zero, mid_pos, high = "(-inf,-4.5]", "(-4.5,-0.5)", "[-0.5,0.5]", "(0.5,4.5)", "[4.5,inf)"
    # SAGE's integers land as before: <= -5, -4..-1, 0, 1..4, >= 5
    assert [bucket(c) for c in (-10, -5, -4, -1, 0, 1, 4, 5, 10)] == [
        low, low, mid_neg, mid_neg, zero, mid_pos, mid_pos, high, high]
    # reals: the edges belong to exactly one bucket each, symmetric around 0
    assert [bucket(c) for c in (-4.5, -4.49, -3.7, -0.51, -0.5, 0.2, 0.5, 0.51, 4.49, 4.5, np.inf, -np.inf)] == [
        low, mid_neg, mid_neg, mid_neg, zero, zero, zero, mid_pos, mid_pos, high, high, low]
    with pytest.raises(ValueError):
        bucket(float("nan"))
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
                 "--sample", "40", "--seed", "3", "--permutations", "200", "--retest-seed", "11",
                 "--json", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["n_turns"] == 40 and data["judge"]["backend"] == "rule"
    for key in ("spearman", "spearman_ci", "sign_agreement", "mae", "pearson", "confusion", "n_failed",
                "partial_spearman", "partial_spearman_ci", "permutation_p", "share_negative", "baselines"):
        assert key in data
    assert "floor_rule" not in data and "control_shuffled" not in data
    assert data["permutation_resamples"] == 200 and data["n_failed"] == 0
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
    # the baselines, recomputed from the raw file's emotions and replies
    before = np.array([t["emotion_before"] for t in data["turns"]], dtype=float)
    rule = np.where(before >= 40, 5.0, -5.0)
    base = data["baselines"]
    assert base["threshold_rule"]["mae"] == pytest.approx(np.abs(rule - rec).mean())
    assert base["threshold_rule"]["sign_agreement"] == pytest.approx(np.mean(np.sign(rule) == np.sign(rec)))
    assert base["constant"]["mae"] == pytest.approx(np.abs(5 - rec).mean())
    assert base["emotion_before"]["spearman"] == pytest.approx(spearmanr(before, rec).statistic)
    assert data["share_negative"]["recorded"] == pytest.approx(np.mean(rec < 0))
    # the rule judge is deterministic: a second seed changes nothing
    assert data["retest"]["sd"] == 0.0 and data["retest"]["judge"]["backend"] == "rule"
    printed = capsys.readouterr().out
    assert "baseline: constant +5" in printed and "permutation p" in printed and "test-retest" in printed
    assert main(["judge-agreement", str(tmp_path / "missing.jsonl"), "--set", "evaluation.judge.backend=rule"]) == 2


def test_exclude_profiles_leaves_out_the_profiles_of_an_earlier_result(tmp_path, monkeypatch):
    """Figures from profiles that chose nothing: a dialogue whose SAGE profile (record id)
    is in an earlier result's turns is never replayed."""
    from rlver_lib.evaluation.agreement import judge_agreement_command, load_replay

    path = tmp_path / "gpt_result.jsonl"
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in TWO), encoding="utf-8")
    turns, _ = load_replay([path])
    first = turns[0].record_id
    earlier = tmp_path / "calibration.json"
    earlier.write_text(json.dumps({"turns": [{"dialogue": f"other_result.jsonl:{first}"}]}))
    seen = []
    monkeypatch.setattr("rlver_lib.evaluation.agreement.judge_agreement",
                        lambda chosen, *a, **k: seen.extend(chosen) or (_ for _ in ()).throw(ValueError("stop")))
    assert judge_agreement_command([str(path)], overrides=["evaluation.judge.backend=rule"],
                                             exclude_profiles=str(earlier)) == 2
    assert seen and all(t.record_id != first for t in seen)
    assert {t.record_id for t in turns} - {t.record_id for t in seen} == {first}
