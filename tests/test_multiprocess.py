"""Two real processes: ``ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2`` (accelerate's
MULTI_CPU over gloo) training PPO and GRPO on the embedded policy with the rule simulator,
and the pipeline of ``rlver run`` on both ranks. Every launch runs under a timeout, so a
hang fails the test.

- **Same as one process.** Each step-1 metric that depends on the update (losses,
  gradient norm, explained variance) equals a one-process run of the same dialogues
  (per-conversation seeds, ``tests/mp_train.py``), and so do PPO's explained variance
  after the update and GRPO's trained adapter (not only both ranks' replicas, which DDP
  keeps equal by construction): losses are normalised by the token
  count of the whole optimizer step over both processes, advantages whitened over both;
  in the PPO run one process's simulated user fails all its dialogues, so it trains on
  nothing and takes part with zero-weight work.
- **Global sizes.** The batch settings are global dialogues: 4 dialogues a step in
  mini-batches of 2 make 2 optimizer steps of 2 samples on two processes, as on one; a
  size that does not divide over the processes is refused.
- **Distinct streams.** Two processes rolling out the same conversation sample
  different replies (each process draws its own seed).
- **The collective timeout** of the process group is ``distributed.timeout_s``.
- **Rank-aware pipeline.** ``rlver run`` on two ranks (stand-in notebooks that call a
  loopback "judge" and create their files exclusively): rank 1 runs training only, after
  rank 0's baseline; the judge is called once per benchmark; every file has one writer.

Plain ``torchrun`` (every process would train alone) is refused. Measured on a shared
2-core machine: 68 s for the training launch (five runs) and its three one-process
references, 13 s for the pipeline, 10 s for the refusal.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from rlver_lib.files import iter_jsonl

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "mp_train.py"
LAUNCH_TIMEOUT_S = 900
TIMEOUT_S = 4321.0  # distributed.timeout_s of every run: the process group must get it
COMPARED = ("dialogues", "samples", "reward_mean", "policy_loss", "grad_norm", "entropy", "approx_kl_old",
            "optimizer_steps", "samples_per_update")
# explained_variance is 0 at step 1 by construction (the value head starts at 0);
# explained_variance_after (the same samples after the update) is not
PPO_COMPARED = ("value_loss", "explained_variance", "explained_variance_after")


def _config(tmp_path: Path, name: str, algorithm: str, scenarios_per_step: int, *, steps: int = 1,
            group_size: int = 1, mini_batch_size: int = 2, max_new_tokens: int = 3,
            grad_accum_steps: int = 1) -> dict:
    return {
        "run_name": name, "output_root": str(tmp_path), "seed": 7, "stages": ["train"],
        "policy": {"dtype": "float32", "max_new_tokens": max_new_tokens, "lora": {"r": 2, "alpha": 4}},
        "simulator": {"backend": "rule", "initial_emotion": 50},
        "rollout": {"max_turns": 1},
        "training": {"algorithm": algorithm, "steps": steps, "scenarios_per_step": scenarios_per_step,
                     "group_size": group_size, "mini_batch_size": mini_batch_size, "grad_accum_steps": grad_accum_steps,
                     "learning_rate": 1e-3, "ppo": {"value_learning_rate": 1e-3}, "checkpoint_every": 1,
                     "keep_checkpoints": 1},
        "distributed": {"timeout_s": TIMEOUT_S},
    }


def kill_launch(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it: torchrun starts each worker in a
    session of its own, so killing the launcher's process group would leave the workers
    running (and holding its output pipe open)."""
    import psutil

    try:
        launcher = psutil.Process(process.pid)
        victims = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass


def wait_for_launch(process: subprocess.Popen) -> str:
    """Wait for a launch (at most :data:`LAUNCH_TIMEOUT_S`); its output. On a hang the
    launcher and its workers are killed (:func:`kill_launch`) and the test fails."""
    try:
        output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_launch(process)
        output, _ = process.communicate()
        pytest.fail(f"launch did not finish within {LAUNCH_TIMEOUT_S} s (hang?):\n{output[-3000:]}")
    return output


