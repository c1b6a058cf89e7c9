"""Model server processes and the llama-server engine (docs/ARCHITECTURE.md "Code map").

A server started here runs in its own process on loopback: :func:`free_port` picks its
port, :func:`die_with_parent` ties its life to the thread that started it, and a
process that ends surfaces as :class:`BackendDied` naming the signal
(:func:`exit_description`). :class:`LlamaServerBackend` serves a GGUF model through
llama.cpp's ``llama-server`` (the CPU-matched build of :mod:`rlver_lib.native`);
``VLLMServer`` in :mod:`rlver_lib.vllm_server` serves a vLLM model the same way.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from rlver_lib.backends import BackendDied, BackendError, Closing, Conversation, Generation
from rlver_lib.config import SamplingParams
from rlver_lib.files import atomic_write_json
from rlver_lib.openai_backend import OpenAIBackend

#: llama-server's n-gram speculative decoding (``speculative: ngram``): ``ngram-mod`` drafts
#: up to 16 tokens that followed the last 8 in the server's earlier outputs, and the model
#: verifies each draft in one batched step. The sizes are the fastest of the settings
#: tried for the annotator's JSON (docs/MEASURED.md, "The annotator's calls").
NGRAM_SPECULATION = ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8",
                     "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16")


def exit_description(returncode: int) -> tuple[str, str | None]:
    """How a process ended: ``("killed by SIGILL", "SIGILL")`` or ``("exited with status 1", None)``."""
    import signal as signals

    if returncode < 0:
        try:
            name = signals.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}", name
    return f"exited with status {returncode}", None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a server's ``subprocess.Popen``: on Linux the kernel sends the
    server SIGKILL when the thread that started it ends (``prctl(PR_SET_PDEATHSIG)``), so
    a server outlives neither a clean exit that skipped :meth:`close` nor a SIGKILLed
    parent (a Jupyter kernel is killed 5 s after a shutdown or restart request, before
    a slow ``atexit`` clean-up ends). ``None`` elsewhere and off the main thread, where
    a worker thread's end would take the server with it."""
    import ctypes
    import signal
    import sys
    import threading

    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


