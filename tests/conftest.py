"""Shared test fixtures: reference data, the embedded policy, a real loopback OpenAI server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVER_START_DEADLINE_S = 180.0


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The reference data folder: ``$RLVER_SHARED_DATA`` or ``../shared/data`` next to the repo."""
    path = Path(os.environ.get("RLVER_SHARED_DATA") or REPO_ROOT.parent / "shared" / "data")
    if not path.is_dir():
        pytest.skip(f"reference data folder not found: {path} (set RLVER_SHARED_DATA)")
    return path


@pytest.fixture(scope="session")
def embedded_policy():
    """``(model, tokenizer)`` of the embedded SmolLM2-135M-Instruct policy, float32, eval mode.

    Loaded once per session (converted into the cache on first use). Tests must not
    modify it; wrap it (e.g. a fresh peft model) when they need to.
    """
    from rlver_lib.config import PolicyConfig
    from rlver_lib.models import load_policy

    return load_policy(PolicyConfig(dtype="float32"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(base_url: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_DEADLINE_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama_cpp.server exited with {process.returncode}:\n"
                               + log_path.read_text(errors="replace")[-2000:])
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama_cpp.server not ready after {SERVER_START_DEADLINE_S:.0f} s")


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory) -> str:
    """Base URL of a real OpenAI-compatible server on loopback.

    ``python -m llama_cpp.server`` over the embedded SmolLM2 GGUF (model alias
    ``smollm2``), started for the session and always terminated afterwards.
    """
    pytest.importorskip("llama_cpp.server.app")
    from rlver_lib.models import smollm2_gguf_path

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("llama_server") / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()),
             "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "2048", "--n_threads", "1", "--n_threads_batch", "1",
             "--seed", "0", "--verbose", "False"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(base_url, process, log_path)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
