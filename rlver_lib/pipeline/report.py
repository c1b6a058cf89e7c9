"""Notebooks into a report: :func:`execute_notebook` (papermill) and
:func:`render_report` (one HTML file, cells tagged ``report-skip`` left out), with the
header that states the run's limits and, once, its judge.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import nbformat
import papermill
from nbconvert import HTMLExporter
from nbconvert.preprocessors import TagRemovePreprocessor

from rlver_lib.config import EvaluationConfig, RunConfig
from rlver_lib.evaluation.judge import Judge
from rlver_lib.evaluation.stage import headline_markdown
from rlver_lib.files import PROJECT_ROOT, atomic_write_text

NOTEBOOK_DIR = Path(os.environ.get("RLVER_NOTEBOOKS", PROJECT_ROOT / "notebooks"))
REPORT_SKIP_TAG = "report-skip"
"""Cells with this tag are left out of ``report.html`` (set-up cells, long listings)."""


# --------------------------------------------------------------------------- notebooks


def execute_notebook(template: str, output: Path, parameters: dict[str, Any],
                     *, cwd: Path | None = None) -> None:
    """Execute ``notebooks/<template>`` with papermill ``parameters`` into ``output``.

    Raises :class:`papermill.PapermillExecutionError` when a cell fails; the
    partially executed notebook is kept at ``output``.
    """
    source = NOTEBOOK_DIR / template
    if not source.exists():
        raise FileNotFoundError(f"pipeline notebook {source} does not exist")
    output.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(source), str(output), parameters=parameters,
        cwd=str(cwd or Path.cwd()), progress_bar=False, log_output=False,
        kernel_name="python3",
    )


def label_title(nb: nbformat.NotebookNode) -> None:
    """Put an executed notebook's papermill parameter ``label`` into its title, the
    first ``# `` heading of its first markdown cell: ``# 04 · Evaluation: the Sentient
    benchmark`` run with ``label='trained'`` becomes ``# 04 · Evaluation (trained): the
    Sentient benchmark``, so the template's two runs in one report read apart."""
    label = nb.metadata.get("papermill", {}).get("parameters", {}).get("label")
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if not label or cell is None:
        return
    lines = cell.source.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("# "):
            title, colon, rest = line.partition(":")
            lines[i] = f"{title} ({label}){colon}{rest}"
            cell.source = "\n".join(lines)
            return


def render_report(notebooks: list[Path], html_path: Path, header_markdown: str) -> Path:
    """Assemble executed notebooks into one ``report.html`` (nbconvert, code hidden).

    Each notebook becomes a section, its title carrying its ``label`` parameter
    (:func:`label_title`: baseline and trained evaluation); cells tagged
    ``report-skip``, the parameter cells and stderr output (warnings, progress bars)
    are dropped; errors and figures stay, figures embedded as data URIs.
    Written atomically; returns ``html_path``.
    """
    report = nbformat.v4.new_notebook()
    report.cells.append(nbformat.v4.new_markdown_cell(header_markdown))
    for number, path in enumerate(notebooks):
        if not path.exists():
            continue
        nb = nbformat.read(path, as_version=4)
        label_title(nb)
        report.cells.append(nbformat.v4.new_markdown_cell(f"---\n*Section from `{path.name}`*"))
        for cell in nb.cells:  # the same template may appear twice: keep cell ids unique
            cell["id"] = f"s{number}-{cell.get('id', len(report.cells))}"
            if cell.cell_type == "code":  # warnings and progress bars are not for readers
                cell.outputs = [o for o in cell.outputs
                                if not (o.output_type == "stream" and o.get("name") == "stderr")]
            report.cells.append(cell)
        report.metadata.setdefault("kernelspec", nb.metadata.get("kernelspec", {}))
        report.metadata.setdefault("language_info", nb.metadata.get("language_info", {}))
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.register_preprocessor(
        TagRemovePreprocessor(remove_cell_tags={REPORT_SKIP_TAG, "injected-parameters",
                                                "parameters"}, enabled=True),
        enabled=True,
    )
    title = f"RLVER run report: {html_path.parent.name}"  # the page title; nbconvert's default is "Notebook"
    html, _ = exporter.from_notebook_node(report, resources={"metadata": {"name": title}})
    atomic_write_text(html_path, html)
    return html_path