class LlamaServerBackend(Closing):
    """A GGUF model served by llama.cpp's ``llama-server``, started and stopped here.

    The server runs in its own process on loopback (``127.0.0.1``, a free port), so a
    crash inside native code (SIGILL, SIGSEGV, abort) cannot take the caller down: it
    surfaces as :class:`BackendDied` naming the signal and the model. Requests go
    through :class:`OpenAIBackend` (``/v1/chat/completions`` with ``json_schema``
    response formats and per-conversation seeds), ``parallel`` at a time: the server
    decodes them together (continuous batching over ``parallel`` slots of ``n_ctx``
    tokens each) and keeps each slot's prompt in its KV cache, so a dialogue whose
    prompt grows by appending re-reads only the new tokens.

    ``binary`` defaults to the build for this CPU (:func:`rlver_lib.native.llama_server_path`,
    raises :class:`~rlver_lib.native.NativeBuildError` when missing or built for another
    CPU). ``alias`` is the model name the server answers to (default: the file's stem).
    ``threads`` is used for decoding and prompt processing, with polling off so
    idle worker threads sleep instead of spinning. ``repack``: whether llama.cpp copies
    the weights into its interleaved layout for its batched kernels (``--repack`` /
    ``--no-repack``); ``None`` takes this machine's measured choice
    (:func:`rlver_lib.native.recorded_repack`), else llama.cpp's default (on, or
    ``$LLAMA_ARG_REPACK``).
    Start-up waits for ``/health`` at most ``startup_timeout_s`` seconds; a server that
    exits or does not answer in time raises :class:`BackendDied` with the tail of its
    log. :meth:`close` (also on ``with`` exit and at interpreter exit) stops the process.
    """

    def __init__(self, model_path: str | Path, *, n_ctx: int = 4096, parallel: int = 8,
                 threads: int | None = None, seed: int = 0, timeout_s: float = 600.0,
                 max_retries: int = 1, startup_timeout_s: float = 300.0,
                 binary: str | Path | None = None, alias: str | None = None,
                 extra_args: Sequence[str] = (), repack: bool | None = None):
        import atexit
        import subprocess
        import tempfile

        from rlver_lib import native

        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF model file not found: {path}")
        if parallel < 1 or n_ctx < 64:
            raise ValueError("need parallel >= 1 and n_ctx >= 64")
        self.model_path = path
        self.binary = Path(binary) if binary else native.llama_server_path()
        self.port = free_port()
        threads = threads or 1
        self.repack = native.recorded_repack() if repack is None else repack
        switch = () if self.repack is None else ("--repack",) if self.repack else ("--no-repack",)
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self.command = [
            str(self.binary), "--model", str(path), "--host", "127.0.0.1", "--port", str(self.port),
            "--ctx-size", str(n_ctx * parallel), "--parallel", str(parallel), "--no-kv-unified",
            "--threads", str(threads), "--threads-batch", str(threads), "--poll", "0",
            "--seed", str(seed), "--no-webui", "--jinja", "--cache-ram", "512",
            "--alias", alias or path.stem, *switch, *extra_args,
        ]
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent())
        atexit.register(self.close)
        self.client = OpenAIBackend(f"http://127.0.0.1:{self.port}", alias or path.stem, timeout_s=timeout_s,
                                    max_retries=max_retries, concurrency=parallel,
                                    response_format="json_schema")
        self._wait_ready(startup_timeout_s)

    def log_tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = Path(self._log.name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _died(self, when: str) -> BackendDied:
        how, name = exit_description(self.process.returncode)
        tail = self.log_tail()
        return BackendDied(f"llama-server for {self.model_path.name} {how} {when}"
                           + (f"; last log lines:\n{tail}" if tail else ""), signal=name)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._died("while starting")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.close()
        raise BackendDied(f"llama-server for {self.model_path.name} did not become ready within "
                          f"{timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def check_alive(self) -> None:
        """Raise :class:`BackendDied` when the server process has ended."""
        if self.process.poll() is not None:
            raise self._died("during the run")

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """Send the conversations to the server concurrently; see the class notes.

        Raises :class:`BackendDied` when the server is gone (before or during the
        call), :class:`BackendError` when requests fail after their retries.
        """
        self.check_alive()
        try:
            return self.client.generate(conversations, sampling, json_schema)
        except BackendError:
            time.sleep(0.2)  # let a crashing process finish dying before looking
            self.check_alive()
            raise

    def next_token_logprobs(self, conversations: Sequence[Conversation], top_n: int = 20) -> list[dict[str, float]]:
        """:meth:`OpenAIBackend.next_token_logprobs` on this server (llama-server reports the
        softmax of the raw logits, before its sampling chain). Raises :class:`BackendDied`
        when the server is gone, :class:`BackendError` when requests fail."""
        self.check_alive()
        try:
            return self.client.next_token_logprobs(conversations, top_n)
        except BackendError:
            time.sleep(0.2)
            self.check_alive()
            raise

    def prompt_tokens(self, conversations: Sequence[Conversation]) -> list[int]:
        """Prompt length in tokens per conversation, exactly as the server will see it:
        its chat template (``POST /apply-template``), then its tokenizer (``POST /tokenize``).
        Raises :class:`BackendError` when a request fails."""
        self.check_alive()
        client = self.client.client
        root = f"http://127.0.0.1:{self.port}"

        def count(conversation: Conversation) -> int:
            prompt = client.post(f"{root}/apply-template", json={"messages": list(conversation)})
            if prompt.status_code != 200:
                raise BackendError(f"{root}/apply-template: HTTP {prompt.status_code}: {prompt.text[:200]}")
            tokens = client.post(f"{root}/tokenize", json={"content": prompt.json()["prompt"]})
            if tokens.status_code != 200:
                raise BackendError(f"{root}/tokenize: HTTP {tokens.status_code}: {tokens.text[:200]}")
            return len(tokens.json()["tokens"])

        return self.client._each(conversations, count)

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and close the client."""
        import subprocess

        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()
        self._log.close()


# --------------------------------------------------------------------------- weight repacking

#: repacking is turned off only where prompt processing without it is at least this many
#: times as fast: one prefill's rate moves by about 10 % from request to request
#: (docs/MEASURED.md, "Weight repacking in llama-server")
REPACK_MARGIN = 1.15


def prefill_rate(model_path: str | Path, *, repack: bool, threads: int | None = None,
                 binary: str | Path | None = None, tokens: int = 256, repeats: int = 2) -> float:
    """llama-server's prompt processing speed on ``model_path``, in tokens per second:
    the fastest of ``repeats`` prefills of the same ``tokens``-token prompt (prompt cache
    off, one slot, one token generated), with the weights repacked or not (``repack``).
    The first prefill also pages in the weights that repacking did not copy; the best of
    two leaves that out. Raises :class:`BackendError` when a request fails."""
    import httpx

    with LlamaServerBackend(model_path, n_ctx=tokens + 64, parallel=1, threads=threads, binary=binary,
                            repack=repack) as server:
        body = {"prompt": list(range(1000, 1000 + tokens)), "n_predict": 1, "cache_prompt": False,
                "temperature": 0}
        rates = []
        for _ in range(repeats):
            answer = httpx.post(f"http://127.0.0.1:{server.port}/completion", json=body, timeout=600)
            if answer.status_code != 200:
                raise BackendError(f"llama-server /completion: HTTP {answer.status_code}: {answer.text[:200]}")
            rates.append(float(answer.json()["timings"]["prompt_per_second"]))
    return max(rates)


def measure_repack(model_path: str | Path, *, threads: int | None = None, root: Path | None = None,
                   tokens: int = 256, repeats: int = 2) -> dict[str, Any]:
    """Measure :func:`prefill_rate` with and without weight repacking on the installed
    ``llama-server`` (in ``root``) and record the choice for this machine.

    llama.cpp repacks Q4_K weights for its AVX2 kernels wherever the CPU has AVX2; on an
    AVX-512 Xeon that made prompt processing about a third slower (docs/MEASURED.md), so
    the choice is measured, not assumed. Repacking stays on unless turning it off is at
    least :data:`REPACK_MARGIN` times as fast. Writes
    :func:`~rlver_lib.native.repack_record_path` atomically and returns the record:
    ``repack`` (the choice), ``prefill_tokens_per_s`` (``repack`` / ``no_repack``),
    ``margin``, ``model``, ``tokens``, ``cpu``, ``cmake_args`` (the build measured) and
    ``measured`` (UTC time). Raises :class:`~rlver_lib.native.NativeBuildError` when no
    build fits this CPU, :class:`BackendError` when the server fails.
    """
    from rlver_lib import native

    binary = native.llama_server_path(root)
    rates = {name: prefill_rate(model_path, repack=on, threads=threads, binary=binary, tokens=tokens,
                                repeats=repeats)
             for name, on in (("repack", True), ("no_repack", False))}
    record = {"repack": rates["no_repack"] < REPACK_MARGIN * rates["repack"],
              "prefill_tokens_per_s": {k: round(v, 1) for k, v in rates.items()}, "margin": REPACK_MARGIN,
              "model": Path(model_path).name, "tokens": tokens, "cpu": native.cpu_model(),
              "cmake_args": (native.build_info(root) or {}).get("cmake_args"),
              "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    atomic_write_json(native.repack_record_path(root), record)
    return record
