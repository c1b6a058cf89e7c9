"""Shared test fixtures: the embedded policy, a real loopback OpenAI server, a fake GGUF
file, two fake run folders, whether a process is alive, the stand-in pipeline notebooks."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def embedded_policy():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct policy, float32, eval mode.

    Loaded once per session (converted into the cache on first use). Tests must not
    modify it; wrap it (e.g. a fresh peft model) when they need to.
    """
    from rlver_lib.config import PolicyConfig
    from rlver_lib.models import load_policy

    return load_policy(PolicyConfig(dtype="float32"))


def _process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan may wait unreaped; Linux's /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def process_alive():
    """``process_alive(pid) -> bool``: the process exists and is not a zombie."""
    return _process_alive


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def openai_server() -> str:
    """Base URL of a real OpenAI-compatible server on loopback.

    llama.cpp's ``llama-server`` (the project's native build) over the embedded
    SmolLM2 GGUF (model alias ``smollm2``), started for the session and always
    stopped afterwards.
    """
    from rlver_lib.models import smollm2_gguf_path
    from rlver_lib.servers import LlamaServerBackend

    with LlamaServerBackend(smollm2_gguf_path(), n_ctx=2048, parallel=4, threads=1, seed=0,
                            alias="smollm2") as server:
        yield f"http://127.0.0.1:{server.port}"


@pytest.fixture
def fake_gguf(tmp_path):
    """A file named like a GGUF model (``fake-model.gguf``) for the fake llama-servers of
    tests/native_support.py."""
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF")
    return path


@pytest.fixture
def runs(tmp_path):
    """Two fake run folders (tests/analysis_support.py ``make_run``): ``ppo-think`` (moderate
    simulator, trained score 70) and ``grpo-nothink`` (hard, 50)."""
    from analysis_support import make_run

    return [make_run(tmp_path, "ppo-think", "ppo", True, "moderate", 70.0),
            make_run(tmp_path, "grpo-nothink", "grpo", False, "hard", 50.0)]


@pytest.fixture
def notebooks(tmp_path, monkeypatch):
    """The stand-in templates (tests/pipeline_support.py) in ``tmp_path/templates``, where
    :func:`rlver_lib.pipeline.execution.execute_notebook` looks for them; returns the folder."""
    from pipeline_support import write_stand_ins

    folder = write_stand_ins(tmp_path / "templates")
    monkeypatch.setattr("rlver_lib.pipeline.execution.NOTEBOOK_DIR", folder)
    return folder
