"""``rlver run``: the stages of a run (notebooks 01-04, 06), each executed by papermill
into the run folder, resumed when the manifest says a stage is complete and its marker
file exists; under a multi-process launch rank 0 runs the notebooks and other ranks
follow the manifest (docs/ARCHITECTURE.md "Data flow"). One process writes a run
folder at a time (:func:`~rlver_lib.pipeline.process.run_folder_lock`); Ctrl-C or SIGTERM
stops a run cleanly (:func:`~rlver_lib.pipeline.process.sigterm_as_interrupt`,
:class:`~rlver_lib.pipeline.process.RunInterrupted`).
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml
from tqdm import tqdm

from rlver_lib.config import ConfigError, RunConfig
from rlver_lib.files import PROJECT_ROOT, RunFolder, atomic_write_json, atomic_write_text, process_rank
from rlver_lib.params import dump_config, saved_run_config
from rlver_lib.pipeline.execution import execute_notebook
from rlver_lib.pipeline.manifest import new_manifest, read_manifest, track_peak_memory, utc_now
from rlver_lib.pipeline.process import (
    PipelineError,
    RunInterrupted,
    Terminated,
    run_folder_lock,
    threads_per_process,
    without_launcher,
)
from rlver_lib.pipeline.report import render_report, report_header


@dataclass(frozen=True)
class Stage:
    """One pipeline step: a template notebook executed with ``params`` into ``output``.

    ``marker`` (relative to the run folder) is the file whose existence shows the
    stage's outputs are complete; ``None`` means the manifest record alone decides.
    ``distributed`` marks the one stage every rank of a launch runs (training): its
    kernel keeps the launcher's variables; any other stage runs on rank 0 alone, as
    a single process (:func:`kernel_environment`).
    """

    name: str
    notebook: str
    output: str
    marker: str | None
    params: dict[str, Any] = field(default_factory=dict)
    distributed: bool = False


def pipeline_stages(cfg: RunConfig, run_dir: Path) -> list[Stage]:
    """The stages ``cfg.stages`` selects, in pipeline order.

    ``baseline`` evaluates the policy as configured (``policy.adapter`` if set);
    ``trained`` evaluates the adapter trained in this run, or ``policy.adapter``
    when the run has no ``train`` stage: notebook 04 is given it as the override of
    ``policy.adapter``, the one key that names the adapter to evaluate.
    """
    folder = RunFolder(run_dir)
    adapter = str(folder.adapter) if "train" in cfg.stages else cfg.policy.adapter

    def marker(path: Path) -> str:
        return str(path.relative_to(folder.root))

    every = [
        Stage("scenarios", "01_scenarios.ipynb", "01_scenarios.ipynb", marker(folder.scenarios("test"))),
        Stage("baseline", "04_evaluation.ipynb", "04_evaluation_baseline.ipynb",
              marker(folder.eval_dir("baseline").summary), {"label": "baseline"}),
        Stage("train", "03_training.ipynb", "03_training.ipynb",
              marker(folder.adapter_config), distributed=True),
        Stage("trained", "04_evaluation.ipynb", "04_evaluation_trained.ipynb",
              marker(folder.eval_dir("trained").summary),
              {"label": "trained", "overrides": {"policy.adapter": adapter}}),
        Stage("analysis", "06_analysis.ipynb", "06_analysis.ipynb", None),
    ]
    return [s for s in every if s.name in cfg.stages]


@contextmanager
def kernel_environment(cfg: RunConfig, stage: Stage | None = None) -> Iterator[None]:
    """Make the kernel of ``stage`` import this ``rlver_lib`` and use ``cfg.threads``.
    Only a stage marked ``distributed`` (training) keeps the launcher's variables, and
    its kernel gets its share of the threads (:func:`threads_per_process`); any other (and
    a notebook of no stage, ``stage=None``) runs as one process outside the launch
    (:func:`without_launcher`), with all of them."""
    saved = dict(os.environ)
    if stage is None or not stage.distributed:
        os.environ.clear()
        os.environ.update(without_launcher(saved))
    paths = [str(PROJECT_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if cfg.threads:
        threads = threads_per_process(cfg.threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MPLBACKEND", "Agg")
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --------------------------------------------------------------------------- runs


def prepare_run_dir(cfg: RunConfig, params_file: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Create ``cfg.run_dir`` with ``config.yaml`` and ``manifest.json``.

    A run folder already holding a different resolved config raises
    :class:`ConfigError` (resuming must not silently change the experiment); change
    ``run_name`` or delete the folder. A ``config.yaml`` that differs only in retired
    keys (:data:`rlver_lib.params.RETIRED_KEYS`), in the keys an older version wrote but
    never used (:data:`rlver_lib.params.UNUSED_KEYS`), in keys added since at the values
    it ran with (:data:`rlver_lib.params.ADDED_KEYS`), in the old names of stages
    (:data:`~rlver_lib.config.RENAMED_STAGES`) or in the order of its keys is the same
    experiment: it is rewritten and the run resumes.
    """
    run_dir = cfg.run_dir.resolve()
    config_path = RunFolder(run_dir).config
    resolved = dump_config(cfg)
    if config_path.exists() and config_path.read_text(encoding="utf-8") != resolved:
        old = saved_run_config(yaml.safe_load(config_path.read_text(encoding="utf-8")) or {})
        new = cfg.model_dump(mode="json")
        changed = sorted(diff_keys(old, new))
        if changed:
            raise ConfigError(
                f"{run_dir} holds a run with a different config (changed: {', '.join(changed)}); "
                "use another run_name or delete the folder to start over"
            )
    atomic_write_text(config_path, resolved)
    manifest = read_manifest(run_dir) or new_manifest(cfg, params_file)
    return run_dir, manifest


