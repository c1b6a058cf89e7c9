"""One-way layers: the package-internal import graph of ``rlver_lib`` has no cycle, and
every import points down the layer order of docs/ARCHITECTURE.md ("Code map"). Tests
mirror modules: each module has its own test file (:data:`TESTED_WITH` names the few
that do not, and why).

Imports are read with ``ast`` from the source, including those inside functions and
under ``TYPE_CHECKING``: a cycle hidden in a function body is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlver_lib"

# Lowest first; a module may import modules of its own layer or of a lower one. A
# sub-package (a folder) is one layer; its modules are named ``folder.module``.
LAYERS: list[tuple[str, set[str]]] = [
    ("data and config", {"config", "params", "files", "stats"}),
    ("backends", {"native", "backends", "openai_backend", "servers", "vllm_backend", "vllm_server"}),
    ("simulator and rollout", {"scenarios", "appraisal", "appraiser", "user_prompts", "simulator", "models",
                               "rollout", "records", "character", "plots"}),
    ("algorithms and trainer", {"algorithms", "algorithm_objects", "credit", "checkpoint", "learner", "trainer"}),
    ("evaluation", {"evaluation.*"}),
    ("analysis", {"analysis.*"}),
    ("pipeline and CLI", {"pipeline.*", "doctor", "cli"}),
]

MAX_FLOORS = 9
"""The longest chain of imports, counting a folder as one room (12 before the folders)."""

TESTED_WITH: dict[str, tuple[str, str]] = {
    "algorithm_objects": ("test_algorithms.py", "the algorithm objects beside the maths they call"),
    "learner": ("test_trainer.py", "the learner's shared path runs inside a training step"),
    "openai_backend": ("test_backends.py", "every chat backend against one loopback server"),
    "servers": ("test_native.py", "a server's life-cycle with the engine it starts"),
    "vllm_server": ("test_vllm_serve.py", "named after the command it serves"),
    "user_prompts": ("test_simulator.py", "the prompts through the simulator that sends them"),
    "evaluation.agreement_stats": ("test_agreement.py", "the statistics of one command's result"),
    "pipeline.process": ("test_run_process.py", "the folder's lock and the signals, on real runs; the launcher's "
                         "variables in test_stage_environment.py"),
}
"""Modules tested in another module's file: ``{module: (test file, why)}``; every other
module ``a`` or ``folder.a`` has ``tests/test_a.py`` or ``tests/test_folder_a.py``."""


def module_names(package_dir: Path = PACKAGE) -> dict[str, Path]:
    """``{dotted module name below the package: file}``; a folder's ``__init__`` is the folder."""
    names = {}
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names[".".join(parts)] = path
    return names


def _resolve(dotted: str, modules: set[str]) -> str | None:
    """The longest prefix of ``dotted`` that is a module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def internal_imports(source: str, modules: set[str], package: str = "rlver_lib") -> set[str]:
    """The modules of the package (of ``modules``, dotted below the package) that ``source``
    imports, at any depth of the syntax tree: ``from . import x``, ``from .x import y``,
    ``from rlver_lib(.x.y) import z`` (``z`` itself when it is a module), ``import rlver_lib.x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name[len(package) + 1:] for alias in node.names if alias.name.startswith(package + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module or ""
            elif node.module == package or (node.module or "").startswith(package + "."):
                base = node.module[len(package) + 1:]
            else:
                continue
            for alias in node.names:
                targets.append(f"{base}.{alias.name}" if base else alias.name)
        for target in targets:
            module = _resolve(target, modules)
            if module:
                found.add(module)
    return found


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over every module of the package and its folders."""
    files = module_names(package_dir)
    return {name: internal_imports(path.read_text(encoding="utf-8"), set(files)) - {name}
            for name, path in files.items()}


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph with each folder's modules merged into one node (the folder)."""
    merged: dict[str, set[str]] = {}
    for module, deps in graph.items():
        top = module.split(".")[0]
        merged.setdefault(top, set()).update(d.split(".")[0] for d in deps)
    return {top: deps - {top} for top, deps in merged.items()}


def floors(graph: dict[str, set[str]]) -> int:
    """The longest import chain of an acyclic graph, counted in modules."""
    depth: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in depth:
            depth[node] = 1 + max((floor(d) for d in graph.get(node, ())), default=0)
        return depth[node]

    return max((floor(n) for n in graph), default=0)


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


def _layer_of(modules: set[str]) -> dict[str, int]:
    """``{module: layer rank}``; ``folder.*`` places every module of the folder."""
    rank = {}
    for module in modules:
        for i, (_, members) in enumerate(LAYERS):
            if module in members or module.split(".")[0] + ".*" in members:
                rank[module] = i
    return rank


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
        "from rlver_lib.pipeline.run import run_pipeline\n"
        "from rlver_lib.analysis import cells\n"
    )
    modules = {"config", "io", "backends", "models", "rollout", "stats", "trainer", "evaluation",
               "analysis", "workbench", "pipeline", "pipeline.run", "analysis.cells", "analysis.runs"}
    assert internal_imports(source, modules) == modules - {"workbench", "pipeline", "analysis.runs"}


def test_find_cycles_on_known_graphs():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "a"}}) == [["a", "b"], ["c", "d"]]
    assert find_cycles({"a": {"a"}}) == [["a"]]


# ------------------------------------------------------------------ the package


def test_every_module_has_one_layer():
    placed = [m for _, members in LAYERS for m in members]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    modules = set(import_graph()) - {"__init__"}
    assert modules - set(_layer_of(modules)) == set(), "new module: give it a layer in LAYERS"


def test_import_graph_has_no_cycle():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"modules that import each other (directly or through others): {cycles}"


def test_imports_point_down_the_layers():
    graph = import_graph()
    layer = _layer_of(set(graph))
    upward = sorted(
        f"{module} ({LAYERS[layer[module]][0]}) imports {dep} ({LAYERS[layer[dep]][0]})"
        for module, deps in graph.items() if module in layer
        for dep in deps if dep in layer and layer[dep] > layer[module]
    )
    assert upward == [], "\n".join(upward)


def test_floors_fewer_than_before_the_folders():
    graph = import_graph()
    assert floors(folder_graph(graph)) <= MAX_FLOORS, "a longer import chain: flatten it or raise MAX_FLOORS"


def own_test_files(module: str) -> list[str]:
    """The names a module's own test file may have: ``test_<module>.py`` and, for
    ``folder.module``, ``test_<folder>_<module>.py``."""
    parts = module.split(".")
    return [f"test_{parts[-1]}.py", f"test_{'_'.join(parts)}.py"]


def test_every_module_has_its_test_file():
    tests = Path(__file__).resolve().parent
    modules = [m for m, path in module_names().items() if path.name != "__init__.py"]
    missing = sorted(m for m in modules if m not in TESTED_WITH
                     and not any((tests / name).is_file() for name in own_test_files(m)))
    assert missing == [], f"modules without tests/test_<module>.py (add one, or a TESTED_WITH entry): {missing}"
    stale = sorted(m for m, (name, _) in TESTED_WITH.items() if m not in modules or not (tests / name).is_file()
                   or any((tests / own).is_file() for own in own_test_files(m)))
    assert stale == [], f"TESTED_WITH entries no longer true: {stale}"

