"""The ``rlver`` command line: exit codes, error messages, delegation (docs/ARCHITECTURE.md "Code map")."""

import json
import os
import subprocess
import sys
from pathlib import Path

from reference_data import reference_file

from rlver_lib import cli

ROOT = Path(__file__).resolve().parents[1]


def rlver(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rlver_lib.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_with_unknown_key_exits_non_zero_naming_it(tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("run_name: bad\ntraining:\n  stepz: 4\n")
    result = rlver("run", str(params), "--set", f"output_root={tmp_path}")
    assert result.returncode == 2
    assert "training.stepz" in result.stderr
    assert not (tmp_path / "bad").exists()  # nothing ran


def test_run_with_unknown_override_key_names_the_override_not_the_file(tmp_path):
    result = rlver("run", str(ROOT / "params" / "quickstart.yaml"), "--set", "training.stepz=4",
                   "--set", f"output_root={tmp_path}")
    assert result.returncode == 2
    assert "--set training.stepz=4: unknown key 'stepz' in training (did you mean steps?)" in result.stderr
    assert "quickstart.yaml" not in result.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_run_with_bad_override_value_names_the_key(tmp_path):
    result = rlver("run", str(ROOT / "params" / "quickstart.yaml"), "--set", "training.steps=-1",
                   "--set", f"output_root={tmp_path}")
    assert result.returncode == 2
    assert "training.steps" in result.stderr


def test_ablate_with_bad_axis_fails_before_any_cell_runs(tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"name: g\nbase: {ROOT / 'params' / 'quickstart.yaml'}\noutput_root: {tmp_path}\n"
                    "axes:\n  training.algorithm: [grpo, reinforce]\n")
    result = rlver("ablate", str(grid))
    assert result.returncode == 2
    assert "training.algorithm" in result.stderr
    assert not (tmp_path / "g").exists()


def test_sage_score_json_matches_the_published_leaderboard():
    path = reference_file("sage_results", "gpt-4.1_result.jsonl")
    result = rlver("sage-score", str(path), "--json")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    # published figures (shared data README): score 68.2, 35 successes, 13 failures of 100
    assert (row["n"], row["success"], row["failure"]) == (100, 35, 13)
    assert round(row["sentient_score"], 1) == 68.2


def test_scenarios_validate_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "persona": "A teacher."}\n', encoding="utf-8")
    result = rlver("scenarios", "validate", str(bad))
    assert result.returncode != 0
    assert f"{bad}:1" in result.stdout + result.stderr
    assert "situation" in result.stdout + result.stderr


def test_configure_threads_prefers_the_config(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cli.configure_threads(3)
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "3"


def test_configure_threads_keeps_the_environment_without_config(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cli.configure_threads(None)
    assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "5"


def test_every_documented_command_parses():
    parser = cli.build_parser()
    for argv in (["run", "p.yaml", "--set", "a=1", "--set", "b=2"], ["ablate", "g.yaml"],
                 ["eval", "p.yaml", "--set", "policy.adapter=x"], ["sage-score", "a", "b", "--json"],
                 ["scenarios", "validate", "f.jsonl"], ["models", "prepare"], ["seeds", "a", "b", "--json", "o"]):
        assert callable(parser.parse_args(argv).func)


def test_seeds_prints_each_seed_and_the_pooled_difference_and_writes_json(tmp_path):
    for name, diffs in (("s0", [2.0, 4.0]), ("s1", [0.0, 2.0])):
        (tmp_path / name / "eval").mkdir(parents=True)
        (tmp_path / name / "eval" / "paired.json").write_text(json.dumps({
            "mean_diff": sum(diffs) / 2, "ci_low": 0.1, "ci_high": 5.0, "p_value": 0.0001,
            "p_method": "Monte Carlo, 9999 resamples", "n_positive": 2, "n_scenarios": 2,
            "baseline_score": 40.0, "trained_score": 42.0, "protocol": {},
            "scenarios": [{"scenario_id": f"en-{i}", "diff": d} for i, d in enumerate(diffs)]}))
    result = rlver("seeds", str(tmp_path / "s0"), str(tmp_path / "s1"), "--json", str(tmp_path / "o.json"))
    assert result.returncode == 0, result.stderr
    assert "pooled over 2 seeds x 2 scenarios: +2.00 [" in result.stdout
    assert "p < 1e-4" in result.stdout and "2 of 2 seeds with a CI above 0" in result.stdout
    saved = json.loads((tmp_path / "o.json").read_text())
    assert saved["pooled"]["value"] == 2.0 and [r["run"] for r in saved["per_seed"]] == ["s0", "s1"]
    missing = rlver("seeds", str(tmp_path / "s0"), str(tmp_path / "nope"))
    assert missing.returncode == 2 and "nope" in missing.stderr and "Traceback" not in missing.stderr


def test_the_command_line_loads_no_model_library_before_a_command_needs_one():
    """``rlver`` parses its command line, reads the params and answers a bad key or a busy
    run folder with the standard library, pydantic and yaml: torch, transformers and
    papermill load only in the command that runs (they took 5.6 s of every ``rlver`` call,
    a bad key's refusal included; now 0.25 s). It also keeps ``configure_threads`` ahead
    of torch, which reads ``OMP_NUM_THREADS`` when it loads."""
    probe = ("import sys, rlver_lib.cli; "
             "print(sorted(m for m in ('torch', 'transformers', 'peft', 'papermill', 'nbformat', 'pandas') "
             "if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
