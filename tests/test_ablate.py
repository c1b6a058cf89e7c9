"""``rlver ablate`` (rlver_lib.pipeline.ablate) with stand-in notebooks (tests/pipeline_support.py)."""

import json
import textwrap

import pytest

from rlver_lib.config import ConfigError
from rlver_lib.pipeline.ablate import run_ablation
from rlver_lib.pipeline.manifest import read_manifest


def scenarios_grid(tmp_path, axis: str, values: list[str]):
    """A grid file of rule-simulator cells that run the scenarios stage only, over one axis."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(textwrap.dedent(f"""
        name: g
        output_root: {tmp_path / 'out'}
        base:
          simulator: {{backend: rule}}
          stages: [scenarios]
        axes:
          {axis}: [{', '.join(values)}]
    """))
    return grid


def test_ablation_over_the_judge_is_refused_before_anything_runs(tmp_path):
    grid = scenarios_grid(tmp_path, "evaluation.judge.difficulty", ["moderate", "hard"])
    with pytest.raises(ConfigError, match=r"judged differently.*evaluation\.judge"):
        run_ablation(grid, progress=False)
    assert not (tmp_path / "out").exists()


def test_ablation_skips_finished_cells(tmp_path, notebooks):
    grid = scenarios_grid(tmp_path, "training.algorithm", ["grpo", "ppo"])
    report = run_ablation(grid, progress=False)
    grid_dir = tmp_path / "out" / "g"
    cells = ["algorithm-grpo", "algorithm-ppo"]
    assert report == grid_dir / "report.html" and report.exists()
    assert (grid_dir / "compared.txt").read_text() == "2"
    first = {c: read_manifest(grid_dir / c)["stages"]["scenarios"]["started"] for c in cells}

    # leave the second cell half-finished: its stage record says running
    manifest_path = grid_dir / cells[1] / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["status"], manifest["stages"]["scenarios"]["status"] = "running", "running"
    manifest_path.write_text(json.dumps(manifest))

    run_ablation(grid, progress=False)
    done, resumed = (read_manifest(grid_dir / c) for c in cells)
    assert done["stages"]["scenarios"]["started"] == first[cells[0]]  # finished cell not re-run
    assert len(done["runs"]) == 1 and "skipped_at" not in done["stages"]["scenarios"]
    assert len(resumed["runs"]) == 2 and resumed["status"] == "complete"
    assert resumed["stages"]["scenarios"]["started"] >= resumed["runs"][1]["started"]  # re-ran
