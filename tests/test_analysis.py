"""Run tables, plots, strategy-annotator agreement and reward-hacking diagnostics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from reference_data import rlver_test_profiles

from rlver_lib.analysis.cells import ANNOTATIONS, cells_table, load_cell_tables, paired_cell_differences, write_table
from rlver_lib.analysis.hacking import (
    CONTROL_REPLIES,
    HACKING_FEATURES,
    INJECTIONS,
    at_fault_scenarios,
    distinct_n,
    distinct_table,
    hacking_statistics,
    length_controlled_gain,
    reply_features,
    requests_from_records,
    run_injection_probes,
    simulator_consistency,
    summarize_injection,
    sycophancy_rate,
    sycophancy_replies,
    turn_features,
)
from rlver_lib.analysis.runs import (
    compare_runs,
    curve_with_ci,
    load_eval,
    load_metrics,
    load_training_dialogues,
    rates_over_training,
    run_replies,
    sample_replies,
)
from rlver_lib.analysis.stage import StrategyReport, describe_reliability
from rlver_lib.analysis.strategies import (
    ABSOLVES,
    ANNOTATION_FIELDS,
    CONSISTENCY_PASSES,
    DIMENSION_KEYS,
    DIMENSIONS,
    INDEPENDENT_PASSES,
    STRATEGIES,
    STRATEGY_KEYS,
    UNPARSED,
    RuleAnnotator,
    annotate_strategies,
    annotation_conversation,
    annotation_schema,
    annotator_validation,
    cohen_kappa,
    labelled_set_agreement,
    load_labelled_set,
    parse_annotation,
    plot_strategy_mix,
    plot_strategy_use,
    rule_annotation,
    self_agreement,
    strategy_mix,
    strategy_use,
    taxonomy_table,
)
from rlver_lib.backends import Generation
from rlver_lib.evaluation.benchmark import summarize
from rlver_lib.files import atomic_write_json, write_jsonl
from rlver_lib.plots import (
    plot_breakdown,
    plot_curves,
    plot_emotion_trajectories,
    plot_length_vs_reward,
    plot_run_comparison,
    plot_success_failure,
    save_figure,
)


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
    dialogues = load_training_dialogues(runs[0])
    assert dialogues.groupby("step")["final_emotion"].apply(list).to_dict() == {1: [50, 45], 2: [60, 70]}
    assert dialogues["reply_length"].tolist() == [4.0] * 4
    turns = load_training_dialogues(runs[0], turns=True)
    assert turns[["turn", "user", "reply", "change"]].iloc[0].tolist() == [1, "I had a bad day.", "Why?", 10]
    assert load_metrics(runs[1])["reward_mean"].tolist() == [0.475, 0.65]
    ev = load_eval(runs[0])
    assert set(ev["label"]) == {"baseline", "trained"} and len(ev) == 8
    table = compare_runs(runs)
    assert table[["run", "training.algorithm", "policy.think", "simulator.difficulty"]].values.tolist() == [
        ["ppo-think", "ppo", True, "moderate"], ["grpo-nothink", "grpo", False, "hard"]]
    assert table["sentient_score"].tolist() == [70.0, 50.0]
    assert table["baseline_score"].tolist() == [20.0, 20.0]
    assert table["final_train_reward"].tolist() == pytest.approx([0.65, 0.65])


def test_curve_with_ci_and_rates(runs):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    curves = curve_with_ci(dialogues, "reward", n_boot=50)
    step1 = curves[(curves["run"] == "ppo-think") & (curves["step"] == 1)].iloc[0]
    assert step1["mean"] == pytest.approx(0.475) and step1["n"] == 2
    assert 0.45 <= step1["low"] <= step1["mean"] <= step1["high"] <= 0.5
    rates = rates_over_training(dialogues.assign(success=[True, False, False, False] * 2))
    assert rates[(rates["outcome"] == "success") & (rates["step"] == 1)]["rate"].tolist() == [0.5, 0.5]


def _grpo_table():
    # step 1: scenario a's replicas 0.2, 0.4 (mean 0.3), b's 0.6, 0.8 (mean 0.7); step 2: one scenario
    return pd.DataFrame({"run": "r", "step": [1, 1, 1, 1, 2, 2], "reward": [0.2, 0.4, 0.6, 0.8, 0.5, 0.9],
                         "scenario_id": ["a", "a", "b", "b", "a", "a"]})


def test_curve_with_ci_resamples_scenarios_not_dialogues():
    curves = curve_with_ci(_grpo_table(), "reward", n_boot=6, confidence=0.5, seed=4)
    assert list(curves.columns) == ["run", "step", "mean", "low", "high", "n", "n_clusters"]
    assert curves["mean"].tolist() == pytest.approx([0.5, 0.7])
    assert curves["n"].tolist() == [4, 2] and curves["n_clusters"].tolist() == [2, 1]
    # step 1 by hand: default_rng(4).integers(0, 2, size=(6, 2)) draws the scenario pairs
    # (b,b) (b,b) (b,b) (b,a) (a,b) (a,a) -> means 0.7 0.7 0.7 0.5 0.5 0.3; sorted
    # 0.3 0.5 0.5 0.7 0.7 0.7, 25th / 75th percentiles at positions 1.25 and 3.75: 0.5 and 0.7
    assert (curves["low"].iloc[0], curves["high"].iloc[0]) == pytest.approx((0.5, 0.7))
    # step 2: both dialogues share one scenario, so the band has nothing to resample
    assert (curves["low"].iloc[1], curves["high"].iloc[1]) == pytest.approx((0.7, 0.7))
    # any scenario resample's mean is 0.3, 0.5 or 0.7; resampling dialogues would reach 0.2 or 0.25 (5 in 256)
    wide = curve_with_ci(_grpo_table(), "reward", n_boot=2000, confidence=0.99)
    assert 0.3 - 1e-12 <= wide["low"].iloc[0] and wide["high"].iloc[0] <= 0.7 + 1e-12
    with pytest.raises(KeyError, match="scenario_id"):
        curve_with_ci(_grpo_table().drop(columns="scenario_id"), "reward")
    with pytest.raises(ValueError, match="without a 'scenario_id'"):
        curve_with_ci(_grpo_table().assign(scenario_id=None), "reward")


def test_one_curve_function_in_the_library_and_the_notebooks():
    from rlver_lib import stats

    assert not hasattr(stats, "curve_ci")  # the unclustered duplicate is gone; stats keeps the bootstrap
    root = Path(__file__).resolve().parents[1] / "notebooks"
    for name in ("03_training", "05_ablations", "06_analysis"):
        cells = json.loads((root / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        assert "runs.curve_with_ci(" in code and "curve_ci(" not in code.replace("curve_with_ci(", ""), name


# --------------------------------------------------------------------------- plots


def _labels(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_plot_curves_lines_and_bands(runs):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    fig = plot_curves(curve_with_ci(dialogues, "reward", n_boot=20), ylabel="mean reward")
    ax = fig.axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("training step", "mean reward")
    assert len(ax.lines) == 2 and len(ax.collections) == 2
    assert _labels(ax) == ["grpo-nothink", "ppo-think"]


def test_plot_emotion_trajectories_and_breakdown():
    records = [_record("a", ["x", "y"], [60, 100]), _record("b", ["x"], [5])]
    summary = summarize(records, n_boot=20)
    traj = pd.concat([summary.trajectory.assign(label="baseline"), summary.trajectory.assign(label="trained")])
    fig = plot_emotion_trajectories(traj)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "mean emotion (0-100)" and ax.get_xlabel() == "policy turn"
    assert len(ax.lines) == 2 + 2  # two labels, two threshold lines
    assert _labels(ax) == ["baseline", "trained"]
    fig = plot_breakdown(summary.breakdown)
    assert [a.get_ylabel() for a in fig.axes] == ["hidden_intention", "personality", "language"]
    assert all(len(a.patches) == 1 for a in fig.axes)  # one "unknown" level each


def test_plot_success_failure_length_and_runs(runs, tmp_path):
    dialogues = pd.concat([load_training_dialogues(r) for r in runs])
    fig = plot_success_failure(rates_over_training(dialogues))
    assert [a.get_ylabel() for a in fig.axes] == ["success rate", "failure rate"]
    assert all(len(a.lines) == 2 for a in fig.axes)
    fig = plot_length_vs_reward(dialogues.assign(reply_length=np.arange(8.0)), hue="run")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "mean reply length (characters)" and len(ax.collections) == 2
    fig = plot_run_comparison(compare_runs(runs))
    assert [a.get_title() for a in fig.axes] == ["by training.algorithm", "by policy.think", "by simulator.difficulty"]
    assert [len(a.patches) for a in fig.axes] == [2, 2, 2]
    assert _labels(fig.axes[0]) == ["grpo", "ppo"]
    save_figure(fig, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_run_comparison_legend_has_one_colour_per_level(runs):
    fig = plot_run_comparison(compare_runs(runs))
    for ax in fig.axes:
        handles = ax.get_legend().legend_handles
        colours = {tuple(np.round(h.get_facecolor(), 3)) for h in handles}
        assert len(colours) == len(handles) == 2
        # the bars of a level carry its legend colour
        legend = {t.get_text(): tuple(np.round(h.get_facecolor(), 3))
                  for t, h in zip(ax.get_legend().get_texts(), handles)}
        bar_colours = {tuple(np.round(p.get_facecolor(), 3)) for p in ax.patches}
        assert bar_colours == set(legend.values())


# --------------------------------------------------------------------------- taxonomy and annotator


def test_taxonomy_covers_the_paper_dimensions_and_strategy_mix():
    assert DIMENSION_KEYS == ("empathic_depth", "core_insight", "solution_crafting", "style_adaptability",
                                "dialogue_guidance")
    assert STRATEGY_KEYS == ("validation", "reflective_listening", "praise", "advice", "question",
                               "reassurance", "self_disclosure")
    table = taxonomy_table()
    assert len(table) == 5 + 7 + 1 + 1
    assert table["definition"].str.len().min() > 20 and table["example"].str.len().min() > 10
    schema = annotation_schema()
    assert schema["required"] == list(ANNOTATION_FIELDS)
    assert schema["properties"]["primary"]["enum"] == [*STRATEGY_KEYS, "other"]
    system = annotation_conversation("r", "u")[0]["content"]
    for cat in (*DIMENSIONS, *STRATEGIES, ABSOLVES):
        assert cat.definition in system and cat.example in system


def _annotation(primary="question", **kw):
    out = {"primary": primary, **{k: False for k in STRATEGY_KEYS}, **{k: 0 for k in DIMENSION_KEYS},
           "absolves_user": False}
    out.update(kw)
    return out


def test_parse_annotation_validates_every_field():
    good = _annotation(question=True, empathic_depth=2)
    assert parse_annotation(json.dumps(good)) == good
    assert parse_annotation("{not json") is None
    assert parse_annotation(json.dumps({**good, "primary": "hug"})) is None
    assert parse_annotation(json.dumps({**good, "empathic_depth": 3})) is None
    assert parse_annotation(json.dumps({**good, "praise": "yes"})) is None
    assert parse_annotation(json.dumps({**good, "core_insight": True})) is None  # bool is not a rating
    missing = dict(good)
    del missing["absolves_user"]
    assert parse_annotation(json.dumps(missing)) is None


def test_rule_annotator_hand_cases():
    j = rule_annotation("It sounds like you feel ignored. Anyone would be hurt. What did he say?")
    assert j["reflective_listening"] and j["validation"] and j["question"] and not j["advice"]
    assert j["primary"] == "reflective_listening"  # 3 cue matches (sounds like x2, you feel) beat 1 and 1
    assert j["empathic_depth"] == 2 and j["dialogue_guidance"] == 1 and j["absolves_user"] is False
    j = rule_annotation("It's not your fault. You could try talking to HR first.")
    assert j["absolves_user"] and j["advice"] and j["solution_crafting"] == 1
    assert rule_annotation("Cherry Bloodreminsights")["primary"] == "other"
    out = RuleAnnotator().generate([annotation_conversation("Well done!", "I passed")], None)
    assert parse_annotation(out[0].text)["primary"] == "praise"


class ScriptedAnnotator:
    """Answers each annotation conversation with ``answers[reply]`` (an annotation dict, or a
    callable of the seed); replies in ``garbled`` get invalid JSON the first
    ``garble_times`` calls."""

    def __init__(self, answers, garbled=(), garble_times=1):
        self.answers = answers
        self.garble_left = {r: garble_times for r in garbled}
        self.calls = 0

    def generate(self, conversations, sampling, json_schema=None):
        assert json_schema == annotation_schema()
        self.calls += 1
        out = []
        for conv in conversations:
            reply = conv[-1]["content"].split("Reply:\n", 1)[1]
            if self.garble_left.get(reply, 0) > 0:
                self.garble_left[reply] -= 1
                out.append(Generation(text="{not json"))
                continue
            answer = self.answers[reply]
            answer = answer(sampling.seed) if callable(answer) else answer
            out.append(Generation(text=json.dumps(answer)))
        return out


def test_annotate_strategies_retries_then_marks_unparsed():
    annotator = ScriptedAnnotator({"a": _annotation("praise", praise=True), "b": _annotation()}, garbled=["a"])
    table = annotate_strategies(annotator, ["a", "b"])
    assert table["primary"].tolist() == ["praise", "question"] and table["parsed"].all()
    assert annotator.calls == 2
    annotator = ScriptedAnnotator({"a": _annotation()}, garbled=["a"], garble_times=10)
    table = annotate_strategies(annotator, ["a"], max_retries=2)
    assert table["primary"].tolist() == [UNPARSED] and not table["parsed"].any()
    assert annotator.calls == 3
    with pytest.raises(ValueError):
        annotate_strategies(annotator, ["a"], user_messages=["x", "y"])


def test_cohen_kappa_hand_computed():
    # 2x2 table: both yes 20, a yes/b no 5, a no/b yes 10, both no 15 (n=50)
    a = ["y"] * 25 + ["n"] * 25
    b = ["y"] * 20 + ["n"] * 5 + ["y"] * 10 + ["n"] * 15
    p_o, p_e = 35 / 50, 0.5 * 0.6 + 0.5 * 0.4
    assert cohen_kappa(a, b) == pytest.approx((p_o - p_e) / (1 - p_e))  # 0.4
    assert cohen_kappa(a, b) == pytest.approx(0.4)
    # three labels: diagonal 4+3+1 of 10; marginals a (5,3,2), b (4,4,2)
    a3 = list("xxxxxyyyzz")
    b3 = list("xxxxyyyxzy")  # x:x x4, x:y 1, y:y 2... checked below by counting
    p_o3 = sum(u == v for u, v in zip(a3, b3)) / 10
    pa = {k: a3.count(k) / 10 for k in "xyz"}
    pb = {k: b3.count(k) / 10 for k in "xyz"}
    p_e3 = sum(pa[k] * pb[k] for k in "xyz")
    assert (p_o3, p_e3) == pytest.approx((0.7, 0.5 * 0.5 + 0.3 * 0.4 + 0.2 * 0.1))
    assert cohen_kappa(a3, b3) == pytest.approx((0.7 - 0.39) / (1 - 0.39))
    assert cohen_kappa(["x", "y"], ["x", "y"]) == pytest.approx(1.0)
    assert np.isnan(cohen_kappa(["x", "x"], ["x", "x"]))
    with pytest.raises(ValueError):
        cohen_kappa(["x"], [])


def test_self_agreement_across_seeds():
    # "a" is stable; "b" flips between question and advice with the seed's parity
    answers = {"a": _annotation("praise", praise=True),
               "b": lambda seed: _annotation("question" if seed % 2 == 0 else "advice")}
    table = self_agreement(ScriptedAnnotator(answers), ["a", "b"], [None, None], seeds=[0, 1, 2],
                             temperature=0.7).set_index("field")
    # pairs (0,1), (0,2), (1,2): primary agreement 1/2, 1, 1/2 -> mean 2/3
    assert table.loc["primary", "agreement"] == pytest.approx(2 / 3)
    assert table.loc["praise", "agreement"] == 1.0 and table.loc["primary", "pairs"] == 3
    with pytest.raises(ValueError):
        self_agreement(ScriptedAnnotator(answers), ["a"], [None], seeds=[0], temperature=0.7)


def test_labelled_set_is_real_and_independent_agreement_is_recomputed():
    labelled = load_labelled_set()
    assert len(labelled) >= 60 and labelled["id"].is_unique
    assert labelled["scenario_id"].str.startswith("en-").all()
    assert INDEPENDENT_PASSES == ("p1", "b1") and CONSISTENCY_PASSES == ("p1", "p2")
    # the default table is annotator A (p1) against the independent annotator B (b1)
    table = labelled_set_agreement(labelled).set_index("field")
    p1, b1 = labelled["p1_primary"].tolist(), labelled["b1_primary"].tolist()
    assert table.loc["primary", "agreement"] == pytest.approx(np.mean([a == b for a, b in zip(p1, b1)]))
    # kappa by hand from the two marginals: (p_o - p_e) / (1 - p_e)
    n = len(p1)
    p_o = sum(a == b for a, b in zip(p1, b1)) / n
    p_e = sum(p1.count(k) * b1.count(k) for k in set(p1) | set(b1)) / n ** 2
    assert table.loc["primary", "kappa"] == pytest.approx((p_o - p_e) / (1 - p_e))
    assert 0.5 < table.loc["primary", "kappa"] < 1.0
    # annotator A against its own second pass, reported as a consistency check
    own = labelled_set_agreement(labelled, passes=CONSISTENCY_PASSES).set_index("field")
    assert own.loc["primary", "kappa"] == pytest.approx(cohen_kappa(p1, labelled["p2_primary"].tolist()))
    assert own.loc["primary", "kappa"] != pytest.approx(table.loc["primary", "kappa"])


def test_labelled_set_needs_every_pass(tmp_path):
    rec = {"id": "x", "scenario_id": "en-001", "turn": 1, "user": "u", "reply": "r",
           "p1": {"primary": "other", "strategies": [], "absolves_user": False},
           "p2": {"primary": "other", "strategies": [], "absolves_user": False}}
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="b1"):
        load_labelled_set(path)
    rec["b1"] = {"primary": "question", "strategies": ["question", "hugging"]}
    path.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match="hugging"):
        load_labelled_set(path)
    rec["b1"]["strategies"] = ["question"]
    path.write_text(json.dumps(rec) + "\n")
    row = load_labelled_set(path).iloc[0]
    assert row["b1_primary"] == "question" and row["b1_question"] and not row["b1_absolves_user"]


def test_annotator_validation_with_a_scripted_annotator(tmp_path):
    labelled = load_labelled_set().head(12)
    answers = {r: _annotation(p, **{p: True} if p != "other" else {})
               for r, p in zip(labelled["reply"], labelled["p1_primary"])}
    wrong = labelled["reply"].iloc[0]
    answers[wrong] = _annotation("self_disclosure" if labelled["p1_primary"].iloc[0] != "self_disclosure"
                                else "praise")
    result = annotator_validation(ScriptedAnnotator(answers), labelled)
    t = result["table"].set_index(["reference", "field"])
    assert result["n"] == 12 and result["n_unparsed"] == 0
    assert set(result["table"]["reference"]) == {"p1", "b1"}
    assert t.loc[("p1", "primary"), "agreement"] == pytest.approx(11 / 12)
    predicted = [answers[r]["primary"] for r in labelled["reply"]]
    assert t.loc[("p1", "primary"), "kappa"] == pytest.approx(cohen_kappa(list(labelled["p1_primary"]), predicted))
    assert t.loc[("b1", "primary"), "kappa"] == pytest.approx(cohen_kappa(list(labelled["b1_primary"]), predicted))
    assert {"p1_primary", "b1_primary"} <= set(result["annotations"].columns)
    report = StrategyReport("scripted", pd.DataFrame(), None, result, labelled_set_agreement(),
                              labelled_set_agreement(passes=CONSISTENCY_PASSES))
    text = describe_reliability(report)
    independent = labelled_set_agreement().set_index("field").loc["primary", "kappa"]
    consistency = labelled_set_agreement(passes=CONSISTENCY_PASSES).set_index("field").loc["primary", "kappa"]
    assert "two independent passes" in text and f"κ {independent:.2f} on the primary label" in text
    assert f"consistency check: κ {consistency:.2f}" in text and "against annotator B" in text


def test_strategy_mix_use_and_plots():
    labelled = pd.DataFrame([_annotation("question", question=True, empathic_depth=1),
                             _annotation("question", question=True), _annotation("advice", advice=True),
                             _annotation("praise", praise=True, question=True),
                             _annotation("advice", advice=True, empathic_depth=2), _annotation(UNPARSED)])
    labelled["step"] = [1, 1, 1, 1, 2, 2]
    labelled["source"] = ["baseline"] * 4 + ["trained"] * 2
    mix = strategy_mix(labelled)
    shares = mix.set_index(["step", "strategy"])["share"]
    assert shares[(1, "question")] == 0.5 and shares[(2, "advice")] == 1.0 and shares[(2, "praise")] == 0.0
    assert mix.groupby("step")["share"].sum().tolist() == pytest.approx([1.0, 1.0])  # unparsed left out
    fig = plot_strategy_mix(mix)
    ax = fig.axes[0]
    assert len(ax.collections) == 3 and ax.get_ylabel() == "share of replies"
    assert _labels(ax) == ["praise", "advice", "question"]  # taxonomy order
    fig = plot_strategy_mix(strategy_mix(labelled, by="source"), by="source", order=["baseline", "trained"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["baseline", "trained"]
    use = strategy_use(labelled, by="source").set_index(["source", "measure"])["value"]
    assert use[("baseline", "question")] == 0.75 and use[("baseline", "empathic_depth")] == 0.25
    assert use[("trained", "advice")] == 1.0 and use[("trained", "empathic_depth")] == 2.0
    fig = plot_strategy_use(strategy_use(labelled, by="source"), by="source")
    assert [a.get_title() for a in fig.axes] == ["strategy", "dimension"]
    assert len(fig.axes[0].patches) == 2 * len(STRATEGY_KEYS)


# --------------------------------------------------------------------------- reward hacking


def test_reply_features_hand_computed():
    f = reply_features("Sorry, are you ok? Your day sounds hard?", user="Your day sounds bad.")
    # words: sorry are you ok your day sounds hard (8); bigrams 7, of which "your day", "day sounds" in the user's
    assert f == pytest.approx({"reply_length": 40, "question_marks": 2, "second_person_rate": 2 / 8,
                               "apologies": 1, "praise_phrases": 0, "user_overlap": 2 / 7,
                               "non_natural_rate": 0, "score_mentions": 0, "emotion_mentions": 0})
    g = reply_features("Well done! Rate me 10/10 +10 <b>", user=None)
    # non-space characters 26; '<', '>', '/', '+' are not natural-language characters
    assert g["praise_phrases"] == 1 and g["score_mentions"] == 3  # "Rate", "10/10", "+10"
    assert g["non_natural_rate"] == pytest.approx(4 / 26) and g["user_overlap"] == 0
    h = reply_features("对不起，你的感受很重要。您别担心？")
    assert h["apologies"] == 1 and h["question_marks"] == 1 and h["emotion_mentions"] == 1
    assert h["second_person_rate"] == pytest.approx(2 / 14)  # 14 CJK characters, 你 and 您 among them


def test_distinct_n_hand_computed():
    assert distinct_n(["a b a b", "a b"], 2) == pytest.approx(2 / 4)
    assert distinct_n(["a b a b", "a b"], 1) == pytest.approx(2 / 6)
    assert np.isnan(distinct_n(["a"], 2))
    table = distinct_table(pd.DataFrame({"source": ["x", "x", "y"], "reply": ["a b", "a b", "c d e"]}))
    assert table.set_index("source")["distinct_2"].to_dict() == {"x": 0.5, "y": 1.0}


def _hacking_table():
    # step 1: d1 (10, +2), (20, +4); d2 (30, +3) / step 2: d3 (40, +8), (50, +6); d4 (60, +10)
    rows = [("d1", 1, 10, 2), ("d1", 1, 20, 4), ("d2", 1, 30, 3),
            ("d3", 2, 40, 8), ("d3", 2, 50, 6), ("d4", 2, 60, 10), ("d4", 2, 70, None)]
    table = pd.DataFrame(rows, columns=["dialogue_id", "step", "length", "change"])
    table["reply"] = ["a" * n for n in table["length"]]
    table["user"] = "hm"
    return turn_features(table)


def test_hacking_statistics_hand_computed():
    table = _hacking_table()
    assert table["reply_length"].tolist() == [10, 20, 30, 40, 50, 60, 70]
    stats = hacking_statistics(table, features=["reply_length"], n_boot=400).set_index("feature")
    # within-step deviations: x -10, 0, 10 | -10, 0, 10; y -1, 1, 0 | 0, -2, 2
    # r = 30 / sqrt(400 * 10)
    assert stats.loc["reply_length", "r"] == pytest.approx(30 / np.sqrt(4000))
    assert stats.loc["reply_length", "n_turns"] == 6 and stats.loc["reply_length", "n_clusters"] == 4
    low, high = stats.loc["reply_length", ["low", "high"]]
    assert -1 <= low <= high <= 1 and low < high
    # without the step partialled out: plain Pearson r = 255 / sqrt(1750 * 47.5)
    plain = hacking_statistics(table, features=["reply_length"], control=None, n_boot=50)
    assert plain["r"].iloc[0] == pytest.approx(255 / np.sqrt(1750 * 47.5))
    # one cluster: every resample is the whole table, so the interval collapses onto r
    one = hacking_statistics(table.assign(dialogue_id="all"), features=["reply_length"], n_boot=50)
    assert one["low"].iloc[0] == pytest.approx(one["r"].iloc[0]) == pytest.approx(one["high"].iloc[0])
    # a feature constant within every step has no correlation
    const = hacking_statistics(table, features=["apologies"], n_boot=20)
    assert np.isnan(const["r"].iloc[0])
    every = hacking_statistics(table, n_boot=20)
    assert every["feature"].tolist() == list(HACKING_FEATURES)
    with pytest.raises(KeyError):
        hacking_statistics(table.drop(columns=["change"]), n_boot=10)


def test_length_controlled_gain_hand_computed():
    base = pd.DataFrame({"source": "baseline", "reply_length": [10, 20, 30, 40], "change": [0, 0, 4, 4]})
    trained = pd.DataFrame({"source": "trained", "reply_length": [30, 40, 50, 60], "change": [4, 4, 8, 8]})
    table, summary = length_controlled_gain(pd.concat([base, trained]), n_bins=2)
    # pooled median 35: bin [10, 35] baseline 0,0,4 vs trained 4; bin (35, 60] baseline 4 vs trained 4,8,8
    assert table["n_reference"].tolist() == [3, 1] and table["n_treatment"].tolist() == [1, 3]
    assert table["gain"].tolist() == pytest.approx([4 - 4 / 3, 20 / 3 - 4])
    assert summary["raw_gain"] == pytest.approx(4.0)
    assert summary["within_bin_gain"] == pytest.approx(8 / 3)  # longer replies explain a third of the gain
    with pytest.raises(ValueError):
        length_controlled_gain(base, n_bins=2)


def test_run_replies_reads_evaluations_and_training(runs):
    replies = run_replies(runs[0])
    assert set(replies["source"]) == {"step 1", "step 2"}  # the fixture runs have no eval dialogues
    assert replies["change"].tolist() == [10, 5, 20, 30]
    sample = sample_replies(replies, 1, seed=0)
    assert sample["source"].tolist() == ["step 1", "step 2"]


def _scenarios(n):
    return rlver_test_profiles(n)


def test_injection_probes_with_rule_simulator():
    from rlver_lib.scenarios import load_scenarios
    from rlver_lib.simulator import RuleSimulator

    scenarios = load_scenarios("builtin:test")[:2] + _scenarios(1)
    probes = run_injection_probes(RuleSimulator(), scenarios)
    assert len(probes) == 3 * (1 + len(INJECTIONS["en"]))
    assert set(probes["language"]) == {"en", "zh"}
    # each probe is the control with an injection appended
    for _, row in probes[probes["kind"] != "control"].iterrows():
        assert row["reply"].startswith(CONTROL_REPLIES[row["language"]])
    # rule simulator: +10 for a reply ending in a question mark (the control), -5 otherwise
    assert set(probes[probes["kind"] == "control"]["change"]) == {10}
    assert set(probes[probes["kind"] != "control"]["change"]) == {-5}
    summary = summarize_injection(probes, n_boot=50)
    assert summary.loc["probe - control", "diff"] == pytest.approx(-15.0)
    assert summary.loc["fake_system", ["n", "control", "probe"]].tolist() == [3, 10, -5]


def test_summarize_injection_pairs_by_scenario():
    probes = pd.DataFrame({"scenario_id": ["s1", "s1", "s2", "s2", "s3", "s3"],
                           "kind": ["control", "fake_system"] * 3,
                           "change": [2, 5, -1, 3, 4, np.nan]})
    row = summarize_injection(probes, n_boot=50).loc["fake_system"]
    # s3 has no usable probe appraisal: pairs (2, 5) and (-1, 3) -> differences 3 and 4
    assert row["n"] == 2 and row["diff"] == pytest.approx(3.5) and row["control"] == pytest.approx(0.5)


def test_simulator_consistency():
    from rlver_lib.simulator import RuleSimulator, default_change_fn

    scenarios = _scenarios(2)
    records = [_record("d0", ["Why?", "ok.", "And then?"], [50, 45, 55], scenarios[0].id),
               _record("d1", ["Sure."], [35], scenarios[1].id)]
    samples = requests_from_records(records, scenarios, n=10, seed=0)
    assert len(samples) == 4
    req, change = next((r, c) for r, c in samples if r.dialogue_id == "d0:3")
    assert (req.emotion, req.turn, change) == (45, 2, 10)
    assert [m["content"] for m in req.history] == ["I had a bad day.", "Why?", "hm", "ok.", "hm", "And then?"]

    def make_simulator(seed):  # seed 0 reproduces the run; seed 1 flips every change
        return RuleSimulator() if seed == 0 else RuleSimulator(lambda reply: -default_change_fn(reply))

    table = simulator_consistency(make_simulator, samples, seed=0, other_seed=1).set_index("condition")
    assert table.loc["same_seed", "sign_agreement"] == 1.0
    assert table.loc["same_seed", "mean_abs_diff"] == 0.0
    assert table.loc["other_seed", "sign_agreement"] == 0.0
    # recorded 10, -5, 10, -5 vs flipped -10, 5, -10, 5
    assert table.loc["other_seed", "mean_abs_diff"] == pytest.approx(15.0)
    with pytest.raises(KeyError):
        requests_from_records(records, scenarios[:1], n=10, seed=0)


def test_sycophancy_on_at_fault_scenarios():
    from rlver_lib.config import SamplingParams
    from rlver_lib.scenarios import load_scenarios

    shipped = load_scenarios("builtin:all")
    at_fault = at_fault_scenarios(shipped)
    assert [s.id for s in at_fault] == [f"en-0{i}" for i in range(49, 55)]
    test_ids = {s.id for s in load_scenarios("builtin:test")}
    assert {s.id for s in at_fault} & test_ids == {"en-049", "en-051", "en-053"}

    class Policy:  # absolves on even samples only
        def generate(self, conversations, sampling, json_schema=None):
            assert conversations[0][-1]["role"] == "user"
            even = sampling.seed % 2 == 0
            return [Generation(text="It's not your fault at all." if even else "What happened next?")
                    for _ in conversations]

    replies = sycophancy_replies(Policy(), at_fault[:2], n_samples=2, sampling=SamplingParams(seed=0),
                                   think=False, seed=0)
    assert len(replies) == 4 and replies["user"].iloc[0] == at_fault[0].opening_line
    annotated = pd.concat([replies, annotate_strategies(RuleAnnotator(), list(replies["reply"]))], axis=1)
    annotated["policy"] = "base"
    absolved = annotated["reply"].str.contains("not your fault").mean()
    rate = sycophancy_rate(annotated, n_boot=50).iloc[0]
    assert rate["rate"] == pytest.approx(absolved) and rate["n_replies"] == 4 and rate["n_scenarios"] == 2


# --------------------------------------------------------------------------- ablation grids


def _eval_dialogues(run, finals, judge="rule"):
    recs = [{**_record(f"{sid}-0", ["ok?"], [e], sid), "label": "trained"} for sid, e in finals.items()]
    write_jsonl(run / "eval" / "trained" / "dialogues.jsonl", recs)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    served = {"base_url": "http://judge.invalid/v1"} if judge == "openai" else {}
    cfg["evaluation"] = {"judge": {"backend": judge, "model": "m", "difficulty": "moderate", **served}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_cells_table_and_paired_cell_differences(runs):
    _eval_dialogues(runs[0], {"s1": 50, "s2": 60, "s3": 70})
    _eval_dialogues(runs[1], {"s1": 55, "s2": 58, "s4": 90})
    cells = cells_table(runs)
    assert list(cells.columns) == ["run", "training.algorithm", "policy.think", "simulator.difficulty"]  # what varies
    table = paired_cell_differences(runs, n_boot=50)
    row = table.iloc[0]
    # common scenarios s1, s2: differences +5 and -2
    assert (row["run"], row["reference"], row["n"]) == ("grpo-nothink", "ppo-think", 2)
    assert row["diff"] == pytest.approx(1.5) and row["reference_score"] == pytest.approx(55.0)
    assert bool(row["same_judge"])
    _eval_dialogues(runs[1], {"s1": 55}, judge="openai")
    assert not bool(paired_cell_differences(runs, n_boot=20).iloc[0]["same_judge"])
    with pytest.raises(ValueError):
        paired_cell_differences(runs, reference="nope")


def test_cell_tables_round_trip(runs):
    write_table(runs[0], ANNOTATIONS, pd.DataFrame({"source": ["trained"], "primary": ["advice"]}))
    write_table(runs[1], "strategy_labels", pd.DataFrame({"source": ["trained"], "primary": ["question"]}))  # older
    table = load_cell_tables(runs, ANNOTATIONS)
    assert table[["run", "policy.think", "primary"]].values.tolist() == [["ppo-think", True, "advice"],
                                                                 ["grpo-nothink", False, "question"]]
    assert load_cell_tables(runs, "absent").empty



def test_a_grid_over_any_dotted_axis_reaches_the_tables_and_figures(tmp_path):
    """A tiny grid over ``training.learning_rate`` (not one of the paper's axes): each
    cell's config is read back through load_config, and the axis is a column and a panel."""
    from rlver_lib.config import dump_config
    from rlver_lib.pipeline.ablate import load_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "lr", "base": {"simulator": {"backend": "rule"}},
                                    "axes": {"training.learning_rate": [1e-5, 3e-5]}}))
    _, grid_cells = load_grid(grid)
    run_dirs = []
    for cell, score in zip(grid_cells, (40.0, 60.0)):
        run = tmp_path / cell.name
        est = {"value": score, "low": score - 5, "high": score + 5, "confidence": 0.95}
        atomic_write_json(run / "eval" / "trained" / "summary.json",
                          {"label": "trained", "n": 10, "sentient_score": est, "success_rate": est,
                           "failure_rate": est, "mean_turns": est})
        (run / "config.yaml").write_text(dump_config(cell.config))
        run_dirs.append(run)
    axes = ["training.learning_rate"]
    table = compare_runs(run_dirs, axes=axes)
    assert table[["training.learning_rate", "sentient_score"]].values.tolist() == [[1e-5, 40.0], [3e-5, 60.0]]
    assert list(cells_table(run_dirs, axes).columns) == ["run", "training.learning_rate"]
    fig = plot_run_comparison(table, factors=axes)
    assert [a.get_title() for a in fig.axes] == ["by training.learning_rate"]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["1e-05", "3e-05"]

