"""The native build fits the CPU; native crashes become errors, never a dead run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from native_support import SIGILL_SERVER, executable_script

from rlver_lib import native
from rlver_lib.backends import BackendDied
from rlver_lib.config import SamplingParams
from rlver_lib.servers import LlamaServerBackend

# flags lines as /proc/cpuinfo prints them (trimmed to what matters)
AVX2_ONLY = ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi1 bmi2 avx2 movbe popcnt aes")
AVX512_NO_AMX = AVX2_ONLY + (" avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni"
                             " avx512_bf16 avx512_vbmi2")
AMX_FLAGGED = AVX512_NO_AMX + " avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8"


def _options(flags_line: str) -> dict[str, str]:
    flags = native.cpu_flags(f"processor\t: 0\nflags\t\t: {flags_line}\n")
    args = native.cmake_args(flags, machine="x86_64")
    return dict(a[2:].split("=", 1) for a in args)


def test_avx2_only_cpu_gets_the_avx2_set():
    opts = _options(AVX2_ONLY)
    assert opts["GGML_NATIVE"] == "OFF"
    on = {k for k, v in opts.items() if k.startswith(("GGML_AVX", "GGML_FMA", "GGML_F16C", "GGML_BMI2",
                                                      "GGML_SSE42", "GGML_AMX")) and v == "ON"}
    assert on == {"GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"}


def test_avx512_cpu_without_amx():
    opts = _options(AVX512_NO_AMX)
    for key in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX2"):
        assert opts[key] == "ON", key
    assert opts["GGML_AVX_VNNI"] == "OFF"  # no avx_vnni flag
    assert all(opts[k] == "OFF" for k in native.AMX_OPTIONS)


def test_amx_flagged_cpu_never_builds_amx():
    opts = _options(AMX_FLAGGED)
    assert opts["GGML_NATIVE"] == "OFF"  # -march=native would turn AMX back on
    assert opts["GGML_AVX_VNNI"] == "ON" and opts["GGML_AVX512"] == "ON"
    assert [opts[k] for k in native.AMX_OPTIONS] == ["OFF", "OFF", "OFF"]


def test_partial_avx512_is_not_enough():
    # avx512f alone (no bw/vl/dq/cd) must not switch on ggml's AVX512 set
    opts = _options(AVX2_ONLY + " avx512f")
    assert opts["GGML_AVX512"] == "OFF"


AMX_ASM = """
    .text
    .globl amx_probe
amx_probe:
    ldtilecfg (%rdi)
    tilezero %tmm4
    tdpbssd %tmm2, %tmm1, %tmm0
    tilerelease
    vpdpbusd %zmm2, %zmm1, %zmm0
    ret
