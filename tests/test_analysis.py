"""Run tables, plots, strategy-judge agreement and reward-hacking diagnostics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from rlver_lib import analysis as A
from rlver_lib.backends import Generation
from rlver_lib.evaluation import summarize
from rlver_lib.io import atomic_write_json, write_jsonl

SHARED = Path(os.environ.get("RLVER_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))


def _record(did, replies, emotions, scenario_id="s0"):
    turns = [{"role": "user", "content": "I had a bad day."}]
    before = 40
    for reply, e in zip(replies, emotions):
        turns += [{"role": "assistant", "content": reply},
                  {"role": "user", "content": "hm", "change": e - before, "emotion_before": before, "emotion": e}]
        before = e
    return {"dialogue_id": did, "scenario_id": scenario_id, "initial_emotion": 40, "turns": turns,
            "final_emotion": before, "reward": before / 100, "termination": "max_turns"}


def _make_run(root: Path, name: str, algorithm: str, think: bool, difficulty: str, score: float) -> Path:
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
                    [_record(f"{step}-{i}", ["Why?"], [e]) for i, e in enumerate(emo)])
    write_jsonl(run / "train" / "metrics.jsonl", [{"step": 1, "reward_mean": 0.475}, {"step": 2, "reward_mean": 0.65}])
    return run


@pytest.fixture
def runs(tmp_path):
    return [_make_run(tmp_path, "ppo-think", "ppo", True, "moderate", 70.0),
            _make_run(tmp_path, "grpo-nothink", "grpo", False, "hard", 50.0)]


# --------------------------------------------------------------------------- tables


def test_run_tables_and_compare_runs(runs):
    dialogues = A.load_training_dialogues(runs[0])
    assert dialogues.groupby("step")["final_emotion"].apply(list).to_dict() == {1: [50, 45], 2: [60, 70]}
    assert dialogues["reply_length"].tolist() == [4.0] * 4
    turns = A.load_training_dialogues(runs[0], turns=True)
    assert turns[["turn", "user", "reply", "change"]].iloc[0].tolist() == [1, "I had a bad day.", "Why?", 10]
    assert A.load_metrics(runs[1])["reward_mean"].tolist() == [0.475, 0.65]
    ev = A.load_eval(runs[0])
    assert set(ev["label"]) == {"baseline", "trained"} and len(ev) == 8
    table = A.compare_runs(runs)
    assert table[["run", "algorithm", "think", "difficulty"]].values.tolist() == [
        ["ppo-think", "ppo", True, "moderate"], ["grpo-nothink", "grpo", False, "hard"]]
    assert table["sentient_score"].tolist() == [70.0, 50.0]
    assert table["baseline_score"].tolist() == [20.0, 20.0]
    assert table["final_train_reward"].tolist() == pytest.approx([0.65, 0.65])


def test_curve_with_ci_and_rates(runs):
    dialogues = pd.concat([A.load_training_dialogues(r) for r in runs])
    curves = A.curve_with_ci(dialogues, "reward", n_boot=50)
    step1 = curves[(curves["run"] == "ppo-think") & (curves["step"] == 1)].iloc[0]
    assert step1["mean"] == pytest.approx(0.475) and step1["n"] == 2
    assert 0.45 <= step1["low"] <= step1["mean"] <= step1["high"] <= 0.5
    rates = A.rates_over_training(dialogues.assign(success=[True, False, False, False] * 2))
    assert rates[(rates["outcome"] == "success") & (rates["step"] == 1)]["rate"].tolist() == [0.5, 0.5]


# --------------------------------------------------------------------------- plots


def _labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_curves_lines_and_bands(runs):
    dialogues = pd.concat([A.load_training_dialogues(r) for r in runs])
    fig = A.plot_curves(A.curve_with_ci(dialogues, "reward", n_boot=20), ylabel="mean reward")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training step", "mean reward")
    assert len(ax.lines) == 2 and len(ax.collections) == 2
    assert _labels(ax) == ["grpo-nothink", "ppo-think"]


def test_plot_emotion_trajectories_and_breakdown():
    records = [_record("a", ["x", "y"], [60, 100]), _record("b", ["x"], [5])]
    summary = summarize(records, n_boot=20)
    traj = pd.concat([summary.trajectory.assign(label="baseline"), summary.trajectory.assign(label="trained")])
    fig = A.plot_emotion_trajectories(traj)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "mean emotion (0-100)" and ax.get_xlabel() == "policy turn"
    assert len(ax.lines) == 2 + 2  # two labels, two threshold lines
    assert _labels(ax) == ["baseline", "trained"]
    fig = A.plot_breakdown(summary.breakdown)
    assert [a.get_ylabel() for a in fig.axes] == ["hidden_intention", "personality", "language"]
    assert all(len(a.patches) == 1 for a in fig.axes)  # one "unknown" level each


def test_plot_success_failure_length_and_runs(runs, tmp_path):
    dialogues = pd.concat([A.load_training_dialogues(r) for r in runs])
    fig = A.plot_success_failure(A.rates_over_training(dialogues))
    assert [a.get_ylabel() for a in fig.axes] == ["success rate", "failure rate"]
    assert all(len(a.lines) == 2 for a in fig.axes)
    fig = A.plot_length_vs_reward(dialogues.assign(reply_length=np.arange(8.0)), hue="run")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "mean reply length (characters)" and len(ax.collections) == 2
    fig = A.plot_run_comparison(A.compare_runs(runs))
    assert [a.get_title() for a in fig.axes] == ["by algorithm", "by think", "by difficulty"]
    assert [len(a.patches) for a in fig.axes] == [2, 2, 2]
    assert _labels(fig.axes[0]) == ["grpo", "ppo"]
    A.save_figure(fig, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_strategy_mix_and_plot():
    labelled = pd.DataFrame({"step": [1, 1, 1, 1, 2, 2],
                             "strategy": ["question", "question", "advice", "praise", "advice", "advice"]})
    mix = A.strategy_mix(labelled)
    shares = mix.set_index(["step", "strategy"])["share"]
    assert shares[(1, "question")] == 0.5 and shares[(2, "advice")] == 1.0 and shares[(2, "praise")] == 0.0
    assert mix.groupby("step")["share"].sum().tolist() == pytest.approx([1.0, 1.0])
    fig = A.plot_strategy_mix(mix)
    ax = fig.axes[0]
    assert len(ax.collections) == 3 and ax.get_ylabel() == "share of replies"
    assert _labels(ax) == ["advice", "praise", "question"]


# --------------------------------------------------------------------------- judge


def test_cohen_kappa_hand_computed():
    # 2x2 table: both yes 20, a yes/b no 5, a no/b yes 10, both no 15 (n=50)
    a = ["y"] * 25 + ["n"] * 25
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    p_o, p_e = 35 / 50, 0.5 * 0.6 + 0.5 * 0.4
    assert A.cohen_kappa(a, b) == pytest.approx((p_o - p_e) / (1 - p_e))  # 0.4
    assert A.cohen_kappa(["x", "y"], ["x", "y"]) == pytest.approx(1.0)
    assert np.isnan(A.cohen_kappa(["x", "x"], ["x", "x"]))
    with pytest.raises(ValueError):
        A.cohen_kappa(["x"], [])


class ScriptedJudge:
    """Returns the gold label except for the replies in ``wrong`` (labelled
    ``off_topic``) and ``garbled`` (invalid JSON the first ``garble_times`` calls)."""

    def __init__(self, gold, wrong=(), garbled=(), garble_times=1):
        self.gold, self.wrong, self.garbled = gold, set(wrong), set(garbled)
        self.garble_left = {r: garble_times for r in garbled}
        self.calls = 0

    def generate(self, conversations, sampling, json_schema=None):
        assert json_schema["properties"]["strategy"]["enum"] == list(A.STRATEGY_LABELS)
        self.calls += 1
        out = []
        for conv in conversations:
            reply = conv[-1]["content"].split("Reply:\n", 1)[1]
            if self.garble_left.get(reply, 0) > 0:
                self.garble_left[reply] -= 1
                out.append(Generation(text="{not json"))
                continue
            label = "off_topic" if reply in self.wrong else self.gold[reply]
            out.append(Generation(text=json.dumps({"strategy": label})))
        return out


def test_judge_agreement_known_kappa():
    sample = A.load_strategy_sample()
    assert len(sample) >= 30 and set(sample["label"]) == set(A.STRATEGY_LABELS)
    gold = dict(zip(sample["reply"], sample["label"]))
    wrong = [r for r, lbl in gold.items() if lbl == "praise"][:2]
    judge = ScriptedJudge(gold, wrong=wrong, garbled=[sample["reply"].iloc[0]])
    result = A.judge_agreement(judge, sample)
    predicted = [("off_topic" if r in wrong else gold[r]) for r in sample["reply"]]
    n = len(sample)
    p_o = (n - 2) / n
    pa = sample["label"].value_counts(normalize=True)
    pb = pd.Series(predicted).value_counts(normalize=True)
    p_e = sum(pa[k] * pb.get(k, 0.0) for k in pa.index)
    assert result["accuracy"] == pytest.approx(p_o)
    assert result["kappa"] == pytest.approx((p_o - p_e) / (1 - p_e))
    assert result["n_unparsed"] == 0 and judge.calls == 2  # one retry for the garbled reply


def test_label_strategies_bounded_retries():
    judge = ScriptedJudge({"a": "praise"}, garbled=["a"], garble_times=10)
    assert A.label_strategies(judge, ["a"], max_retries=2) == [A.UNPARSED]
    assert judge.calls == 3


# --------------------------------------------------------------------------- reward hacking


def test_reply_features_en_zh():
    assert A.reply_features("Sorry, are you ok? Your day sounds hard?") == {
        "reply_length": 40, "question_marks": 2, "second_person": 2, "apologies": 1}
    assert A.reply_features("对不起，你还好吗？您别担心。") == {
        "reply_length": 14, "question_marks": 1, "second_person": 2, "apologies": 1}
    assert A.reply_features("Youth is yours.")["second_person"] == 1


def test_hacking_correlations_known_values():
    replies = ["a" * n + "?" * q for n, q in ((10, 3), (20, 2), (30, 2), (40, 0))]
    df = pd.DataFrame({"reply": replies, "reward": [0.1, 0.2, 0.3, 0.4]})
    corr = A.hacking_correlations(df).set_index("feature")
    length = np.array([13, 22, 32, 40])
    assert corr.loc["reply_length", "pearson"] == pytest.approx(np.corrcoef(length, df["reward"])[0, 1])
    assert corr.loc["reply_length", "spearman"] == pytest.approx(1.0)
    # question marks 3,2,2,0: ranks 4,2.5,2.5,1 against 1..4
    ranks = np.array([4, 2.5, 2.5, 1])
    assert corr.loc["question_marks", "spearman"] == pytest.approx(np.corrcoef(ranks, [1, 2, 3, 4])[0, 1])
    assert np.isnan(corr.loc["apologies", "pearson"])  # constant feature
    assert corr["n"].tolist() == [4] * 4


def _scenarios(n):
    from rlver_lib.scenarios import load_scenarios

    return load_scenarios(SHARED / "rlver_profiles" / "test_profile.jsonl")[:n]


def test_hacking_probes_with_rule_simulator():
    from rlver_lib.simulator import RuleSimulator

    probes = A.run_hacking_probes(RuleSimulator(), _scenarios(2))
    assert len(probes) == 2 * (1 + len(A.HACKING_PROBES["zh"]))
    # rule simulator: +10 for a reply ending in a question mark (the control), -5 otherwise
    assert set(probes[probes["kind"] == "control"]["change"]) == {10}
    assert set(probes[probes["kind"] == "probe"]["change"]) == {-5}
    summary = A.summarize_probes(probes)
    assert summary.loc["probe - control", "mean"] == pytest.approx(-15.0)


def test_simulator_consistency():
    from rlver_lib.simulator import RuleSimulator, default_change_fn

    scenarios = _scenarios(2)
    records = [_record("d0", ["Why?", "ok.", "And then?"], [50, 45, 55], scenarios[0].id),
               _record("d1", ["Sure."], [35], scenarios[1].id)]
    samples = A.requests_from_records(records, scenarios, n=10, seed=0)
    assert len(samples) == 4
    req, change = next((r, c) for r, c in samples if r.dialogue_id == "d0:3")
    assert (req.emotion, req.turn, change) == (45, 2, 10)
    assert [m["content"] for m in req.history] == ["I had a bad day.", "Why?", "hm", "ok.", "hm", "And then?"]

    def make_simulator(seed):  # seed 0 reproduces the run; seed 1 flips every change
        return RuleSimulator() if seed == 0 else RuleSimulator(lambda reply: -default_change_fn(reply))

    table = A.simulator_consistency(make_simulator, samples, seed=0, other_seed=1).set_index("condition")
    assert table.loc["same_seed", "sign_agreement"] == 1.0
    assert table.loc["same_seed", "mean_abs_diff"] == 0.0
    assert table.loc["other_seed", "sign_agreement"] == 0.0
    # recorded 10, -5, 10, -5 vs flipped -10, 5, -10, 5
    assert table.loc["other_seed", "mean_abs_diff"] == pytest.approx(15.0)
    with pytest.raises(KeyError):
        A.requests_from_records(records, scenarios[:1], n=10, seed=0)
