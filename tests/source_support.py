"""What the tests that read the project's source share: where a decision by name is
still spelled out as a comparison with a string literal, and where a run path is
spelled by hand."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterable

import nbformat

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlver_lib"


def without_magics(source: str) -> str:
    """A notebook cell's source with its IPython magic lines (``%...``, ``!...``) blanked,
    so ``ast`` parses it and line numbers stay."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def python_sources(*folders: Path) -> dict[str, str]:
    """The Python source under ``folders`` (hidden folders skipped): ``{where: source}``
    for every module (``where``: its path relative to the project root) and every code
    cell of a notebook (``<path>[cell <i>]``, magics blanked)."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.py")) + sorted(folder.rglob("*.ipynb")):
            where = path.relative_to(ROOT).as_posix()
            if any(part.startswith(".") for part in path.relative_to(folder).parts):
                continue
            if path.suffix == ".py":
                found[where] = path.read_text(encoding="utf-8")
                continue
            cells = nbformat.read(path, as_version=4).cells
            found |= {f"{where}[cell {i}]": without_magics(cell.source)
                      for i, cell in enumerate(cells) if cell.cell_type == "code"}
    return found


def _docstrings(tree: ast.AST) -> set[int]:
    """The ``id`` of every docstring's constant in ``tree``."""
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def hand_spelled_paths(names: Iterable[str], sources: dict[str, str],
                       exempt_roots: Iterable[str] = ()) -> list[str]:
    """``where:line`` of every path in ``sources`` (:func:`python_sources`) spelled with one
    of ``names`` (file and folder names): a ``/`` join onto one (``run_dir / "train"``;
    not onto a name of ``exempt_roots``, such as the project's own folders), and a string
    literal other than a docstring, f-string parts included, with a file name (one with a
    dot) among its ``/``-separated parts (``"summary.json"``, ``f"{d}/summary.json"``)."""
    names, exempt_roots = set(names), set(exempt_roots)
    files = {name for name in names if "." in name}
    found = []
    for where, source in sources.items():
        tree = ast.parse(source)
        docstrings, lines = _docstrings(tree), set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                    and node.right.value in names and ast.unparse(node.left) not in exempt_roots):
                lines.add(node.lineno)
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and files & set(node.value.split("/"))):
                lines.add(node.lineno)
        found += [f"{where}:{line}" for line in sorted(lines)]
    return found


def _literals(node: ast.expr) -> set[str]:
    """The string literals of ``node``: itself, or the items of a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def literal_comparisons(names: Iterable[str], subject: str | None = None,
                        package_dir: Path = PACKAGE) -> list[str]:
    """``path:line`` (relative to ``package_dir``) of every comparison in the package's
    modules (``==``, ``!=``, ``in``, ``not in``, chained ones too) with a string literal of
    ``names`` on one side, alone or in a tuple, list or set. With ``subject`` (a regular
    expression) only those whose other side, as source, matches it: ``appraisal`` finds
    ``cfg.appraisal == "sage"`` but not ``protocol == "sage"``."""
    names, found = set(names), []
    for path in sorted(package_dir.rglob("*.py")):
        lines = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            for side in sides:
                if not _literals(side) & names:
                    continue
                others = [ast.unparse(s) for s in sides if s is not side]
                if subject is None or any(re.search(subject, o) for o in others):
                    lines.append(node.lineno)
                    break
        found += [f"{path.relative_to(package_dir)}:{line}" for line in sorted(lines)]
    return found