"""


def test_amx_instructions_are_counted_in_machine_code(tmp_path):
    import shutil
    import subprocess

    if not (shutil.which("as") and shutil.which("objdump")):
        pytest.skip("binutils (as, objdump) not installed")
    source = tmp_path / "amx.s"
    source.write_text(AMX_ASM)
    subprocess.run(["as", "-o", str(tmp_path / "amx.o"), str(source)], check=True)
    assert native.amx_instruction_count(tmp_path / "amx.o") == 4  # not the AVX-512 VNNI one
    source.write_text(AMX_ASM.split("ldtilecfg")[0] + "    ret\n")
    subprocess.run(["as", "-o", str(tmp_path / "none.o"), str(source)], check=True)
    assert native.amx_instruction_count(tmp_path / "none.o") == 0
    with pytest.raises(subprocess.CalledProcessError):
        native.amx_instruction_count(source)  # not machine code


def test_this_machines_build_has_no_amx_code(monkeypatch):
    import shutil

    try:
        binary = native.llama_server_path()
    except native.NativeBuildError as err:
        pytest.skip(str(err))
    if shutil.which("objdump") is None:
        pytest.skip("objdump not installed")
    assert native.amx_instruction_count(binary) == 0
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert native.amx_instruction_count(binary) is None


def test_non_x86_keeps_native_detection():
    assert "-DGGML_NATIVE=ON" in native.cmake_args(frozenset({"neon"}), machine="aarch64")


def test_binary_built_for_another_cpu_is_refused(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / native.BINARY).write_text("")
    other = native.cmake_args(native.cpu_flags(f"flags : {AVX2_ONLY}"), machine="x86_64")
    here = native.cmake_args(native.cpu_flags())
    if other == here:
        other = native.cmake_args(native.cpu_flags(f"flags : {AMX_FLAGGED}"), machine="x86_64")
    (tmp_path / "build.json").write_text(json.dumps({"cmake_args": other, "options": ["x"]}))
    with pytest.raises(native.NativeBuildError, match="make native"):
        native.llama_server_path(tmp_path)
    (tmp_path / "build.json").write_text(json.dumps({"cmake_args": here, "options": []}))
    assert native.llama_server_path(tmp_path) == tmp_path / "bin" / native.BINARY


def test_a_build_is_compiled_once_per_cpu_options_and_copied_to_new_environments(tmp_path, monkeypatch):
    compiled = []

    def fake_compile(args, dest, *, source, jobs):  # what _compile leaves behind, without cmake
        compiled.append(dest)
        (dest / "bin").mkdir(parents=True)
        (dest / "bin" / native.BINARY).write_text("binary for " + " ".join(args))
        (dest / "build.json").write_text(json.dumps(native._fingerprint(args)))

    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_compile", fake_compile)
    avx512, avx2 = (native.cpu_flags(f"flags : {line}") for line in (AVX512_NO_AMX, AVX2_ONLY))
    monkeypatch.setattr(native, "cpu_flags", lambda: avx512)
    first = native.build(tmp_path / "venv1")
    second = native.build(tmp_path / "venv2")  # a second checkout: copied, not compiled
    assert len(compiled) == 1 and compiled[0].parent == tmp_path / "cache" / native.BINARY
    assert first.read_text() == second.read_text() and second == tmp_path / "venv2" / "bin" / native.BINARY
    # a CPU that gets other options compiles its own build, also over an environment's old one
    monkeypatch.setattr(native, "cpu_flags", lambda: avx2)
    third = native.build(tmp_path / "venv1")
    assert len(compiled) == 2 and compiled[1] != compiled[0]
    assert "-DGGML_AVX512=OFF" in third.read_text() and "-DGGML_AVX512=ON" in second.read_text()
    assert native.build_info(tmp_path / "venv1")["options"] == native.enabled_options(native.cmake_args(avx2))


# A stand-in for cmake: floods stdout and stderr as a real llama.cpp build does (about
# 14,600 lines of compiler warnings in CI), fails in the phase named by $FAKE_CMAKE_FAIL,
# and otherwise leaves the binary where cmake --build puts it.
FAKE_CMAKE = """
import os, sys
phase = "compile" if sys.argv[1] == "--build" else "configure"
for i in range(3000 if phase == "compile" else 300):
    print(f"{phase} output line {i}", flush=True)
    print(f"{phase} warning line {i}", file=sys.stderr, flush=True)
if os.environ.get("FAKE_CMAKE_FAIL") == phase:
    sys.exit(2)
if phase == "compile":
    out = sys.argv[2]
    os.makedirs(os.path.join(out, "bin"), exist_ok=True)
    with open(os.path.join(out, "bin", "llama-server"), "w") as f:
        f.write("a built binary")
"""


@pytest.fixture
def fake_cmake(tmp_path, monkeypatch):
    """cmake on PATH is :data:`FAKE_CMAKE`; the cache and this CPU's flags are fixed.
    Returns the CMake arguments the build will use."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    executable_script(bin_dir / "cmake", FAKE_CMAKE)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    flags = native.cpu_flags(f"flags : {AVX2_ONLY}")
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    (tmp_path / "src").mkdir()
    return native.cmake_args(flags)


