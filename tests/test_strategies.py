"""The strategy taxonomy and its annotator (rlver_lib.analysis.strategies): the schema and
prompt, parsing, the rule annotator, retries, self-agreement and agreement with the
shipped labelled set, the strategy mix."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from analysis_support import legend_labels

from rlver_lib.analysis.stage import StrategyReport
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
    annotator_config,
    annotator_validation,
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
from rlver_lib.config import AnnotatorConfig
from rlver_lib.params import load_config
from rlver_lib.pipeline.report import describe_reliability
from rlver_lib.stats import cohen_kappa


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
    assert legend_labels(ax) == ["praise", "advice", "question"]  # taxonomy order
    fig = plot_strategy_mix(strategy_mix(labelled, by="source"), by="source", order=["baseline", "trained"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["baseline", "trained"]
    use = strategy_use(labelled, by="source").set_index(["source", "measure"])["value"]
    assert use[("baseline", "question")] == 0.75 and use[("baseline", "empathic_depth")] == 0.25
    assert use[("trained", "advice")] == 1.0 and use[("trained", "empathic_depth")] == 2.0
    fig = plot_strategy_use(strategy_use(labelled, by="source"), by="source")
    assert [a.get_title() for a in fig.axes] == ["strategy", "dimension"]
    assert len(fig.axes[0].patches) == 2 * len(STRATEGY_KEYS)


@pytest.mark.parametrize(("judge_backend", "concurrency"), [("llamacpp", 1), ("openai", 6)])
def test_the_default_annotator_takes_the_judges_model_with_one_local_slot_and_ngram_speculation(
        judge_backend, concurrency):
    """analysis.annotator unset: the judge's model, greedy, n-gram speculation; one slot on a
    llama-server of its own (on the same cores, one slot reads the taxonomy once), the
    judge's concurrency for a server elsewhere."""
    cfg = load_config("params/quickstart.yaml", [f"evaluation.judge.backend={judge_backend}",
                                                 "evaluation.judge.base_url=http://127.0.0.1:8000",
                                                 "evaluation.judge.concurrency=6"])
    annotator = annotator_config(cfg)
    assert (annotator.backend, annotator.model) == (judge_backend, cfg.evaluation.judge.model)
    assert (annotator.concurrency, annotator.speculative, annotator.temperature) == (concurrency, "ngram", 0.0)
    assert cfg.evaluation.judge.speculative == "none"  # only the annotator drafts by default


def test_an_annotator_section_takes_what_it_leaves_unset_from_the_judge():
    """Switching the speculation off keeps the judge's model and settings; a section on
    another backend takes nothing from the judge."""
    cfg = load_config("params/quickstart.yaml", ["analysis.annotator.speculative=none"])
    annotator = annotator_config(cfg)
    judge = cfg.evaluation.judge
    assert (annotator.model, annotator.n_ctx, annotator.max_retries) == (judge.model, 2048, 1) != (
        AnnotatorConfig().model, AnnotatorConfig().n_ctx, AnnotatorConfig().max_retries)
    assert (annotator.speculative, annotator.concurrency, annotator.temperature) == ("none", 1, 0.0)
    remote = annotator_config(load_config("params/quickstart.yaml", [  # a judge elsewhere stays the annotator's
        "evaluation.judge.backend=openai", "evaluation.judge.base_url=http://10.0.0.5:8000/v1",
        "evaluation.judge.model=my-big-judge", "evaluation.judge.concurrency=6",
        "analysis.annotator.speculative=none"]))
    assert (remote.backend, remote.base_url, remote.model, remote.concurrency) == (
        "openai", "http://10.0.0.5:8000/v1", "my-big-judge", 6)
    rule = annotator_config(load_config("params/quickstart.yaml", ["analysis.annotator.backend=rule"]))
    assert rule == AnnotatorConfig(backend="rule")