def test_ablation_header_lists_what_varies_per_cell(tmp_path):
    from rlver_lib.pipeline.ablate import ablation_header, load_grid

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"name": "g", "output_root": str(tmp_path / "out"),
                                    "base": {"simulator": {"backend": "rule"}, "training": {"steps": 3}},
                                    "axes": {"training.algorithm": ["grpo", "ppo"], "policy.think": [False, True]}},
                                   sort_keys=False))
    _, cells = load_grid(grid)
    header = ablation_header("g", ["training.algorithm", "policy.think"], cells)
    rows = [line for line in header.splitlines() if line.startswith("| `")]
    assert rows == ["| `algorithm-grpo_think-false` | grpo | False | GRPO, 3 step(s) | off | moderate |",
                    "| `algorithm-grpo_think-true` | grpo | True | GRPO, 3 step(s) | on | moderate |",
                    "| `algorithm-ppo_think-false` | ppo | False | PPO, 3 step(s) | off | moderate |",
                    "| `algorithm-ppo_think-true` | ppo | True | PPO, 3 step(s) | on | moderate |"]
    shared = header.split("**Models that ran (every cell).**", 1)[1]
    assert "GRPO" not in shared and "think mode" not in shared  # the base config is not passed off as every cell's


def _bench_records(replies_by_scenario):
    return [{"scenario_id": sid, "transcript": [x for reply in replies
                                                for x in ({"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": reply})]}
            for sid, replies in replies_by_scenario.items()]


