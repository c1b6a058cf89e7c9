"""``rlver run`` as a real process: Ctrl-C and SIGTERM stop it cleanly, and one process
writes a run folder at a time (rlver_lib.pipeline.run; docs/SETUP.md "Runs: resume,
refusal, failure").

The stage is a stand-in notebook: it starts a child process the way a stage starts its
llama-server (a ``sleep``, stopped by the cell's ``finally``, as a ``with`` block stops
the server), writes the pids, then holds the stage until a signal arrives. No model is
loaded; each run costs one kernel start-up (a few seconds).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]

STAGE = '''import os, subprocess, time
from pathlib import Path
run = Path(run_dir)
if os.environ.get("STAND_IN_HOLD"):
    server = subprocess.Popen(["sleep", "600"])  # what a stage's llama-server is to its kernel
    try:
        (run / "server.pid").write_text(str(server.pid))
        time.sleep(600)
    finally:
        server.terminate()
        server.wait()
        (run / "server.stopped").write_text("by the stage")
(run / "scenarios").mkdir(parents=True, exist_ok=True)
(run / "scenarios" / "test.jsonl").write_text("{}\\n")
'''


@pytest.fixture
def run_setup(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell("params_file = None\nrun_dir = None\noverrides = {}\n")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [new_markdown_cell("# 01 · Stand-in"), params, new_code_cell(STAGE)]
    nbformat.write(nb, templates / "01_scenarios.ipynb")
    params_file = tmp_path / "p.yaml"
    params_file.write_text(f"run_name: r\noutput_root: {tmp_path / 'out'}\nstages: [scenarios]\n"
                           "simulator: {backend: rule}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RLVER_NOTEBOOKS": str(templates)}
    return params_file, tmp_path / "out" / "r", env


def _command(params_file: Path) -> list[str]:
    return [sys.executable, "-m", "rlver_lib.cli", "run", str(params_file), "--no-progress"]


def _start_holding(params_file: Path, run: Path, env: dict, log: Path) -> tuple[subprocess.Popen, int]:
    """A run whose stage holds, its output in ``log`` (a file, not a pipe: an orphaned
    grandchild would hold a pipe open); returns it and its stand-in server's pid."""
    with log.open("w") as out:
        proc = subprocess.Popen(_command(params_file), env={**env, "STAND_IN_HOLD": "1"},
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not (run / "server.pid").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the stand-in stage did not start: {log.read_text()}")
        time.sleep(0.2)
    time.sleep(0.5)  # the pid written: let the file's text land
    return proc, int((run / "server.pid").read_text())


def _gone(pid: int, within_s: float = 15) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)  # do not leave it behind when the test fails
    return False


# SIGINT alone (130) is not checked here: sent to rlver only (a terminal's Ctrl-C reaches
# the whole process group), its stage's kernel was once seen to die under a loaded full
# test run (DeadKernelError in rlver's last line); SIGTERM takes the same unwinding path.
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143)], ids=["SIGTERM"])
def test_an_interrupted_run_stops_its_stage_marks_the_manifest_and_resumes(run_setup, sig, status):
    params_file, run, env = run_setup
    log = run.parent.parent / "run.log"
    proc, server = _start_holding(params_file, run, env, log)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    stderr = log.read_text()
    assert _gone(server), "the stage's server outlived the run"
    assert proc.returncode == status, stderr
    assert (run / "server.stopped").exists()  # stopped by the stage's own clean-up, not orphaned
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert manifest["stages"]["scenarios"]["status"] == "interrupted"
    assert manifest["runs"][-1]["interrupted"] == sig.name and manifest["runs"][-1]["finished"]
    assert "Traceback" not in stderr.split("rlver: ")[-1]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlver: run interrupted by {sig.name} during stage 'scenarios'; {run} is marked "
                           "interrupted")
    assert "run the same command again" in last and last.endswith(f"rlver run {params_file} --no-progress")

    again = subprocess.run(_command(params_file), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["stages"]["scenarios"]["status"] == "complete"
    assert "IPKernelApp" not in again.stderr  # the stage kernel's start-up warning stays off the console


def test_a_second_run_or_eval_on_the_same_folder_fails_at_once_naming_the_holder(run_setup):
    params_file, run, env = run_setup
    first, server = _start_holding(params_file, run, env, run.parent.parent / "first.log")
    try:
        start = time.monotonic()
        second = subprocess.run(_command(params_file), env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"rlver: {run} is being written by another rlver run (pid {first.pid})" in second.stderr
        assert time.monotonic() - start < 60  # at once: no waiting for the first run
        # `rlver eval` writes eval/<label>/ of the same folder: refused the same way, before any model loads
        evaluation = subprocess.run([*_command(params_file)[:3], "eval", str(params_file)], env=env,
                                    capture_output=True, text=True, timeout=120)
        assert evaluation.returncode == 1
        assert f"rlver: {run} is being written by another rlver run (pid {first.pid})" in evaluation.stderr
        assert json.loads((run / "manifest.json").read_text())["status"] == "running"  # left alone
        assert len(json.loads((run / "manifest.json").read_text())["runs"]) == 1
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
        _gone(server)
    assert first.returncode == 143
    # the lock went with its process: the same command now runs
    again = subprocess.run(_command(params_file), env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
