"""Files of a run (rlver_lib.files): atomic writes, JSON Lines, and the paths of a run
folder, a benchmark's folder and an ablation's folder, spelled nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest
from source_support import PACKAGE, ROOT, hand_spelled_paths, python_sources

from rlver_lib.files import (
    AblationFolder,
    CheckpointFolder,
    EvalFolder,
    JsonlError,
    RunFolder,
    atomic_write_json,
    iter_jsonl,
    write_jsonl,
)

FOLDERS = (RunFolder, EvalFolder, AblationFolder, CheckpointFolder)


def test_jsonl_round_trip_and_a_bad_line_names_its_number(tmp_path):
    path = write_jsonl(tmp_path / "a" / "x.jsonl", [{"a": 1}, {"b": 2}])
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (2, {"b": 2})]
    path.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(JsonlError, match=":2"):
        list(iter_jsonl(path))


def test_run_folder_names_every_path(tmp_path):
    run = RunFolder(tmp_path)
    assert run.config == tmp_path / "config.yaml" and run.report == tmp_path / "report.html"
    assert run.eval_dir("trained").dialogues == tmp_path / "eval" / "trained" / "dialogues.jsonl"
    assert run.paired == tmp_path / "eval" / "paired.json"
    assert run.scenarios("test") == tmp_path / "scenarios" / "test.jsonl"
    assert run.analysis_table("distinct") == tmp_path / "analysis" / "distinct.csv"
    assert run.adapter == tmp_path / "train" / "adapter"
    for label in ("trained", "baseline"):
        atomic_write_json(run.eval_dir(label).summary, {"label": label})
    write_jsonl(run.train / "dialogues" / "step_000002.jsonl", [])
    write_jsonl(run.train / "dialogues" / "step_000001.jsonl", [])
    write_jsonl(run.step_dialogues_file(2, failed=True), [])  # a dead simulator's step, redone
    assert [p.parent.name for p in run.summaries()] == ["baseline", "trained"]
    assert [p.name for p in run.step_dialogues()] == ["step_000001.jsonl", "step_000002.jsonl"]
    assert run.adapter_config == tmp_path / "train" / "adapter" / "adapter_config.json"
    assert run.eval_figure("trained", "breakdown") == tmp_path / "figures" / "eval_trained_breakdown.png"


def test_eval_folder_names_a_benchmarks_files(tmp_path):
    bench = RunFolder(tmp_path).eval_dir("trained")
    assert bench == EvalFolder(tmp_path / "eval" / "trained")
    names = {"dialogues": "dialogues.jsonl", "summary": "summary.json", "breakdown": "breakdown.csv",
             "trajectory": "trajectory.csv", "capability": "capability.json", "humaneval": "humaneval.jsonl",
             "math": "math.json", "lm_eval": "lm_eval.json"}
    assert {attr: getattr(bench, attr) for attr in names} == {attr: bench.root / n for attr, n in names.items()}


def test_run_folder_lists_the_benchmarks_it_holds(tmp_path):
    run = RunFolder(tmp_path)
    assert run.eval_dirs() == [] and run.summaries() == []  # no eval/ yet
    write_jsonl(run.eval_dir("trained").dialogues, [])  # a benchmark stopped before its summary
    atomic_write_json(run.eval_dir("baseline").summary, {})
    run.eval_dir("baseline").trajectory.write_text("turn,emotion\n")
    atomic_write_json(run.paired, {})
    assert run.eval_dirs() == [run.eval_dir("baseline"), run.eval_dir("trained")]
    assert run.summaries() == [run.eval_dir("baseline").summary]
    assert run.eval_trajectories() == [run.eval_dir("baseline").trajectory]


def test_ablation_folder_holds_its_grid_report_and_cells(tmp_path):
    ablation = AblationFolder(tmp_path / "grid")
    assert ablation.cells() == []  # nothing run yet
    assert ablation.grid == tmp_path / "grid" / "grid.yaml"
    assert ablation.report == tmp_path / "grid" / "report.html"
    assert ablation.notebooks == tmp_path / "grid" / "notebooks"
    assert ablation.cell("b") == RunFolder(tmp_path / "grid" / "b")
    for name in ("b", "a"):
        ablation.cell(name).config.parent.mkdir(parents=True)
        ablation.cell(name).config.write_text("{}")
    ablation.notebooks.mkdir()
    assert ablation.cells() == [ablation.cell("a"), ablation.cell("b")]


def owned_names() -> set[str]:
    """Every file and folder name the folder classes spell: each part of what their
    properties return, and the folders their methods name."""
    paths = [getattr(cls(Path()), name) for cls in FOLDERS
             for name, attr in vars(cls).items() if isinstance(attr, property)]
    run = RunFolder(Path())
    paths += [run.scenarios("test").parent, run.analysis_table("distinct").parent]
    return {part for path in paths for part in path.parts}


def test_hand_spelled_paths_finds_joins_and_file_names_but_not_docstrings():
    source = ('"""Writes summary.json."""\n'
              'a = run_dir / "train" / "dialogues"\n'
              'b = PROJECT_ROOT / "notebooks"\n'
              'c = f"{d}/summary.json"\n'
              'd = sorted(root.glob("*/config.yaml"))\n'
              'e = "train" if split == "train" else "summary"\n')
    names = {"train", "dialogues", "notebooks", "summary.json", "config.yaml"}
    assert hand_spelled_paths(names, {"m.py": source}, exempt_roots={"PROJECT_ROOT"}) == ["m.py:2", "m.py:4", "m.py:5"]


def test_no_run_path_is_spelled_outside_the_folder_classes():
    """The library, the notebooks' code cells and the benchmarks name a run's paths
    through :class:`RunFolder`, :class:`EvalFolder`, :class:`AblationFolder` and
    :class:`CheckpointFolder` only; joins onto ``PROJECT_ROOT`` name the project's folders."""
    sources = python_sources(PACKAGE, ROOT / "notebooks", ROOT / "benchmarks")
    assert any(where.startswith("notebooks/05_ablations.ipynb[cell ") for where in sources)
    del sources["rlver_lib/files.py"]
    assert hand_spelled_paths(owned_names(), sources, exempt_roots={"PROJECT_ROOT"}) == []
