"""What the tests that read the library's source share: where a decision by name is
still spelled out as a comparison with a string literal."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterable

PACKAGE = Path(__file__).resolve().parents[1] / "rlver_lib"


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
