"""Notebooks only call the library: no code cell defines a function (``def``, ``lambda``,
``class``) or changes the run config (``cfg.x = ...``, ``cfg.x.y += ...``,
``setattr(cfg, ...)``). Read from the cells' source with ``ast``; IPython magics
(``%...``, ``!...``) are skipped. Fast: no notebook is executed."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest
from source_support import without_magics

NOTEBOOKS = [pytest.param(p, id=p.stem)
             for p in sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))]


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def cell_problems(source: str, config_names: tuple[str, ...] = ("cfg",)) -> list[str]:
    """What in one cell's source breaks the rule, as readable strings (empty: fine)."""
    problems: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(without_magics(source))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            problems.append((node.lineno, f"defines {node.name}"))
        elif isinstance(node, ast.Lambda):
            problems.append((node.lineno, "defines a lambda"))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            flat = [t for target in targets
                    for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])]
            for target in flat:
                if isinstance(target, (ast.Attribute, ast.Subscript)) and _root_name(target) in config_names:
                    problems.append((node.lineno, f"changes {ast.unparse(target)}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and node.args and _root_name(node.args[0]) in config_names):
            problems.append((node.lineno, f"{node.func.id} on {ast.unparse(node.args[0])}"))
    return [f"line {line}: {text}" for line, text in sorted(problems, key=lambda p: p[0])]


def test_cell_problems_finds_definitions_and_config_changes():
    source = (
        "%matplotlib inline\n"
        "def f(x):\n    return x\n"
        "g = lambda s: s\n"
        "cfg.policy.adapter = adapter\n"
        "cfg.scenarios.test, cfg.scenarios.n_test_scenarios = 'a', None\n"
        "cfg.training.steps += 1\n"
        "setattr(cfg.policy, 'think', True)\n"
        "other.x = 1\n"
        "value = cfg.policy.adapter\n"
        "table = pd.DataFrame(rows)\n"
    )
    assert cell_problems(source) == [
        "line 2: defines f",
        "line 4: defines a lambda",
        "line 5: changes cfg.policy.adapter",
        "line 6: changes cfg.scenarios.test",
        "line 6: changes cfg.scenarios.n_test_scenarios",
        "line 7: changes cfg.training.steps",
        "line 8: setattr on cfg.policy",
    ]
    assert cell_problems("x = [s.id for s in items]\nprint(cfg.run_dir)\n") == []


@pytest.mark.parametrize("path", NOTEBOOKS)
def test_notebook_cells_only_call_the_library(path):
    nb = nbformat.read(path, as_version=4)
    found = {f"cell {i}": problems for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (problems := cell_problems(cell.source))}
    assert found == {}


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if not p.values[0].stem.startswith("05")])
def test_run_notebooks_open_with_notebook_session(path):
    """Every notebook of a run (not the grid's 05) sets up with ``notebook.notebook_session``."""
    nb = nbformat.read(path, as_version=4)
    setup = next(cell for cell in nb.cells
                 if cell.cell_type == "code" and "parameters" not in cell.metadata.get("tags", []))
    assert "notebook.notebook_session(params_file, run_dir, overrides)" in setup.source