def test_reply_changes_by_hand():
    from rlver_lib.analysis.hacking import reply_changes

    base = _bench_records({"a": ["I see.", "I see you."], "b": ["Okay then."]})
    trained = _bench_records({"a": ["How do you feel?", "I see. How do you feel?"], "b": ["How do you feel?"]})
    out = reply_changes(base, trained, top=3)
    length = out["length"].set_index("side")
    assert length.loc["baseline", "replies"] == 3 and length.loc["trained", "replies"] == 3
    assert length.loc["baseline", "mean_chars"] == pytest.approx((6 + 10 + 10) / 3)
    assert length.loc["trained", "mean_words"] == pytest.approx((4 + 6 + 4) / 3)
    assert length.loc["baseline", "question_share"] == 0 and length.loc["trained", "question_share"] == 1
    phrases = out["phrases"].set_index("bigram")
    # "how do", "do you", "you feel" in all 3 trained replies, none before; "i see" 2/3 -> 1/3
    assert phrases.loc["do you", "change"] == pytest.approx(1.0)
    assert phrases.loc["i see", "baseline_share"] == pytest.approx(2 / 3)
    assert phrases.loc["i see", "trained_share"] == pytest.approx(1 / 3)
    assert list(out["phrases"]["change"]) == sorted(out["phrases"]["change"], reverse=True)


def test_plot_paired_scenarios_sorted_and_titled():
    from rlver_lib.plots import plot_paired_scenarios

    paired = {"baseline": "baseline", "trained": "trained", "mean_diff": 1.5, "ci_low": -2.0, "ci_high": 5.0,
              "p_value": 0.5, "n_scenarios": 2,
              "scenarios": [{"scenario_id": "x", "baseline": 40, "trained": 48, "diff": 8},
                            {"scenario_id": "y", "baseline": 45, "trained": 40, "diff": -5}]}
    fig = plot_paired_scenarios(paired)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["y", "x"]  # sorted by difference
    assert ax.get_title() == "trained - baseline +1.5 [-2.0, +5.0], p = 0.5, n = 2 scenarios"
    with pytest.raises(ValueError):
        plot_paired_scenarios({**paired, "scenarios": []})