def _launch(tmp_path: Path, runs: list[dict], *, cpu: bool = True,
            env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """torchrun with 2 processes over ``runs``; the launcher and its workers are killed on timeout."""
    spec = tmp_path / f"runs-{len(list(tmp_path.glob('runs-*.json')))}.json"
    spec.write_text(json.dumps(runs), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           **(env_extra or {})}
    env.pop("ACCELERATE_USE_CPU", None)
    if cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(DRIVER), str(spec)]
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    output = wait_for_launch(process)
    return subprocess.CompletedProcess(command, process.returncode, output, ""), time.perf_counter() - start


def _rows(run_dir: Path) -> list[dict]:
    return [row for _, row in iter_jsonl(run_dir / "train" / "metrics.jsonl")]


def _ranks(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / "train" / f"rank{r}.json").read_text()) for r in (0, 1)]


def _adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "train" / "adapter" / "adapter_model.safetensors"))


def _lora_b_diff(run: dict, reference: dict):
    """``(run - reference, reference)`` over every ``lora_B`` weight, flattened (float64)."""
    import torch

    keys = sorted(k for k in reference if "lora_B" in k)
    assert keys and run.keys() == reference.keys()
    ref = torch.cat([reference[k].double().flatten() for k in keys])
    return torch.cat([run[k].double().flatten() for k in keys]) - ref, ref


def _lora_b_gap(run: dict, reference: dict) -> float:
    """``||B - B_ref|| / ||B_ref||`` over every ``lora_B`` weight (they start at 0: this is
    the gap relative to what training moved)."""
    diff, ref = _lora_b_diff(run, reference)
    return float(diff.norm() / ref.norm())


def _lora_b_moved_apart(run: dict, reference: dict, learning_rate: float) -> float:
    """The share of ``lora_B`` weights that differ from the reference's by more than a
    tenth of ``learning_rate``. After AdamW's first step every weight with a gradient
    moves by about ``±learning_rate`` (m / sqrt(v) = sign(g)), so float noise in the
    gradient changes only the few weights whose gradient is about 0, while an update
    from another gradient (one process's share alone, other dialogues) moves about half
    of them differently."""
    diff, _ = _lora_b_diff(run, reference)
    return float((diff.abs() > learning_rate / 10).double().mean())


def _mismatched(two: dict, one: dict, keys) -> dict:
    out = {}
    for k in keys:
        a, b = two[k], one[k]
        if not (isinstance(a, (int, float)) and math.isfinite(a) and math.isfinite(b)):
            out[k] = (a, b)  # every compared metric is defined here: NaN is a failure, not a match
        elif a != pytest.approx(b, rel=2e-3, abs=1e-5):  # GRPO losses at ratio 1 are ~0: float noise
            out[k] = (a, b)
    return out