def limits_statement(cfg: RunConfig, *, per_cell: bool = False) -> str:
    """Markdown naming the models that ran and, for the small embedded models or the
    rule simulator, what such a run can and cannot show.  ``per_cell``: for an ablation
    report, leave out the settings a grid varies (algorithm, steps, think mode,
    simulator difficulty), which :func:`ablation_header` lists per cell."""
    sim = cfg.simulator
    difficulty = "" if per_cell else f" ({sim.difficulty} difficulty)"
    sim_desc = ("the deterministic rule simulator (no language model)" if sim.backend == "rule"
                else f"`{sim.model}` through `{sim.backend}`{difficulty}")
    training = (f" Training: {cfg.training.algorithm.upper()}, {cfg.training.steps} step(s) of "
                f"{cfg.training.scenarios_per_step} scenario(s)." if "train" in cfg.stages and not per_cell else "")
    think = "" if per_cell else f", think mode {'on' if cfg.policy.think else 'off'}"
    lines = [f"**Models that ran{' (every cell)' if per_cell else ''}.** Policy: `{cfg.policy.model}` "
             f"({cfg.policy.backend}{think}, LoRA r={cfg.policy.lora.r}). "
             f"Simulated user: {sim_desc}.{training}"]
    limits = []
    if cfg.policy.model.startswith("embedded:"):
        limits.append("a 135M-parameter policy writes short, often generic replies (the paper "
                      "trained a 7B policy)")
    if sim.backend != "rule" and sim.model.startswith("embedded:"):
        limits.append("a small (1.5B, 4-bit) simulator gives only a coarse, noisy emotion signal "
                      "(the paper used a DeepSeek-V3-class simulator)")
    if sim.backend == "rule":
        limits.append("the rule simulator scores replies with a fixed function of the text: it "
                      "verifies plumbing and that the learner can follow a reward, nothing about "
                      "empathy")
    if limits:
        lines.append(
            "**What this run can and cannot show.** It checks that the whole loop works end to "
            "end — scenarios, multi-turn rollouts against a simulated user, emotion rewards, "
            "LoRA updates, benchmark, analysis — and its numbers are real measurements of these "
            "models. It cannot reproduce the paper's findings: " + "; ".join(limits) + "; and a "
            "few training steps on a handful of scenarios move the Sentient score by less than "
            "its confidence interval. Differences between baseline and trained policy here are "
            "not evidence about RLVER; for that, run the paper recipes on GPUs "
            "(`params/paper-*.yaml`, docs/GPU.md)."
        )
    return "\n\n".join(lines)


def run_wall_s(manifest: dict[str, Any]) -> float | None:
    """The run's wall time in seconds: the sum of its stages' recorded ``wall_s``."""
    walls = [s.get("wall_s") for s in manifest.get("stages", {}).values() if isinstance(s.get("wall_s"), (int, float))]
    return float(sum(walls)) if walls else None


def judge_statement(judge: Judge, ev: EvaluationConfig) -> str:
    """Markdown naming the benchmark's ``judge`` (:attr:`Judge.name`) and the protocol of
    ``ev`` (an ``evaluation`` section), as notebook 04 states them after its benchmark."""
    name = judge.name
    rule = ("every policy reply appraised" if ev.protocol == "full"
            else f"{ev.max_turns} policy replies, the first {ev.max_turns - 1} appraised (SAGE's turn rule)")
    return (f"**Benchmark judge.** {name[0].upper() + name[1:]}, the same for baseline and trained policy "
            f"and independent of the training simulator. Protocol `{ev.protocol}`: start emotion "
            f"{ev.initial_emotion}, {rule}, {ev.repeats} dialogue(s) per scenario.")


def report_header(cfg: RunConfig, manifest: dict[str, Any]) -> str:
    """The report's Markdown header: the title, the headline
    (:func:`rlver_lib.evaluation.stage.headline_markdown`, the one place the report names
    the judge: as it recorded itself in the benchmark's ``summary.json``), the seed,
    commit and stages, and what the run can and cannot show."""
    git = manifest.get("git", {})
    parts = [f"# RLVER run report: `{cfg.run_name}`"]
    headline = headline_markdown(cfg.run_dir.resolve(), run_wall_s(manifest))
    if headline:
        parts.append(headline)
    return "\n\n".join(parts + [
        f"Seed {cfg.seed}; git commit `{git.get('commit') or 'unknown'}`"
        f"{' (uncommitted changes)' if git.get('dirty') else ''}; "
        f"stages: {', '.join(cfg.stages)}.",
        limits_statement(cfg),
    ])

