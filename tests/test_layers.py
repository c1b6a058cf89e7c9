"""One-way layers: the package-internal import graph of ``rlver_lib`` has no cycle, and
every import points down the layer order of docs/ARCHITECTURE.md ("Layers").

Imports are read with ``ast`` from the source, including those inside functions and
under ``TYPE_CHECKING``: a cycle hidden in a function body is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlver_lib"

# Lowest first; a module may import modules of its own layer or of a lower one.
LAYERS: list[tuple[str, set[str]]] = [
    ("data and config", {"config", "io", "stats"}),
    ("backends", {"native", "backends", "vllm_backend", "models"}),
    ("simulator and rollout", {"scenarios", "simulator", "character", "rollout"}),
    ("algorithms and trainer", {"algorithms", "checkpoint", "trainer"}),
    ("evaluation", {"evaluation", "capability", "agreement"}),
    ("analysis", {"analysis"}),
    ("pipeline and CLI", {"workbench", "doctor", "cli"}),
]


def internal_imports(source: str, modules: set[str], package: str = "rlver_lib") -> set[str]:
    """The sibling modules (of ``modules``) that ``source`` imports, at any depth of the
    syntax tree: ``from . import x``, ``from .x import y``, ``from rlver_lib(.x) import``,
    ``import rlver_lib.x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == package and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == package:
                target = node.module if node.level == 1 else None
                if target:
                    found.add(target.split(".")[0])
                else:  # from . import a, b  /  from rlver_lib import a, b
                    found.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith(package + "."):
                found.add(node.module.split(".")[1])
    return found & modules


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over the package's top-level modules."""
    files = {p.stem: p for p in package_dir.glob("*.py") if p.stem != "__init__"}
    return {name: internal_imports(path.read_text(encoding="utf-8"), set(files)) - {name}
            for name, path in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), each as a
    sorted list; a module importing itself counts too. Sorted, so messages are stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _layer_of() -> dict[str, int]:
    return {module: rank for rank, (_, members) in enumerate(LAYERS) for module in members}


# ------------------------------------------------------------------ the helpers themselves


def test_internal_imports_sees_every_form_and_function_bodies():
    source = (
        "import os\n"
        "from . import config, io as rio\n"
        "from .backends import SamplingParams\n"
        "from rlver_lib.models import load_policy\n"
        "import rlver_lib.rollout\n"
        "from rlver_lib import stats\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from .trainer import Trainer\n"
        "def f():\n"
        "    from .evaluation import bootstrap_ci\n"
        "    class C:\n"
        "        def g(self):\n"
        "            from rlver_lib.analysis import save_figure\n"
        "from .data import nothing\n"  # a data folder, not a module
        "from transformers import AutoModel\n"
    )
    modules = {"config", "io", "backends", "models", "rollout", "stats", "trainer", "evaluation",
               "analysis", "workbench"}
    assert internal_imports(source, modules) == modules - {"workbench"}


def test_find_cycles_on_known_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == [["a", "b"], ["c", "d"]]
    assert find_cycles({"a": {"a"}}) == [["a"]]


# ------------------------------------------------------------------ the package


def test_every_module_has_one_layer():
    placed = [m for _, members in LAYERS for m in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    modules = set(import_graph())
    assert modules - set(placed) == set(), "new module: give it a layer in LAYERS (and docs/ARCHITECTURE.md)"


def test_import_graph_has_no_cycle():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"modules that import each other (directly or through others): {cycles}"


def test_imports_point_down_the_layers():
    layer = _layer_of()
    upward = sorted(
        f"{module} ({LAYERS[layer[module]][0]}) imports {dep} ({LAYERS[layer[dep]][0]})"
        for module, deps in import_graph().items() if module in layer
        for dep in deps if dep in layer and layer[dep] > layer[module]
    )
    assert upward == [], "\n".join(upward)