def diff_keys(old: Any, new: Any, prefix: str = "") -> set[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        keys: set[str] = set()
        for k in set(old) | set(new):
            keys |= diff_keys(old.get(k), new.get(k), f"{prefix}{k}.")
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

    The run holds the folder's lock throughout (:func:`run_folder_lock`; another
    process gets :class:`RunFolderBusy`). A :class:`KeyboardInterrupt` (Ctrl-C, or
    SIGTERM under :func:`sigterm_as_interrupt`) marks the running stage and the run
    ``interrupted`` in the manifest and raises :class:`RunInterrupted`; running the
    same command again resumes: finished stages are skipped, the interrupted one runs
    again (training from its last checkpoint).
    """
    rank = process_rank()
    if rank > 0:
        return _follow_pipeline(cfg, rank)
    with run_folder_lock(cfg.run_dir.resolve()):
        return _run_stages(cfg, params_file, progress)


def _run_stages(cfg: RunConfig, params_file: str | None, progress: bool) -> Path:
    run_dir, manifest = prepare_run_dir(cfg, params_file)
    manifest_path = RunFolder(run_dir).manifest
    stages = pipeline_stages(cfg, run_dir)
    invocation = {"started": utc_now(), "finished": None,
                  "num_processes": int(os.environ.get("WORLD_SIZE", "1"))}  # processes of this launch
    manifest["runs"].append(invocation)
    manifest["status"] = "running"
    atomic_write_json(manifest_path, manifest)
    done = {stage.name for stage in stages if stage_complete(run_dir, manifest, stage)}
    for name in done:  # finished by an earlier invocation: the bar starts at their count
        manifest["stages"][name]["skipped_at"] = utc_now()
    if done and progress:
        finished = ", ".join(stage.name for stage in stages if stage.name in done)
        print(f"resuming {run_dir}: skipping the finished stage(s) {finished}", file=sys.stderr)
    bar = tqdm(total=len(stages), initial=len(done), desc=f"run {cfg.run_name}", unit="stage",
               disable=not progress)
    current = None
    try:
        for current in stages:
            if current.name in done:
                continue
            bar.set_postfix_str(current.name)
            with kernel_environment(cfg, current):
                _run_stage(cfg, run_dir, current, manifest, manifest_path)
            bar.update(1)
        current = None
        bar.close()
        folder = RunFolder(run_dir)
        report = render_report([folder.notebooks / s.output for s in stages],
                               folder.report, report_header(cfg, manifest))
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM under sigterm_as_interrupt
        bar.close()
        name = "SIGTERM" if isinstance(err, Terminated) else "SIGINT"
        invocation.update(finished=utc_now(), interrupted=name)
        manifest["status"] = "interrupted"
        atomic_write_json(manifest_path, manifest)
        where = f"during stage '{current.name}'" if current else "between stages"
        raise RunInterrupted(f"run interrupted by {name} {where}; {run_dir} is marked interrupted "
                             "in manifest.json", name, run_dir) from err
    invocation["finished"] = utc_now()
    manifest["status"] = "complete"
    manifest["report"] = report.name
    atomic_write_json(manifest_path, manifest)
    return report


FOLLOW_POLL_S = 2.0
"""How often a non-main rank re-reads the manifest while it waits for rank 0."""

FOLLOW_MANIFEST_DEADLINE_S = 600.0
"""How long a non-main rank waits for rank 0's ``manifest.json`` to appear at all. Rank 0
writes it before its first stage, so a rank that never sees it is on another node
without the run folder on a shared file system (docs/GPU.md "Several nodes")."""

_follower_sleep = time.sleep  # a test replaces it to see the waiting rank's polls


class FollowerTimeout(PipelineError):
    """A non-main rank saw no manifest within :data:`FOLLOW_MANIFEST_DEADLINE_S`."""


def _follow_pipeline(cfg: RunConfig, rank: int, *, poll_s: float | None = None,
                     manifest_deadline_s: float | None = None) -> Path:
    """A non-main rank of a multi-process launch: it runs the training stage only, the one
    stage that needs every process (its kernel inherits the launcher's environment), with
    the executed notebook under ``notebooks/rank<r>/``. Scenarios, the benchmarks
    (baseline, trained: one judge, one writer of ``eval/<label>/``) and the analysis run
    once, on rank 0, which alone writes the manifest and the report.

    The rank waits until rank 0's manifest records the ``train`` stage running (rank 0
    has then written the scenarios and run the baseline) or complete (skipped then, as
    rank 0 skips it), re-reading it every ``poll_s`` seconds (:data:`FOLLOW_POLL_S`).
    Raises :class:`FollowerTimeout` when no manifest appears within
    ``manifest_deadline_s`` (:data:`FOLLOW_MANIFEST_DEADLINE_S`): the run folder is not
    shared with rank 0. Once the manifest is there the wait has no deadline: rank 0's
    stages before training may take hours, and a launcher (``torchrun``,
    ``accelerate launch``) stops every rank when rank 0 fails.
    Returns the path of the report rank 0 writes."""
    run_dir = cfg.run_dir.resolve()
    report = RunFolder(run_dir).report
    stage = next((s for s in pipeline_stages(cfg, run_dir) if s.name == "train"), None)
    if stage is None:
        return report
    poll_s = FOLLOW_POLL_S if poll_s is None else poll_s
    limit_s = FOLLOW_MANIFEST_DEADLINE_S if manifest_deadline_s is None else manifest_deadline_s
    deadline = time.monotonic() + limit_s
    while True:
        manifest = read_manifest(run_dir)
        if stage_complete(run_dir, manifest, stage):
            return report
        if manifest.get("stages", {}).get("train", {}).get("status") == "running":
            break
        if not manifest and time.monotonic() > deadline:
            raise FollowerTimeout(
                f"rank {rank}: rank 0's {RunFolder(run_dir).manifest} did not appear within {limit_s:.0f} s; "
                "on several nodes the run folder (output_root) must be on a file system every node "
                "shares (docs/GPU.md \"Several nodes\")")
        _follower_sleep(poll_s)
    folder = RunFolder(run_dir).rank_notebooks(rank)
    config = folder / RunFolder(run_dir).config.name  # this rank's copy of config.yaml
    atomic_write_text(config, dump_config(cfg))
    with kernel_environment(cfg, stage):
        try:
            execute_notebook(stage.notebook, folder / stage.output,
                             {"params_file": str(config), "run_dir": str(run_dir),
                              **stage.params})
        except Exception as err:
            raise PipelineError(f"rank {rank}: stage '{stage.name}' failed\n{err}") from err
    return report


def _run_stage(cfg: RunConfig, run_dir: Path, stage: Stage, manifest: dict[str, Any],
               manifest_path: Path) -> None:
    output = RunFolder(run_dir).notebooks / stage.output
    record: dict[str, Any] = {"notebook": str(output.relative_to(run_dir)), "status": "running",
                              "started": utc_now(), "finished": None}
    manifest["stages"][stage.name] = record
    atomic_write_json(manifest_path, manifest)
    parameters = {"params_file": str(RunFolder(run_dir).config), "run_dir": str(run_dir),
                  **stage.params}
    start = time.perf_counter()
    error: str | None = None
    interrupted: KeyboardInterrupt | None = None
    with track_peak_memory() as memory:
        try:
            execute_notebook(stage.notebook, output, parameters)
        except Exception as err:  # papermill's execution error or a kernel failure
            error = str(err).strip()
            cause: BaseException | None = err
        except KeyboardInterrupt as err:  # papermill has shut the kernel down by now
            interrupted = err
        else:
            cause = None
            if stage.marker and not (run_dir / stage.marker).exists():
                error = f"the notebook finished but did not write {stage.marker}"
    status = "interrupted" if interrupted else "failed" if error else "complete"
    record.update(status=status, finished=utc_now(), wall_s=round(time.perf_counter() - start, 2),
                  peak_rss_mb=memory["peak_rss_mb"])
    if interrupted:
        atomic_write_json(manifest_path, manifest)  # run_pipeline marks the run itself
        raise interrupted
    if error:
        record["error"] = error[-4000:]
        manifest["status"] = "failed"
    atomic_write_json(manifest_path, manifest)
    if error:
        raise PipelineError(
            f"stage '{stage.name}' failed; partial notebook kept at {output}\n{error}"
        ) from cause


def stage_complete(run_dir: Path, manifest: dict[str, Any], stage: Stage) -> bool:
    """True when the manifest records ``stage`` complete and its marker file exists."""
    record = manifest.get("stages", {}).get(stage.name, {})
    if record.get("status") != "complete":
        return False
    return stage.marker is None or (run_dir / stage.marker).exists()
