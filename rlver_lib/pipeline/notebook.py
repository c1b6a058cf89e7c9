"""What the pipeline notebooks call: :func:`notebook_session` (config, run folder,
display settings) and small helpers that turn a stage's objects into tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd
from matplotlib.figure import Figure

from rlver_lib.config import RunConfig, ScenarioConfig
from rlver_lib.evaluation.benchmark import trajectory_table
from rlver_lib.files import PROJECT_ROOT, RunFolder, write_jsonl
from rlver_lib.params import load_config, load_run_config
from rlver_lib.plots import plot_emotion_trajectories
from rlver_lib.records import dialogue_view, entry_mood
from rlver_lib.rollout import Trajectory
from rlver_lib.scenarios import BUILTIN_FILE, RunSplit, Scenario, ScenarioIssue, load_scenarios, validate_file


def open_run(params_file: str | Path, run_dir: str | Path | None = None,
             overrides: dict[str, Any] | list[str] | None = None) -> tuple[RunConfig, Path]:
    """What a notebook's first cell calls: the config and the absolute run folder.

    ``run_dir`` (given by :func:`run_pipeline`) wins; otherwise a relative
    ``output_root`` is taken from the project root, so a notebook opened in
    JupyterLab from ``notebooks/`` writes where ``rlver run`` would. The returned
    config has ``output_root``/``run_name`` pointing at that folder, so
    ``cfg.run_dir`` is absolute. ``params_file`` may be the run folder's own
    ``config.yaml`` (what :func:`run_pipeline` passes), also one an older version wrote
    (:func:`rlver_lib.params.load_run_config`). Raises :class:`ConfigError` on a bad
    params file.
    """
    own = run_dir is not None and Path(params_file).resolve() == RunFolder(run_dir).config.resolve()
    cfg = (load_run_config if own else load_config)(params_file, overrides)
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
    ``cfg.scenarios.n_<split>_scenarios``. Raises ``ValueError`` for another ``split`` and the
    errors of :func:`rlver_lib.scenarios.load_scenarios` for a bad file."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    written = RunFolder(run_dir).scenarios(split)
    if written.is_file():
        return load_scenarios(written)
    return load_scenarios(getattr(cfg.scenarios, split))[: getattr(cfg.scenarios, f"n_{split}_scenarios")]


def benchmark_config(cfg: RunConfig, run_dir: str | Path) -> RunConfig:
    """A copy of ``cfg`` for one benchmark of this run (``cfg`` itself is left as it is):
    the run's persona-disjoint test set when the scenarios stage wrote it
    (``<run_dir>/scenarios/test.jsonl``, already cut to its count). The policy is
    ``cfg.policy``: the adapter to evaluate is ``policy.adapter``, the one key that names
    it (a pipeline stage sets it through the notebook's ``overrides``)."""
    written = RunFolder(run_dir).scenarios("test")
    scenarios = cfg.scenarios.model_copy(update={"test": str(written), "n_test_scenarios": None}) \
        if written.is_file() else cfg.scenarios
    return cfg.model_copy(update={"scenarios": scenarios})


def write_run_scenarios(run_dir: str | Path, split: RunSplit) -> Path:
    """Write ``split.train`` / ``split.test`` to ``<run_dir>/scenarios/{train,test}.jsonl``
    (our format, what :func:`run_scenarios` reads back); returns that folder."""
    folder = RunFolder(run_dir)
    for name, items in (("train", split.train), ("test", split.test)):
        write_jsonl(folder.scenarios(name), [s.to_record() for s in items])
    return folder.scenarios("test").parent


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
    ``change``, ``emotion``, ``mood`` (the mood letter) and one ``appraisal.<field>``
    column per field of the simulator's private appraisal."""
    rows = []
    for entry in trajectory.transcript:
        row = {"speaker": entry["role"], "text": entry["content"]}
        if "emotion" in entry:
            row.update(change=entry["change"], emotion=entry["emotion"], mood=entry_mood(entry),
                       **{f"appraisal.{k}": v for k, v in (entry.get("appraisal") or {}).items()})
        rows.append(row)
    return pd.DataFrame(rows)


def emotion_figure(trajectory: Trajectory, label: str) -> Figure:
    """The simulated user's emotion (points [0, 100]) after each turn of one dialogue
    (notebook 02), read from its stored record."""
    path = trajectory_table([dialogue_view(trajectory.to_record())])
    return plot_emotion_trajectories(path.assign(label=label))
