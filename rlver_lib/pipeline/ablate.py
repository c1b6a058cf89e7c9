"""``rlver ablate``: a grid of dotted config axes (``grids/*.yaml``), one run per cell,
all cells under one judge, and notebook 05 comparing them (RLVER §5).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm import tqdm

from rlver_lib.config import ConfigError, RunConfig
from rlver_lib.evaluation.benchmark import protocol_description
from rlver_lib.evaluation.judge import Judge, JudgeMismatchError, check_same_judge
from rlver_lib.files import AblationFolder, atomic_write_text, process_rank
from rlver_lib.params import build_config, load_params
from rlver_lib.pipeline.execution import execute_notebook
from rlver_lib.pipeline.manifest import read_manifest
from rlver_lib.pipeline.report import ablation_header, render_report
from rlver_lib.pipeline.run import PipelineError, kernel_environment, run_pipeline

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


class AblationCell(NamedTuple):
    """One grid cell: its folder name, the axis values, and the validated config (a
    tuple, as :func:`rlver_lib.pipeline.report.ablation_header` reads it)."""

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


def planned_judges(cells: list[AblationCell]) -> dict[str, dict[str, Any]]:
    """What each cell's benchmark will record before anything runs: ``{cell: {"judge":
    Judge.description, "protocol": protocol_description}}`` (no server asked), for
    :func:`check_same_judge`."""
    return {cell.name: {"judge": Judge.from_config(cell.config.evaluation, cell.config.seed).description,
                        "protocol": protocol_description(cell.config.evaluation)} for cell in cells}


def recorded_judges(folder: AblationFolder, cells: list[AblationCell]) -> dict[str, dict[str, Any]]:
    """What the cells' benchmarks recorded (``eval/<label>/summary.json`` with figures),
    keyed ``<cell>/<label>``: catches cells resumed from older runs."""
    summaries = {}
    for cell in cells:
        for path in folder.cell(cell.name).summaries():
            data = json.loads(path.read_text(encoding="utf-8") or "{}")
            if isinstance(data.get("sentient_score"), dict):
                summaries[f"{cell.name}/{path.parent.name}"] = data
    return summaries


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
    folder = AblationFolder((Path(grid.output_root) / grid.name).resolve())
    try:  # a score depends on its judge: cells judged differently cannot be compared
        check_same_judge(planned_judges(cells))
    except JudgeMismatchError as err:
        raise ConfigError(f"ablation refused: its cells would be judged differently; {err}") from None
    if process_rank() > 0:  # a non-main rank of a multi-process launch: each cell's training only
        for cell in cells:
            run_pipeline(cell.config, params_file=str(path), progress=False)
        return folder.report
    atomic_write_text(folder.grid, Path(path).read_text(encoding="utf-8"))
    for cell in tqdm(cells, desc=f"ablation {grid.name}", unit="cell", disable=not progress):
        if read_manifest(folder.cell(cell.name).root).get("status") == "complete":
            continue
        run_pipeline(cell.config, params_file=str(path), progress=progress)
    try:
        check_same_judge(recorded_judges(folder, cells))
    except JudgeMismatchError as err:
        raise PipelineError(f"ablation comparison refused: {err}") from None
    output = folder.notebooks / "05_ablations.ipynb"
    with kernel_environment(cells[0].config):
        execute_notebook("05_ablations.ipynb", output, {
            "grid_dir": str(folder.root),
            "run_dirs": [str(folder.cell(c.name).root) for c in cells],
            "axes": list(grid.axes),
        })
        return render_report([output], folder.report, ablation_header(grid.name, list(grid.axes), cells))
