"""The process a run lives in: its errors, the run folder's lock, SIGTERM as an
interrupt, and the launcher's variables (``torchrun`` / ``accelerate launch``): which
ones make a process a rank, the environment of one process outside the launch, and the
share of the run's threads each of a machine's processes gets. Standard library only,
so ``rlver`` answers a bad command line or a busy run folder before any model library
loads (docs/ARCHITECTURE.md "Code map")."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from rlver_lib.files import RunFolder


class PipelineError(RuntimeError):
    """A stage of a run failed; the message names the stage and its executed notebook."""


class RunFolderBusy(PipelineError):
    """Another process holds the run folder's lock (:func:`run_folder_lock`)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises :class:`KeyboardInterrupt`
    (:func:`sigterm_as_interrupt`)."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) or SIGTERM after its manifest was marked
    ``interrupted``; ``signal_name`` and ``exit_status`` (130 for SIGINT, 143 for
    SIGTERM: 128 + the signal's number) say which."""

    def __init__(self, message: str, signal_name: str, run_dir: Path):
        super().__init__(message)
        self.signal_name, self.run_dir = signal_name, run_dir
        self.exit_status = 128 + int(getattr(signal, signal_name))


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises :class:`Terminated` in the main thread, so a
    ``kill`` (or a scheduler's stop) unwinds like Ctrl-C: ``with`` blocks and
    ``finally`` clauses run, papermill interrupts and shuts down the stage's kernel
    (whose ``with`` blocks stop its llama-server) instead of leaving it orphaned. The
    previous handler comes back on exit. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def run_folder_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock (``run.lock``, an exclusive ``fcntl.flock``) for the
    block, with this process's pid written in it. Raises :class:`RunFolderBusy` at once,
    naming the folder and the holder's pid, when another process holds it. The lock
    ends with its process, so a killed run leaves no stale lock (the file stays)."""
    import fcntl

    path = RunFolder(run_dir).lock
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")  # not "w": that would erase the holder's pid
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunFolderBusy(f"{run_dir} is being written by another rlver run (pid {holder}); "
                            "wait for it to finish, stop it, or use another run_name") from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT",
                      # MPI launchers, which accelerate's PartialState also reads
                      "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                      "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                      "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""What ``torchrun`` / ``accelerate launch`` (and MPI launchers) set to make a process
one rank of a process group; with them, ``accelerate.PartialState()`` or
``Accelerator()`` in a process opens the launch's group and waits for every rank."""

LAUNCHER_PREFIXES = ("TORCHELASTIC_", "ACCELERATE_")
"""Prefixes of launcher variables too: ``TORCHELASTIC_*`` (torchrun's agent) and
``ACCELERATE_*`` (``accelerate launch``'s plugins: ``ACCELERATE_USE_DEEPSPEED`` makes
``PartialState()`` start DeepSpeed's process group). ``ACCELERATE_USE_CPU`` is kept."""


def without_launcher(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less the launcher's variables (:data:`LAUNCHER_VARIABLES`,
    :data:`LAUNCHER_PREFIXES`): the environment of one process outside any launch."""
    return {k: v for k, v in environ.items()
            if k not in LAUNCHER_VARIABLES and (k == "ACCELERATE_USE_CPU" or not k.startswith(LAUNCHER_PREFIXES))}


def threads_per_process(threads: int, environ: Mapping[str, str] = os.environ) -> int:
    """The CPU threads of one process when a run is given ``threads`` (the ``threads:``
    setting: the cores the whole run may use on this machine): ``threads`` divided among
    the ``LOCAL_WORLD_SIZE`` processes that a launcher started on this machine, at least 1.
    Each rank taking all ``threads`` oversubscribes the cores, and OpenMP's spin-waits then
    make a CPU step about 10x slower (docs/MEASURED.md, "Threads")."""
    return max(1, threads // max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1)))


@contextmanager
def single_process_environment() -> Iterator[None]:
    """Run the ``with`` body (and the processes it starts) as one process outside any
    launch (:func:`without_launcher`); ``os.environ`` is restored afterwards. Rank 0's
    stages other than training, and ``rlver eval``, run so: the other ranks never join
    their process group, so ``PartialState()`` (the vLLM backend, lm-eval's
    ``Accelerator()``) would block for ever under the launch's variables (docs/GPU.md
    "Multi-process runs")."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(without_launcher(saved))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