@pytest.mark.slow
def test_two_processes_train_like_one_with_global_sizes_and_their_own_streams(tmp_path):
    from mp_train import train

    runs = [
        # GRPO: 2 scenarios x 2 rollouts, one optimizer step of all 4 dialogues, accumulated
        # over 2 micro-batches of 1 dialogue on each process
        {"config": _config(tmp_path, "grpo", "grpo", 2, group_size=2, mini_batch_size=4, grad_accum_steps=2),
         "scenarios": 3},
        # PPO, two steps of one optimizer step; process 1's simulated user fails every dialogue:
        # it trains on nothing
        {"config": _config(tmp_path, "ppo", "ppo", 4, steps=2, mini_batch_size=4), "scenarios": 4,
         "error_on_rank": 1},
        # global sizes: 4 dialogues a step, mini-batches of 2 -> 2 optimizer steps of 2 samples
        {"config": _config(tmp_path, "sizes", "ppo", 4), "scenarios": 4},
        # the same conversation on both processes, the trainer's own backend and seeds
        {"config": _config(tmp_path, "streams", "ppo", 2, max_new_tokens=8), "scenarios": 2,
         "identical": True, "one_by_one": False},
        # sizes that do not divide over 2 processes are refused
        {"config": _config(tmp_path, "odd", "ppo", 1, mini_batch_size=1), "scenarios": 2, "expect_error": True},
    ]
    done, wall = _launch(tmp_path, runs)
    print(f"two-process launch of {len(runs)} runs took {wall:.0f} s")
    assert done.returncode == 0, done.stdout[-4000:]

    for name in ("grpo", "ppo", "sizes", "streams"):
        run_dir = tmp_path / name
        ranks = _ranks(run_dir)
        assert [(r["process_index"], r["num_processes"]) for r in ranks] == [(0, 2), (1, 2)]
        assert all(r["distributed_type"].endswith("MULTI_CPU") for r in ranks)
        assert all(r["timeout_s"] == TIMEOUT_S for r in ranks)  # distributed.timeout_s reached the group
        rows = _rows(run_dir)
        assert [r["step"] for r in rows] == ranks[0]["steps"] and all(r["num_processes"] == 2 for r in rows)
        # the updates that happened (AdamW.step calls, counted on each process) are the logged ones
        assert [r["adamw_steps"] for r in ranks] == [sum(r["optimizer_steps"] for r in rows)] * 2
        checkpoint = sorted((run_dir / "train" / "checkpoints").iterdir())[-1]
        assert {"random_states_0.pkl", "random_states_1.pkl", "optimizer.bin"} <= {p.name for p in checkpoint.iterdir()}

    # the same dialogues on one process: the same update
    for name, algorithm_keys in (("grpo", COMPARED), ("ppo", COMPARED + PPO_COMPARED)):
        spec = next(r for r in runs if r["config"]["run_name"] == name)
        two = _rows(tmp_path / name)[0]
        step_1 = [d for _, d in iter_jsonl(tmp_path / name / "train" / "dialogues" / "step_000001.jsonl")]
        failed = sorted(d["scenario_id"] for d in step_1 if d["termination"] == "error")
        assert two["samples"] > 0 and two["grad_norm"] > 0, two
        if name == "grpo":
            assert (two["dialogues"], two["samples"], two["zero_variance_group_share"]) == (4, 4, 0.0)
        else:  # process 1's dialogues failed: process 0's alone are trained
            assert (two["dialogues"], two["error_dialogues"], two["samples"]) == (4, 2, 2) and len(failed) == 2
        reference = dict(spec["config"], run_name=f"{name}-one")
        reference["training"] = dict(reference["training"], steps=1)
        (one,) = train({**spec, "config": reference, "error_on_rank": None, "failing_scenarios": failed})
        mismatched = _mismatched(two, one, algorithm_keys)
        assert not mismatched, mismatched
        if name == "grpo":  # one optimizer step: the trained adapter is the one process's, not only the
            # same on both ranks (which DDP's replicas are by construction). Measured: 21 of 92,160
            # weights off by more than lr / 10 (2.3e-4; AdamW's sign-like first step on gradients
            # of about 0); the sizes run's other windows, i.e. another gradient: 0.49
            apart = _lora_b_moved_apart(_adapter(tmp_path / name), _adapter(tmp_path / reference["run_name"]),
                                        reference["training"]["learning_rate"])
            assert apart < 2e-3, apart

    # global sizes: the optimizer steps and samples per update of one process
    two = _rows(tmp_path / "sizes")[0]
    (one,) = train({**runs[2], "config": dict(runs[2]["config"], run_name="sizes-one")})
    for row in (two, one):
        assert (row["dialogues"], row["optimizer_steps"], row["samples_per_update"],
                row["dialogues_per_update"]) == (4, 2, 2.0, 2.0), row
    # (their adapters differ: two processes deal a step's dialogues into the windows in another
    # order than one process, so each optimizer step sees other dialogues)

    # distinct streams: one conversation, two processes, two different replies
    replies = _ranks(tmp_path / "streams")[0]["replies"]
    assert sorted(replies) == ["s0#0", "s1#0"]
    assert replies["s0#0"] != replies["s1#0"], replies

    (refused,) = {json.dumps(r) for r in _ranks(tmp_path / "odd")}  # both processes refuse alike
    error = json.loads(refused)["error"]
    assert "scenarios_per_step=1 does not divide over 2 processes" in error
    assert "mini_batch_size=1 (dialogues per optimizer step, over all processes) does not divide over 2" in error


# ---------------------------------------------------------------- the pipeline on two ranks

