"""Every ``rlver_lib`` name the docs mention exists: a backticked dotted path
(``rlver_lib.a.b``, or ``module.name`` with ``module`` one of the package's modules)
in README.md or docs/*.md resolves by import and attribute look-up. Config keys spelled
the same way (``evaluation.judge``, ``analysis.n_annotated_replies``) are not names."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONFIG_SECTIONS = {"policy", "simulator", "scenarios", "rollout", "training", "evaluation", "analysis",
                   "capability", "distributed", "judge", "lm_eval"}
FILE_SUFFIXES = {"py", "yaml", "json", "jsonl", "md", "csv", "html", "ipynb", "png", "txt", "toml", "lock"}
_TICKED = re.compile(r"`([A-Za-z_][\w.]*\.[A-Za-z_]\w*)(?:\([^`]*\))?`")


def _modules() -> set[str]:
    """Dotted module names below ``rlver_lib`` and each one's last part."""
    names = set()
    for path in (ROOT / "rlver_lib").rglob("*.py"):
        parts = path.relative_to(ROOT / "rlver_lib").with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            names.add(".".join(parts))
    return names


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` (below ``rlver_lib``) names a module or an attribute of one."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module("rlver_lib." + ".".join(parts[:end]))
        except ImportError:
            continue
        try:
            for attr in parts[end:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def mentioned_names(text: str, modules: set[str]) -> set[str]:
    """The package names in backticks in ``text``, dotted below ``rlver_lib``."""
    short = {m.split(".")[-1]: m for m in modules}
    found = set()
    for token in _TICKED.findall(text):
        if token.startswith("rlver_lib."):
            found.add(token[len("rlver_lib."):])
            continue
        head = token.split(".")[0]
        if head in CONFIG_SECTIONS or head not in short or token.rsplit(".", 1)[1] in FILE_SUFFIXES:
            continue
        found.add(short[head] + token[len(head):])
    return found


def test_mentioned_names_reads_full_and_short_paths():
    modules = {"records", "evaluation", "evaluation.benchmark", "files"}
    text = ("`rlver_lib.files.atomic_write_text` and `records.dialogue_view(record)`, "
            "`evaluation.judge` (a config key), `benchmark.summarize`, `files.py`, `cfg.seed`")
    assert mentioned_names(text, modules) == {"files.atomic_write_text", "records.dialogue_view",
                                              "evaluation.benchmark.summarize"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_name_the_docs_mention_exists(doc):
    missing = sorted(n for n in mentioned_names(doc.read_text(encoding="utf-8"), _modules()) if not resolves(n))
    assert missing == [], f"{doc.name} names what rlver_lib does not define: {missing}"


_SECTION_REF = re.compile(r"""(README|docs/[A-Z]+)(?:\.md)? *\(?["'“]([A-Z][^"'”\n]{2,60})["'”]""")


def headings(doc: Path) -> list[str]:
    """The Markdown headings of ``doc``, without their ``#`` marks."""
    return [line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")]


def section_references(text: str) -> list[tuple[str, str]]:
    """``(document, section)`` for each ``docs/NAME.md "Section"`` or ``README "Section"``
    in ``text``; the document is a path relative to the repository."""
    return [("README.md" if doc == "README" else doc + ".md", section) for doc, section in _SECTION_REF.findall(text)]


def test_section_references_are_read_from_code_and_docs():
    text = 'see docs/ARCHITECTURE.md "Code map"; docs/SETUP.md (\'The native build\'); README "Commands".'
    assert section_references(text) == [("docs/ARCHITECTURE.md", "Code map"), ("docs/SETUP.md", "The native build"),
                                        ("README.md", "Commands")]


def test_every_section_a_reference_names_exists():
    sources = [*DOCS, *(ROOT / "rlver_lib").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
               *(ROOT / "params").rglob("*.yaml"), *(ROOT / "notebooks").glob("*.ipynb")]
    missing = []
    for source in sources:
        for doc, section in section_references(source.read_text(encoding="utf-8")):
            target = ROOT / doc
            if not target.is_file() or not any(h.startswith(section) for h in headings(target)):
                missing.append(f"{source.relative_to(ROOT)}: {doc} \"{section}\"")
    assert missing == [], "references to sections that do not exist:\n" + "\n".join(missing)
