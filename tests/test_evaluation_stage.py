"""What notebook 04 and ``rlver eval`` call (rlver_lib.evaluation.stage): the benchmark under
the judge, not the training simulator, and the headline it writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from evaluation_support import ScriptedPolicy, scored, three_scenarios
from pipeline_support import run_config
from reference_data import reference_file

from rlver_lib.evaluation.benchmark import summarize


def test_evaluate_uses_the_judge_not_the_training_simulator(tmp_path, monkeypatch):
    from rlver_lib.evaluation.stage import evaluate
    from rlver_lib.params import build_config
    from rlver_lib.pipeline.report import headline_markdown

    scenarios = three_scenarios()
    openings = [s.opening_line for s in scenarios]
    policies = {"baseline": ScriptedPolicy(dict(zip(openings, ["tell", "tell", "alternate"]))),
                "trained": ScriptedPolicy(dict(zip(openings, ["ask", "alternate", "ask"])))}
    current = {}
    monkeypatch.setattr("rlver_lib.evaluation.stage.load_policy", lambda cfg: (None, None))
    monkeypatch.setattr("rlver_lib.evaluation.stage.make_policy_backend", lambda cfg, m, t: policies[current["label"]])
    cfg = build_config({
        "output_root": str(tmp_path), "run_name": "r",
        # a hard LLM training simulator that must not be built: its model file does not exist
        "simulator": {"backend": "llamacpp", "model": str(tmp_path / "none.gguf"), "difficulty": "hard"},
        "scenarios": {"test": str(reference_file("rlver_profiles", "test_profile.jsonl")), "n_test_scenarios": 3},
        "evaluation": {"judge": {"backend": "rule"}, "max_turns": 4, "n_boot": 50},
        "capability": {"n_humaneval_problems": 0, "n_math_items": 0},  # retention off
    })
    for label in ("baseline", "trained"):
        current["label"] = label
        ev = evaluate(cfg, label=label)
    summary = json.loads((tmp_path / "r" / "eval" / "trained" / "summary.json").read_text())
    assert summary["judge"] == {"backend": "rule", "change_function": "default_change_fn"}
    assert summary["protocol"]["name"] == "full"
    paired = json.loads((tmp_path / "r" / "eval" / "paired.json").read_text())
    # 4 turns from 40: tell -> 20, alternate -> 50, ask -> 80
    base = {"tell": 20, "alternate": 50, "ask": 80}
    expected = [base[b] - base[a] for a, b in zip(["tell", "tell", "alternate"], ["ask", "alternate", "ask"])]
    assert paired["mean_diff"] == pytest.approx(np.mean(expected)) and paired["n_scenarios"] == 3
    assert ev.paired is not None and ev.paired.difference.mean_diff == pytest.approx(paired["mean_diff"])
    text = headline_markdown(tmp_path / "r", wall_s=125.0)
    assert text.startswith("## Headline") and f"{np.mean(expected):+.1f} emotion points" in text
    assert "n = 3 scenarios &lt; 10" in text or "n = 3 scenarios < 10" in text
    assert "rule simulator" in text and "Protocol: `full`" in text and "2.1 min" in text


def test_headline_shows_intervals_from_ten_scenarios_on(tmp_path):
    from rlver_lib.evaluation.benchmark import write_summary
    from rlver_lib.evaluation.paired import write_paired
    from rlver_lib.files import write_jsonl
    from rlver_lib.pipeline.report import headline_markdown

    proto = {"name": "sage", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 9, "repeats": 1}
    judge = {"backend": "openai", "model": "judge-7b", "base_url": "http://h/v1", "difficulty": "moderate",
             "temperature": 0.7, "seed": 3}
    for label in ("baseline", "trained"):
        records = [scored(f"s{i}", 0, 30 + 2 * i + ((6 if i % 4 else -2) if label == "trained" else 0))
                   for i in range(12)]
        write_jsonl(tmp_path / "eval" / label / "dialogues.jsonl", records)
        write_summary(summarize(records, n_boot=100), tmp_path / "eval" / label, label,
                      {"judge": judge, "protocol": proto})
    pc = write_paired(tmp_path, n_boot=200)
    # 9 scenarios +6, 3 scenarios -2: mean (54 - 6) / 12 = 4
    assert pc.difference.mean_diff == pytest.approx(4.0) and pc.difference.n_scenarios == 12
    text = headline_markdown(tmp_path)
    assert "+4.0 emotion points" in text and "not evidence" not in text and "color:#888" not in text
    assert f"[{pc.difference.ci_low:+.1f}, {pc.difference.ci_high:+.1f}]" in text
    assert "`judge-7b` through `openai` at http://h/v1, moderate difficulty" in text
    assert "Protocol: `sage`" in text and "SAGE's 100 test profiles" in text


@pytest.mark.parametrize("simulator_model, expected", [
    ("embedded:qwen2.5-coder-1.5b-instruct-q4km", "The judge is the same model and appraisal as the training reward"),
    ("other.gguf", None),
])
def test_headline_says_when_the_judge_is_the_training_reward(tmp_path, simulator_model, expected):
    from rlver_lib.evaluation.benchmark import write_summary
    from rlver_lib.params import build_config, dump_config
    from rlver_lib.pipeline.report import headline_markdown

    judge = {"backend": "llamacpp", "model": "embedded:qwen2.5-coder-1.5b-instruct-q4km", "base_url": None,
             "difficulty": "moderate", "appraisal": "expected", "temperature": 0.7, "seed": 0}
    cfg = build_config({"simulator": {"backend": "llamacpp", "model": simulator_model, "appraisal": "expected"}})
    (tmp_path / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
    records = [scored("s0", 0, 50)]
    write_summary(summarize(records, n_boot=10), tmp_path / "eval" / "baseline", "baseline", {"judge": judge})
    text = headline_markdown(tmp_path)
    assert "Judge: `embedded:qwen2.5-coder-1.5b-instruct-q4km`" in text
    if expected:
        assert expected in text and "not that the replies became more empathetic" in text
    else:
        assert "training reward" not in text


def test_evaluate_on_a_non_main_rank_loads_nothing_and_calls_no_judge(tmp_path, monkeypatch):
    from rlver_lib.evaluation.stage import eval_command, evaluate

    calls = []
    monkeypatch.setattr("rlver_lib.evaluation.stage.Judge.from_config", lambda *a, **k: calls.append("judge"))
    monkeypatch.setattr("rlver_lib.evaluation.stage.load_policy", lambda *a, **k: calls.append("policy"))
    monkeypatch.setenv("RANK", "1")
    cfg = run_config(tmp_path)
    assert evaluate(cfg, label="baseline") is None
    assert eval_command(cfg) == 0
    assert calls == [] and not cfg.run_dir.exists()


@pytest.mark.parametrize("n_scenarios", [3, 12])
def test_the_headline_table_keeps_its_intervals_and_greys_them_below_ten_scenarios(n_scenarios):
    """As the run's headline does: the interval is shown, and over fewer than 10 scenarios
    greyed with the reason (it used to be NaN there)."""
    from rlver_lib.evaluation.stage import headline_table

    finals = [20 + 5 * i for i in range(n_scenarios)]
    summary = summarize([scored(f"s{i}", 0, final) for i, final in enumerate(finals)], n_boot=200)
    styled = headline_table(summary)
    table = styled.data
    assert table.loc["sentient_score", "value"] == pytest.approx(np.mean(finals))
    low, high = table.loc["sentient_score", ["low", "high"]]
    assert min(finals) <= low < np.mean(finals) < high <= max(finals)  # a percentile interval, never NaN
    html = styled.to_html()
    assert f"{np.mean(finals):.1f}" in html
    assert ("color: #999" in html) == (n_scenarios < 10)
    assert (f"n = {n_scenarios} scenarios &lt; 10" in html or f"n = {n_scenarios} scenarios < 10" in html) \
        == (n_scenarios < 10)