_JUDGE = """import os, json, urllib.request
from pathlib import Path
run = Path(run_dir)
request = urllib.request.Request(os.environ['JUDGE_URL'], data=json.dumps(
    {'rank': os.environ.get('RANK'), 'world': os.environ.get('WORLD_SIZE'), 'label': label}).encode(),
    method='POST')
urllib.request.urlopen(request, timeout=30).read()
(run / 'eval' / label).mkdir(parents=True, exist_ok=True)
with open(run / 'eval' / label / 'summary.json', 'x') as f:  # a second writer fails here
    f.write('{}')
"""
_TRAIN = """import os, json, time
from pathlib import Path
run = Path(run_dir)
rank = os.environ['RANK']
(run / 'train').mkdir(parents=True, exist_ok=True)
with open(run / 'train' / f'started_rank{rank}.json', 'x') as f:
    json.dump({'baseline_done': (run / 'eval' / 'baseline' / 'summary.json').exists(), 'at': time.time()}, f)
if rank == '0':  # real training waits in its collectives for every rank; so does this stand-in
    deadline = time.time() + 120
    while not (run / 'train' / 'started_rank1.json').exists():
        assert time.time() < deadline, 'rank 1 never started training'
        time.sleep(0.2)
    (run / 'train' / 'adapter').mkdir(parents=True, exist_ok=True)
    with open(run / 'train' / 'adapter' / 'adapter_config.json', 'x') as f:
        f.write('{}')
"""
_ANALYSIS = """import os
from pathlib import Path
with open(Path(run_dir) / 'analysis.txt', 'x') as f:
    f.write(str(os.environ.get('RANK')))
"""


def _notebooks(folder: Path) -> Path:
    folder.mkdir()
    params = "params_file = None\nrun_dir = None\noverrides = {}\nlabel = 'baseline'\nadapter = None\n"
    for name, body in (("04_evaluation.ipynb", _JUDGE), ("03_training.ipynb", _TRAIN),
                       ("06_analysis.ipynb", _ANALYSIS)):
        nb = new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        cell = new_code_cell(params)
        cell.metadata["tags"] = ["parameters"]
        nb.cells = [cell, new_code_cell(body)]
        nbformat.write(nb, folder / name)
    return folder


class _Judge(BaseHTTPRequestHandler):
    calls: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Judge.calls.append(json.loads(body))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_pipeline_on_two_ranks_benchmarks_once_and_trains_on_both(tmp_path):
    _Judge.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = {"run_name": "pipe", "output_root": str(tmp_path), "simulator": {"backend": "rule"},
              "stages": ["baseline", "train", "trained", "analysis"]}
    try:
        done, wall = _launch(tmp_path, [{"pipeline": config}], env_extra={
            "RLVER_NOTEBOOKS": str(_notebooks(tmp_path / "templates")),
            "JUDGE_URL": f"http://127.0.0.1:{server.server_address[1]}/judge"})
    finally:
        server.shutdown()
    print(f"two-rank pipeline took {wall:.0f} s")
    assert done.returncode == 0, done.stdout[-4000:]
    run = tmp_path / "pipe"
    # the judge: one call per benchmark, from rank 0 running as one process outside the launch
    # (no RANK / WORLD_SIZE in its kernel: tests/test_stage_environment.py)
    assert sorted((c["rank"], c["world"], c["label"]) for c in _Judge.calls) == [
        (None, None, "baseline"), (None, None, "trained")]
    # training on both ranks; rank 1 started once rank 0 had finished the baseline
    started = {r: json.loads((run / "train" / f"started_rank{r}.json").read_text()) for r in ("0", "1")}
    assert started["0"]["baseline_done"] and started["1"]["baseline_done"]
    assert (run / "analysis.txt").read_text() == "None"
    # rank 1 executed the training notebook only; rank 0 wrote the manifest and the report
    assert sorted(p.name for p in (run / "notebooks" / "rank1").iterdir()) == ["03_training.ipynb", "config.yaml"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["runs"][0]["num_processes"] == 2
    assert all(manifest["stages"][s]["status"] == "complete" for s in config["stages"])
    assert (run / "report.html").is_file()


@pytest.mark.slow
def test_plain_torchrun_where_every_process_would_train_alone_is_refused(tmp_path):
    done, wall = _launch(tmp_path, [{"config": _config(tmp_path, "alone", "grpo", 2, group_size=2),
                                     "scenarios": 2}], cpu=False)
    assert done.returncode != 0
    assert "WORLD_SIZE=2 in the environment, but accelerate runs this process alone" in done.stdout
    assert "ACCELERATE_USE_CPU=true torchrun" in done.stdout
    assert not (tmp_path / "alone" / "train" / "metrics.jsonl").exists()
