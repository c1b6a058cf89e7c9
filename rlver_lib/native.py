"""The native inference build: llama.cpp's ``llama-server``, compiled for the CPU it runs on.

The embedded simulated user runs in a ``llama-server`` process
(:class:`rlver_lib.servers.LlamaServerBackend`). The binary is compiled from the
llama.cpp sources vendored in the pinned ``llama-cpp-python`` source distribution, with
each x86-64 instruction set turned on exactly when the CPU reports it
(:func:`cmake_args`), never ``-march=native``, and AMX always off (its kernels die with
SIGILL on virtual machines). The build's stamp (:func:`build_info`) records the
features it was made for; :func:`llama_server_path` refuses a binary built for others.
Why and how: docs/SETUP.md ("The native build").

A finished build is also kept in the user's model cache, under a folder named by the
hash of its stamp (:func:`shared_build_dir`), so another checkout or virtual
environment on a machine whose CPU gets the same options copies it instead of
compiling again (7 minutes on 2 cores); a CPU that gets other options builds its own.
The compiler's output goes to a log beside that folder (:func:`build_log`); the console
gets one line per phase with its time (and a line a minute with the percentage while a
phase runs), and on failure the log's tail and its path.

``python -m rlver_lib.native build`` builds it (what ``make setup`` runs);
``python -m rlver_lib.native cmake-args`` prints the flags for this CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from rlver_lib.files import atomic_directory, cache_dir

LLAMA_CPP_SOURCE = "llama-cpp-python==0.3.36"
#: The source distribution's file on PyPI and its sha256 (PyPI's simple index lists
#: both). Fetched directly: ``pip download`` of an sdist first installs its build
#: backend to read its metadata (about 70 s of a cold set-up, for nothing).
LLAMA_CPP_SDIST_URL = ("https://files.pythonhosted.org/packages/ec/e9/"
                       "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
                       "llama_cpp_python-0.3.36.tar.gz")
LLAMA_CPP_SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
BINARY = "llama-server"
#: Lines of the build log shown when a phase fails (the rest stays in the log).
LOG_TAIL_LINES = 40

# (cmake option, the /proc/cpuinfo flags that must all be present)
X86_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's AVX512 switch compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
#: Optimisation levels by CMake project, read at the end of each ``project()`` call
#: (``CMAKE_PROJECT_INCLUDE``): ggml, whose kernels do the model's arithmetic, keeps -O3;
#: the rest (the llama library, common, the server, its HTTP and multimodal code) gets
#: -O1, which compiles the build 21 % faster on a 2-core AVX2 EPYC with the same
#: prefill and grammar-constrained decoding speed, and is compiled as a unity build
#: (``CMAKE_UNITY_BUILD``: 16 sources a compiler call, so each header is parsed once a
#: batch, not once a file), which cuts the compile by a further quarter
#: (docs/MEASURED.md, "The native build"). Three sources do not compile inside a batch
#: and stay on their own: common's ``json.cpp`` (it specialises templates that a
#: neighbour instantiates) and mtmd's two public helpers (they refuse mtmd's internal
#: headers). Their directories are known only once the tree is read, so the exceptions
#: are set by a deferred call (CMake 3.19; older CMake builds without unity).
OPTIMISATION = """if(PROJECT_NAME STREQUAL "ggml")
  set(CMAKE_C_FLAGS_RELEASE "-O3 -DNDEBUG")
  set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")
  set(CMAKE_UNITY_BUILD OFF)
