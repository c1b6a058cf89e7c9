"""Ablation cells side by side (rlver_lib.analysis.cells): what varies, paired differences
against a reference cell under one judge, per-cell tables, a grid over any dotted axis."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml
from analysis_support import dialogue_record

from rlver_lib.analysis.cells import ANNOTATIONS, cells_table, load_cell_tables, paired_cell_differences, write_table
from rlver_lib.analysis.runs import (
    compare_runs,
)
from rlver_lib.files import atomic_write_json, write_jsonl
from rlver_lib.plots import (
    plot_run_comparison,
)


def _eval_dialogues(run, finals, judge="rule"):
    recs = [{**dialogue_record(f"{sid}-0", ["ok?"], [e], sid), "label": "trained"} for sid, e in finals.items()]
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


def test_every_pair_of_cells_once(runs, tmp_path):
    """``reference="all"``: a three-arm ablation's two differences against its first arm
    and the one between the other two, each paired over the scenarios both cells share."""
    from analysis_support import make_run

    third = make_run(tmp_path, "ppo-nothink", "ppo", False, "moderate", 60.0)
    _eval_dialogues(runs[0], {"s1": 50, "s2": 60, "s3": 70})
    _eval_dialogues(runs[1], {"s1": 55, "s2": 58, "s3": 80})
    _eval_dialogues(third, {"s1": 40, "s2": 61, "s3": 71})
    table = paired_cell_differences([*runs, third], reference="all", n_boot=50)
    pairs = list(zip(table["reference"], table["run"]))
    assert pairs == [("ppo-think", "grpo-nothink"), ("ppo-think", "ppo-nothink"), ("grpo-nothink", "ppo-nothink")]
    # by hand: (+5 - 2 + 10) / 3, (-10 + 1 + 1) / 3, (-15 + 3 - 9) / 3
    assert table["diff"].tolist() == pytest.approx([13 / 3, -8 / 3, -7.0])
    assert table["n"].tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="'all'"):
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
    from rlver_lib.params import dump_config
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
