"""Every params file in the repository validates against the config schema."""

from pathlib import Path

import pytest
import yaml

from rlver_lib.config import ConfigError, load_config
from rlver_lib.workbench import load_grid

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_DIR = ROOT / "params" / "accelerate"  # `accelerate launch --config_file` files, not run params
PARAM_FILES = sorted(p for p in (ROOT / "params").rglob("*.yaml") if ACCELERATE_DIR not in p.parents) \
    + sorted((ROOT / "tests").glob("params_*.yaml"))


def _is_grid(path: Path) -> bool:
    return "axes" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def test_params_files_found():
    names = {p.name for p in PARAM_FILES}
    assert {"quickstart.yaml", "ablation-grid.yaml", "params_tiny.yaml"} <= names


@pytest.mark.parametrize("path", PARAM_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_params_file_validates(path):
    if _is_grid(path):
        _, cells = load_grid(path)
        assert cells
    else:
        cfg = load_config(path)
        assert cfg.run_name


@pytest.mark.parametrize("path", sorted(ACCELERATE_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    from accelerate.commands.config.config_args import ClusterConfig

    assert ClusterConfig.from_yaml_file(str(path)).num_processes >= 1


def test_unknown_key_is_rejected_by_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((ROOT / "params" / "quickstart.yaml").read_text() + "\nevaluation:\n  max_turnz: 3\n")
    # a duplicate top-level key replaces the section; the unknown key must be named
    with pytest.raises(ConfigError, match=r"evaluation\.max_turnz"):
        load_config(bad)


def test_ablation_grid_has_the_paper_axes():
    grid, cells = load_grid(ROOT / "params" / "ablation-grid.yaml")
    assert len(cells) == 2 * 2 * 2
    combos = {(c.config.training.algorithm, c.config.policy.think, c.config.simulator.difficulty) for c in cells}
    assert combos == {(a, t, d) for a in ("grpo", "ppo") for t in (False, True) for d in ("moderate", "hard")}
    assert len({c.config.run_name for c in cells}) == len(cells)
    assert all(Path(c.config.output_root).name == grid.name for c in cells)


def test_quickstart_stays_within_its_simulator_budget():
    """The quickstart's 15-minute budget is counted in simulator turns (each one an
    appraise and a reply call of the 1.5B model on CPU, tens of seconds on 2 cores):
    keep it at most 12."""
    cfg = load_config(ROOT / "params" / "quickstart.yaml")
    assert cfg.policy.model.startswith("embedded:") and cfg.simulator.model.startswith("embedded:")
    eval_turns = 2 * cfg.scenarios.limit_test * cfg.evaluation.max_turns  # baseline + trained
    train_turns = (cfg.training.steps * cfg.training.scenarios_per_step * cfg.training.group_size
                   * cfg.rollout.max_turns)
    assert eval_turns + train_turns <= 12
    assert cfg.stages == ["scenarios", "baseline", "train", "evaluate", "analysis"]