def test_a_build_prints_one_line_per_phase_and_logs_the_compiler_output(tmp_path, fake_cmake, capfd):
    binary = native.build(tmp_path / "venv", source=tmp_path / "src", jobs=2)
    out, err = capfd.readouterr()
    console = (out + err).splitlines()
    assert len(console) <= 5, console  # the start line, configure, compile, install
    for phase in ("configure", "compile", "install"):
        assert len([line for line in console if re.search(rf"llama-server {phase}: \d+ s", line)]) == 1, console
    log = native.build_log(fake_cmake)
    assert log.parent == native.shared_build_dir(fake_cmake).parent and str(log) in console[0]
    text = log.read_text()
    assert "compile warning line 2999" in text and "configure output line 299" in text
    assert binary.read_text() == "a built binary"
    assert native.build_info(tmp_path / "venv")["cmake_args"] == fake_cmake  # the stamp is kept


@pytest.mark.parametrize("generator", ["Ninja", "Makefiles"])
def test_ggml_compiles_at_o3_alone_and_the_rest_at_o1_in_unity_batches(tmp_path, monkeypatch, capfd, generator):
    """Real cmake and a real compiler on llama.cpp's layout in small: a top project with
    the server, ``common`` and ``tools/mtmd`` libraries and a ``ggml`` sub-project. Pairs
    of files define the same static helper, so a file in the wrong batch fails the build:
    ggml's two kernels (ggml stays file by file), ``json.cpp`` beside ``arg.cpp`` and
    the mtmd helpers beside ``clip.cpp`` (the three files kept out of the batches). A
    compiler launcher records each compile command, which shows the file's batch and
    optimisation level; with either generator :func:`native.generator` can choose."""
    if not shutil.which("cmake") or not shutil.which("c++"):
        pytest.skip("needs cmake and a C++ compiler")
    if generator == "Ninja" and not shutil.which("ninja"):
        pytest.skip("needs ninja")
    if generator == "Makefiles":
        monkeypatch.setattr(native, "generator", lambda: [])
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    recorded = tmp_path / "compiles.txt"
    (tmp_path / "record.py").write_text("import os, sys\n"
                                        f"open({str(recorded)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                                        "os.execvp(sys.argv[1], sys.argv[1:])\n")
    helper = "static int helper() { return 1; }\n"
    files = {
        "CMakeLists.txt": 'cmake_minimum_required(VERSION 3.14)\nproject("llama.cpp" CXX)\n'
                          f'set(CMAKE_CXX_COMPILER_LAUNCHER "{sys.executable};{tmp_path / "record.py"}")\n'
                          "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
                          "add_subdirectory(ggml)\nadd_subdirectory(common)\nadd_subdirectory(tools/mtmd)\n"
                          "add_executable(llama-server server.cpp route.cpp)\n"
                          "target_link_libraries(llama-server llama-common mtmd ggml)\n",
        "server.cpp": "int kernel(); int ops(); int arg(); int json(); int clip(); int route();\n"
                      "int main() { return kernel() + ops() + arg() + json() + clip() + route(); }\n",
        "route.cpp": "int route() { return 0; }\n",
        "ggml/CMakeLists.txt": 'project("ggml" CXX)\nadd_library(ggml kernel.cpp ops.cpp)\n',
        "ggml/kernel.cpp": helper + "int kernel() { return helper() - 1; }\n",
        "ggml/ops.cpp": helper + "int ops() { return helper() - 1; }\n",
        "common/CMakeLists.txt": "add_library(llama-common arg.cpp json.cpp)\n",
        "common/arg.cpp": helper + "int arg() { return helper() - 1; }\n",
        "common/json.cpp": helper + "int json() { return helper() - 1; }\n",
        "tools/mtmd/CMakeLists.txt": "add_library(mtmd clip.cpp mtmd-helper.cpp mtmd-helper-gen.cpp)\n",
        "tools/mtmd/clip.cpp": helper + "int clip() { return helper() - 1; }\n",
        "tools/mtmd/mtmd-helper.cpp": helper + "int mtmd_helper() { return helper(); }\n",
        "tools/mtmd/mtmd-helper-gen.cpp": helper + "int mtmd_helper_gen() { return helper(); }\n",
    }
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    flags = native.cpu_flags(f"flags : {AVX2_ONLY}")
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    args = native.cmake_args(flags)
    native.build(tmp_path / "venv", source=src, jobs=1)
    assert f"1 jobs with {generator};" in capfd.readouterr().err
    configure = next(line for line in native.build_log(args).read_text().splitlines() if line.startswith("$ cmake -"))
    assert ("-G Ninja" in configure) == (generator == "Ninja"), configure
    compiles = [line for line in recorded.read_text().splitlines() if " -c " in line]
    levels = {Path(line.split()[-1]).name: re.findall(r"(?<!\S)-O\d", line) for line in compiles}
    assert levels == {
        "kernel.cpp": ["-O3"], "ops.cpp": ["-O3"],  # ggml: file by file, -O3
        "json.cpp": ["-O1"], "mtmd-helper.cpp": ["-O1"], "mtmd-helper-gen.cpp": ["-O1"],  # alone
        "unity_0_cxx.cxx": ["-O1"],  # each of the three other targets' batch
    }, compiles
    batches = sorted(line.split()[-1].split("CMakeFiles/")[1].split("/")[0] for line in compiles
                     if line.rstrip().endswith("unity_0_cxx.cxx"))
    assert batches == ["llama-common.dir", "llama-server.dir", "mtmd.dir"], compiles


@pytest.fixture
def file_server(tmp_path):
    """A real HTTP server on loopback serving ``tmp_path / "served"``; yields its base URL."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    folder = tmp_path / "served"
    folder.mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_source_is_downloaded_directly_and_checked_against_its_sha256(tmp_path, file_server):
    import hashlib

    payload = os.urandom(3 << 20)  # several read chunks
    (tmp_path / "served" / "src.tar.gz").write_bytes(payload)
    good = hashlib.sha256(payload).hexdigest()
    native._download(f"{file_server}/src.tar.gz", good, tmp_path / "got.tar.gz")
    assert (tmp_path / "got.tar.gz").read_bytes() == payload
    with pytest.raises(native.NativeBuildError, match=f"expected {'0' * 64}"):
        native._download(f"{file_server}/src.tar.gz", "0" * 64, tmp_path / "bad.tar.gz")
    assert not (tmp_path / "bad.tar.gz").exists()  # a file that fails its hash is not kept
    with pytest.raises(native.NativeBuildError, match="--source"):
        native._download(f"{file_server}/missing.tar.gz", good, tmp_path / "none.tar.gz")
    assert not (tmp_path / "none.tar.gz").exists()


@pytest.mark.parametrize("has_data_filter", [True, False], ids=["python-3.12", "python-3.11.2"])
def test_the_source_unpacks_with_and_without_tarfiles_data_filter(tmp_path, file_server, monkeypatch,
                                                                   has_data_filter):
    """The sdist is unpacked by any Python the README allows: Debian 12's 3.11.2 has no
    ``filter=`` argument to ``extractall`` (a cold set-up there once died on it)."""
    import hashlib
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = b"project(llama.cpp)\n"
        info = tarfile.TarInfo("llama_cpp_python-0.0.1/vendor/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "served" / "llama_cpp_python-0.0.1.tar.gz"
    archive.write_bytes(buffer.getvalue())
    monkeypatch.setattr(native, "LLAMA_CPP_SDIST_URL", f"{file_server}/{archive.name}")
    monkeypatch.setattr(native, "LLAMA_CPP_SDIST_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    if not has_data_filter:
        monkeypatch.delattr(tarfile, "data_filter")
        real = tarfile.TarFile.extractall
        monkeypatch.setattr(tarfile.TarFile, "extractall", lambda self, path=".", members=None, *, numeric_owner=False:
                            real(self, path, members, numeric_owner=numeric_owner))  # 3.11.2's signature
    (tmp_path / "work").mkdir()
    src = native._fetch_source(tmp_path / "work", tmp_path / "build.log")
    assert (src / "CMakeLists.txt").read_bytes() == data


@pytest.mark.parametrize("phase", ["configure", "compile"])
def test_a_failed_build_shows_the_logs_tail_and_path_and_leaves_no_build(tmp_path, fake_cmake, capfd, monkeypatch,
                                                                          phase):
    monkeypatch.setenv("FAKE_CMAKE_FAIL", phase)
    log = native.build_log(fake_cmake)
    with pytest.raises(native.NativeBuildError, match=re.escape(str(log))):
        native.build(tmp_path / "venv", source=tmp_path / "src", jobs=2)
    out, err = capfd.readouterr()
    console = (out + err).splitlines()
    assert len(console) <= native.LOG_TAIL_LINES + 4, len(console)
    last = 2999 if phase == "compile" else 299
    assert f"{phase} warning line {last}" in err and f"{phase} warning line {last - 30}" not in err
    assert any(f"llama-server {phase} FAILED" in line and str(log) in line for line in console), console
    assert f"{phase} warning line {last - 30}" in log.read_text()  # the whole output is in the log
    assert not (tmp_path / "venv").exists() and not native.shared_build_dir(fake_cmake).exists()


def test_the_build_command_exits_1_with_the_reason_when_a_phase_fails(tmp_path, fake_cmake, monkeypatch, capfd):
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "compile")
    monkeypatch.setenv("RLVER_NATIVE_DIR", str(tmp_path / "venv"))
    assert native.main(["build", "--source", str(tmp_path / "src")]) == 1
    assert "failed (exit status 2); full log:" in capfd.readouterr().err


# ---------------------------------------------------------------- crashing servers


# A real OpenAI-compatible HTTP server on loopback that answers the simulator's two
# structured calls, then dies by SIGSEGV on request number $DIE_AT.
FLAKY_SERVER = """
import json, os, signal, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
die_at = int(os.environ["DIE_AT"])
count = [0]
lock = threading.Lock()
class H(BaseHTTPRequestHandler):
    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200, {"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:
            count[0] += 1
            if count[0] >= die_at:
                os.kill(os.getpid(), signal.SIGSEGV)
        props = body["response_format"]["json_schema"]["schema"]["properties"]
        if "change" in props:
            out = {"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r", "change": 2}
        else:
            out = {"reasoning": "x", "message": "I see.", "end_conversation": False}
        self._send(200, {"choices": [{"message": {"content": json.dumps(out)}, "finish_reason": "stop"}],
                         "usage": {}})
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_server_killed_by_sigill_is_backend_died(tmp_path, fake_gguf):
    binary = executable_script(tmp_path / "llama-server", SIGILL_SERVER)
    with pytest.raises(BackendDied, match="fake-model.gguf killed by SIGILL while starting") as info:
        LlamaServerBackend(fake_gguf, binary=binary, startup_timeout_s=30)
    assert info.value.signal == "SIGILL"


def _flaky_simulator(tmp_path, fake_gguf, die_at: int, monkeypatch):
    from rlver_lib.config import SimulatorConfig
    from rlver_lib.simulator import UserSimulator

    monkeypatch.setenv("DIE_AT", str(die_at))
    binary = executable_script(tmp_path / "llama-server", FLAKY_SERVER)
    backend = LlamaServerBackend(fake_gguf, binary=binary, parallel=2, timeout_s=10,
                                 max_retries=0, startup_timeout_s=30)
    return backend, UserSimulator(backend, SimulatorConfig(appraisal="first_person", max_retries=2), seed=0)


def test_server_dying_mid_rollout_gives_error_trajectories(tmp_path, fake_gguf, monkeypatch):
    from test_rollout import ScriptedPolicy, scenario

    from rlver_lib.rollout import run_rollouts

    # 2 dialogues: turn 1 uses requests 1-4 (appraise x2, reply x2); request 5 kills it
    backend, simulator = _flaky_simulator(tmp_path, fake_gguf, 5, monkeypatch)
    try:
        trajectories = run_rollouts(
            ScriptedPolicy(lambda conv: "Tell me more."), simulator, [scenario("a"), scenario("b")],
            max_turns=3, initial_emotion=50, think=False, sampling=SamplingParams(), seed=0,
            progress=False)
    finally:
        backend.close()
    assert [t.termination for t in trajectories] == ["error", "error"]
    # the first turn was genuine (+2) and kept; nothing after the crash was invented
    assert [t.final_emotion for t in trajectories] == [52, 52]
    assert simulator.fatal_error is not None and "SIGSEGV" in simulator.fatal_error
    assert backend.process.returncode == -signal.SIGSEGV


def test_no_server_process_survives_close(tmp_path, fake_gguf, monkeypatch):
    backend, _ = _flaky_simulator(tmp_path, fake_gguf, 1000, monkeypatch)
    pid = backend.process.pid
    backend.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_training_step_with_a_dying_simulator_fails_cleanly_and_resumes(tmp_path, fake_gguf, monkeypatch):
    from training_support import tiny_config, tiny_scenarios

    from rlver_lib.simulator import RuleSimulator
    from rlver_lib.trainer import Trainer, TrainerError

    cfg = tiny_config(tmp_path, "dies", steps=2, checkpoint_every=1)
    # step 1: 2 dialogues x 1 turn, appraised only (the last turn) = requests 1-2; request 3
    # (step 2) kills the server
    backend, simulator = _flaky_simulator(tmp_path, fake_gguf, 3, monkeypatch)
    try:
        with pytest.raises(TrainerError, match="(?s)backend died .*SIGSEGV.*run the same command again to resume"):
            Trainer(cfg, tiny_scenarios(2), simulator=simulator).train()
    finally:
        backend.close()
    train_dir = cfg.run_dir / "train"
    assert [p.name for p in (train_dir / "checkpoints").iterdir()] == ["step_000001"]
    failed = [json.loads(line) for line in (train_dir / "dialogues" / "step_000002.failed.jsonl").open()]
    assert [r["termination"] for r in failed] == ["error", "error"]
    resumed = Trainer(cfg, tiny_scenarios(2), simulator=RuleSimulator())
    assert resumed.step == 1
    assert [r["step"] for r in resumed.train()] == [1, 2]


def test_a_long_phase_prints_the_builds_percentage_while_it_runs(tmp_path, monkeypatch, capfd):
    """A compile of minutes is not silent: every ``PROGRESS_EVERY_S`` a console line with
    the last ``[ NN%]`` the Makefiles wrote to the log; then the phase's one line."""
    monkeypatch.setattr(native, "PROGRESS_EVERY_S", 0.25)
    script = tmp_path / "make.py"
    script.write_text("import time\nprint('[  9%] Building C object a.o', flush=True)\n"
                      "print('[ 57%] Building CXX object b.o', flush=True)\nprint('warning: [ 99%] not a line start')\n"
                      "time.sleep(2.0)\n")
    log = tmp_path / "build.log"
    native._phase("compile", [sys.executable, str(script)], log)
    console = capfd.readouterr().err.splitlines()
    progress = [line for line in console if re.search(r"llama-server compile: \d+% after \d+ s", line)]
    assert progress and all("57%" in line for line in progress), console
    assert re.search(r"llama-server compile: \d+ s$", console[-1]), console
    assert native._progress(log) == 57
    assert native._progress(tmp_path / "missing.log") is None
    (tmp_path / "ninja.log").write_text("[59/105] Building CXX object a.o\n[60/105] Building CXX object b.o\n")
    assert native._progress(tmp_path / "ninja.log") == 57  # Ninja's steps: 60 of 105
    (tmp_path / "quiet.log").write_text("-- Configuring done\n")
    assert native._progress(tmp_path / "quiet.log") is None