else()
  set(CMAKE_C_FLAGS_RELEASE "-O1 -DNDEBUG")
  set(CMAKE_CXX_FLAGS_RELEASE "-O1 -DNDEBUG")
  if(PROJECT_NAME STREQUAL "llama.cpp" AND CMAKE_VERSION VERSION_GREATER_EQUAL 3.19)
    set(CMAKE_UNITY_BUILD ON)
    set(CMAKE_UNITY_BUILD_BATCH_SIZE 16)
    function(rlver_alone target)
      if(TARGET ${target})
        set_source_files_properties(${ARGN} TARGET_DIRECTORY ${target}
                                    PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
      endif()
    endfunction()
    function(rlver_unity_exceptions)
      rlver_alone(llama-common ${CMAKE_SOURCE_DIR}/common/json.cpp)
      rlver_alone(mtmd ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp
                  ${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp)
    endfunction()
    cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL rlver_unity_exceptions)
  endif()
endif()
"""
_COMMON = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_OPENMP=OFF",
)


# the AMX instructions (Intel SDM, "AMX"): tile configuration, loads/stores and dot products
AMX_MNEMONICS = ("ldtilecfg", "sttilecfg", "tilerelease", "tilezero", "tileloadd", "tileloaddt1",
                 "tilestored", "tdpbssd", "tdpbsud", "tdpbusd", "tdpbuud", "tdpbf16ps", "tdpfp16ps")
_AMX_LINE = re.compile(r"\t(?:" + "|".join(AMX_MNEMONICS) + r")(?:\s|$)")


class NativeBuildError(RuntimeError):
    """The native build is missing, failed, or was made for another CPU."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the ``flags`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``).

    Empty on systems without ``/proc/cpuinfo`` (then :func:`cmake_args` builds natively).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cmake_args(flags: frozenset[str] | set[str], machine: str | None = None) -> list[str]:
    """CMake arguments for a llama.cpp build that fits a CPU with ``flags``.

    On x86-64 (``machine`` ``x86_64``/``AMD64``, default: this machine): native
    tuning off, each instruction-set option on exactly when all its flags are
    present, AMX always off. Elsewhere (e.g. ``aarch64``, where the AMX problem does
    not exist) llama.cpp's own native detection is kept.
    """
    machine = (machine or platform.machine()).lower()
    args = list(_COMMON)
    if machine not in ("x86_64", "amd64"):
        return args + ["-DGGML_NATIVE=ON"]
    args.append("-DGGML_NATIVE=OFF")
    for option, needed in X86_OPTIONS:
        args.append(f"-D{option}={'ON' if set(needed) <= set(flags) else 'OFF'}")
    args += [f"-D{option}=OFF" for option in AMX_OPTIONS]
    return args


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def enabled_options(args: list[str]) -> list[str]:
    """The ``GGML_*`` instruction-set options turned on in ``args`` (for reports)."""
    known = {option for option, _ in X86_OPTIONS}
    return [a[2:].split("=")[0] for a in args if a.endswith("=ON") and a[2:].split("=")[0] in known]


def _fingerprint(args: list[str]) -> dict:
    return {"source": LLAMA_CPP_SOURCE, "machine": platform.machine(),
            "options": enabled_options(args), "cmake_args": args,
            "optimisation_sha256": hashlib.sha256(OPTIMISATION.encode()).hexdigest()}


def install_dir() -> Path:
    """Where the build lives: ``$RLVER_NATIVE_DIR``, else ``<sys.prefix>/llama.cpp``
    (inside the virtual environment, so a new environment builds anew)."""
    return Path(os.environ.get("RLVER_NATIVE_DIR") or Path(sys.prefix) / "llama.cpp")


def shared_build_dir(args: list[str]) -> Path:
    """The machine-wide copy of the build made with CMake ``args``:
    ``<model cache>/llama-server/<first 16 hex digits of the stamp's sha256>``
    (the model cache is ``$RLVER_CACHE``, else ``~/.cache/rlver``)."""
    digest = hashlib.sha256(json.dumps(_fingerprint(args), sort_keys=True).encode()).hexdigest()
    return cache_dir() / BINARY / digest[:16]


def build_info(root: Path | None = None) -> dict | None:
    """The stamp of the installed build (source, machine, enabled options), or ``None``."""
    stamp = (root or install_dir()) / "build.json"
    try:
        return json.loads(stamp.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def llama_server_path(root: Path | None = None) -> Path:
    """The ``llama-server`` binary built for this CPU.

    Raises :class:`NativeBuildError` when it is missing or was built for another
    feature set (the message says how to rebuild: ``make native``).
    """
    root = root or install_dir()
    binary = root / "bin" / BINARY
    info = build_info(root)
    if not binary.is_file() or info is None:
        raise NativeBuildError(f"{BINARY} is not built in {root}; run `make native` "
                               "(or `python -m rlver_lib.native build`)")
    wanted = _fingerprint(cmake_args(cpu_flags()))
    if info.get("cmake_args") != wanted["cmake_args"]:
        raise NativeBuildError(
            f"{binary} was built for CPU options {info.get('options')} but this CPU needs "
            f"{wanted['options']}; rebuild it with `make native`")
    return binary


#: where ``rlver doctor`` records whether llama-server's weight repacking pays on this
#: machine (:func:`rlver_lib.servers.measure_repack`), in the build's folder (:func:`install_dir`)
REPACK_RECORD = "repack.json"


def repack_record_path(root: Path | None = None) -> Path:
    """:data:`REPACK_RECORD` in the native build's folder ``root`` (default: the installed one)."""
    return (root or install_dir()) / REPACK_RECORD


def repack_record(root: Path | None = None) -> dict[str, Any] | None:
    """The record :func:`rlver_lib.servers.measure_repack` wrote for this CPU and this
    build of ``llama-server`` (in ``root``), or ``None``: nothing measured, an unreadable
    file, or a record made on another CPU model or for another build."""
    try:
        record = json.loads(repack_record_path(root).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    build = build_info(root) or {}
    if not isinstance(record, dict) or record.get("cpu") != cpu_model() \
            or record.get("cmake_args") != build.get("cmake_args") or "repack" not in record:
        return None
    return record


def recorded_repack(root: Path | None = None) -> bool | None:
    """This machine's measured choice of weight repacking (:func:`repack_record`), or
    ``None`` (llama.cpp's default) when nothing valid is recorded or ``$LLAMA_ARG_REPACK``
    is set: llama-server reads that variable itself, and the user's setting wins."""
    if "LLAMA_ARG_REPACK" in os.environ:
        return None
    record = repack_record(root)
    return None if record is None else bool(record["repack"])


def amx_instruction_count(binary: Path) -> int | None:
    """How many AMX instructions the machine code of ``binary`` (an executable, object or
    static library) holds, read with binutils' ``objdump -d``; ``None`` when ``objdump``
    is not installed. A build made by :func:`build` has 0: the kernels that die with
    SIGILL on virtual machines reporting AMX are not compiled in. Raises
    :class:`subprocess.CalledProcessError` when ``objdump`` cannot read the file.
    """
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    with tempfile.TemporaryFile("w+") as errors, \
            subprocess.Popen([objdump, "-d", "--no-show-raw-insn", str(binary)], stdout=subprocess.PIPE,
                             stderr=errors, text=True) as proc:  # stderr to a file: a full pipe would block
        count = sum(1 for line in proc.stdout if _AMX_LINE.search(line))
        proc.wait()
        errors.seek(0)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=errors.read())
    return count


def build_log(args: list[str]) -> Path:
    """The log of the build made with CMake ``args``: ``<shared_build_dir>.log``, beside
    the machine-wide copy (:func:`shared_build_dir`); rewritten by each compilation."""
    shared = shared_build_dir(args)
    return shared.with_name(shared.name + ".log")


def _say(message: str) -> None:
    print(f"[rlver] {message}", file=sys.stderr, flush=True)


def _log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


PROGRESS_EVERY_S = 60.0
"""While a phase runs, a console line this often with the build's percentage (the last
``[ NN%]`` the Makefiles printed to the log), so a compile of minutes is not silent."""


def _progress(log: Path) -> int | None:
    """The last build percentage in the log's last 8 KiB: Makefiles' ``[ 57%] Building
    CXX object ...`` or Ninja's ``[60/105] Building CXX object ...`` (60 of 105 steps,
    57 %); ``None`` when there is none yet."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 8192))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    found = re.findall(r"^\[\s*(?:(\d{1,3})%|(\d+)/(\d+))\]", tail, flags=re.MULTILINE)
    if not found:
        return None
    percent, done, steps = found[-1]
    return int(percent) if percent else 100 * int(done) // max(int(steps), 1)


def generator() -> list[str]:
    """CMake's generator arguments: Ninja where ``ninja`` is on ``PATH``, else CMake's
    default (Makefiles). Ninja compiles a target's sources while the libraries it links
    are still being built; Makefiles wait for them, so the end of the build (llama's
    ``common``, then the server's two libraries) ran on one core: on a 2-core Xeon the
    compile took 197 s with Ninja against 235 s with Makefiles, the same 390 CPU-s
    (docs/MEASURED.md, "The native build"). The generator is not part of the stamp: both
    make the same binary."""
    return ["-G", "Ninja"] if shutil.which("ninja") else []


def _phase(name: str, command: list[str], log: Path) -> None:
    """Run one build phase with its output appended to ``log``; print one line with its
    time, and every :data:`PROGRESS_EVERY_S` while it runs a line with the build's
    percentage. Raises :class:`NativeBuildError` (after printing the log's last
    :data:`LOG_TAIL_LINES` lines and its path) when the command fails or is missing."""
    start = time.monotonic()
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        try:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        except OSError as err:
            raise NativeBuildError(f"{BINARY} {name}: cannot run {command[0]}: {err}") from None
        with process:  # Ctrl-C (or any error) kills the phase's command on the way out
            while True:
                try:
                    returncode = process.wait(timeout=PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    percent = _progress(log)
                    if percent is not None:
                        _say(f"{BINARY} {name}: {percent}% after {time.monotonic() - start:.0f} s")
                except BaseException:
                    process.kill()
                    raise
    took = time.monotonic() - start
    if returncode:
        _say(f"{BINARY} {name} FAILED after {took:.0f} s (exit status {returncode}); "
             f"the last lines of {log}:\n{_log_tail(log)}")
        raise NativeBuildError(f"{BINARY} {name} failed (exit status {returncode}); full log: {log}")
    _say(f"{BINARY} {name}: {took:.0f} s")


def _download(url: str, sha256: str, dest: Path) -> None:
    """Stream ``url`` to ``dest``; raises :class:`NativeBuildError` on a network error or a
    file whose sha256 is not ``sha256`` (and then leaves no file)."""
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=180) as response, dest.open("wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as err:
        dest.unlink(missing_ok=True)
        raise NativeBuildError(f"{BINARY} source download: cannot fetch {url}: {err}; download it by hand, "
                               f"unpack it and pass its vendor/llama.cpp folder with --source") from None
    if digest.hexdigest() != sha256:
        dest.unlink()
        raise NativeBuildError(f"{BINARY} source download: {url} has sha256 {digest.hexdigest()}, "
                               f"expected {sha256}")


def _fetch_source(workdir: Path, log: Path) -> Path:
    """Download (:data:`LLAMA_CPP_SDIST_URL`, checked against its sha256) and unpack the
    pinned source distribution; returns llama.cpp's folder."""
    start = time.monotonic()
    archive = workdir / LLAMA_CPP_SDIST_URL.rsplit("/", 1)[1]
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ download {LLAMA_CPP_SDIST_URL} (sha256 {LLAMA_CPP_SDIST_SHA256})\n")
    _download(LLAMA_CPP_SDIST_URL, LLAMA_CPP_SDIST_SHA256, archive)
    with tarfile.open(archive) as tar:
        # the "data" filter (refuses links and paths out of the folder) where this Python
        # has it (3.12, and 3.8.17-3.11.4 onwards); Debian 12's 3.11.2 has not: the archive's
        # sha256 was checked above, so its content is the pinned release's either way
        tar.extractall(workdir, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    _say(f"{BINARY} source download: {time.monotonic() - start:.0f} s")
    return next(workdir.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build(root: Path | None = None, *, source: Path | None = None, jobs: int | None = None) -> Path:
    """Build ``llama-server`` for this CPU into ``root`` (default :func:`install_dir`).

    Reuses an existing build made for the same options: the one in ``root``, else
    the machine-wide copy (:func:`shared_build_dir`), which is copied in. Otherwise
    compiles it from ``source`` (a llama.cpp folder; default: fetched from
    :data:`LLAMA_CPP_SOURCE`) and keeps a machine-wide copy. The binary and its stamp
    are written to a temporary folder and moved into place, so ``root`` (and the copy)
    holds a complete build or none. CMake's and the compiler's output go to
    :func:`build_log`; the console gets one line per phase (source download, configure,
    compile, install) with its time, and a line a minute with the percentage while a
    phase runs (:func:`_phase`). Raises :class:`NativeBuildError` when a phase fails,
    after printing the log's last :data:`LOG_TAIL_LINES` lines and its path. Returns the
    binary's path.
    """
    root = root or install_dir()
    try:
        return llama_server_path(root)
    except NativeBuildError:
        pass
    args = cmake_args(cpu_flags())
    shared = shared_build_dir(args)
    try:
        llama_server_path(shared)
    except NativeBuildError:
        _compile(args, shared, source=source, jobs=jobs)
    else:
        print(f"[rlver] reusing the {BINARY} built for these CPU options in {shared}", file=sys.stderr, flush=True)
    with atomic_directory(root) as staged:  # replaces a build for other options
        shutil.copytree(shared, staged, dirs_exist_ok=True)
    return llama_server_path(root)


def _compile(args: list[str], dest: Path, *, source: Path | None, jobs: int | None) -> None:
    jobs = jobs or os.cpu_count() or 1
    log, gen = build_log(args), generator()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"{BINARY} build for {' '.join(args)}\n", encoding="utf-8")
    _say(f"building {BINARY} with {', '.join(enabled_options(args)) or 'native'} (AMX off), "
         f"{jobs} jobs with {gen[-1] if gen else 'Makefiles'}; this takes several minutes; log: {log}")
    with tempfile.TemporaryDirectory(prefix="rlver-llama-build-") as tmp:
        work = Path(tmp)
        src = source or _fetch_source(work, log)
        out = work / "build"
        levels = work / "optimisation.cmake"
        levels.write_text(OPTIMISATION, encoding="utf-8")
        _phase("configure", ["cmake", *gen, "-S", str(src), "-B", str(out), *args,
                             f"-DCMAKE_PROJECT_INCLUDE={levels}"], log)
        _phase("compile", ["cmake", "--build", str(out), "--target", BINARY, "-j", str(jobs)], log)
        start = time.monotonic()
        with atomic_directory(dest) as staged:
            (staged / "bin").mkdir()
            shutil.copy2(out / "bin" / BINARY, staged / "bin" / BINARY)
            (staged / "build.json").write_text(json.dumps(_fingerprint(args), indent=1), encoding="utf-8")
        _say(f"{BINARY} install: {time.monotonic() - start:.0f} s ({dest})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlver_lib.native", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help=f"build {BINARY} for this CPU (reused when already built)")
    b.add_argument("--source", type=Path, help="a llama.cpp source folder (default: fetch the pinned one)")
    b.add_argument("--jobs", type=int)
    sub.add_parser("cmake-args", help="print the CMake arguments chosen for this CPU")
    args = parser.parse_args(argv)
    if args.command == "cmake-args":
        print(" ".join(cmake_args(cpu_flags())))
        return 0
    try:
        print(build(source=args.source, jobs=args.jobs))
    except NativeBuildError as err:
        _say(str(err))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
