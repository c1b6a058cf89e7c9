"""``rlver doctor``: is this machine able to run the workbench?

Prints the CPU's instruction-set features and the llama.cpp build options they
select, which build of each native library is installed (the ``llama-server``
stamp, torch's CPU capability), the thread settings, and a 4-token smoke
generation of each embedded model, each run in its own process so that a crash
(SIGILL from a build that does not fit the CPU, SIGSEGV, abort) is reported with
its signal instead of killing the check; then whether llama-server's weight repacking
pays on this machine, measured once a build (:func:`repack_line`). Exit status 0 when
every smoke test passed, 1 otherwise. ``make setup`` runs it last.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rlver_lib import native

SMOKE_TOKENS = 4
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM")
_POLICY_SMOKE = f"""
import torch
from rlver_lib.config import EMBEDDED_POLICY
from rlver_lib.backends import TransformersBackend
from rlver_lib.config import SamplingParams
from rlver_lib.models import load_causal_lm
model, tokenizer = load_causal_lm(EMBEDDED_POLICY, "bfloat16")
out = TransformersBackend(model, tokenizer).generate(
    [[{{"role": "user", "content": "Hello"}}]], SamplingParams(temperature=0, max_new_tokens={SMOKE_TOKENS}))
print(repr(out[0].text))
"""


@dataclass
class SmokeResult:
    """One smoke generation: ``ok``, and ``detail`` (the text, or why it failed)."""

    model: str
    ok: bool
    detail: str


def smoke_policy(timeout_s: float = 600.0) -> SmokeResult:
    """Load the embedded policy and generate 4 tokens, in a child Python process."""
    from rlver_lib.servers import exit_description

    name = "policy SmolLM2-135M-Instruct (transformers)"
    try:
        proc = subprocess.run([sys.executable, "-c", _POLICY_SMOKE], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SmokeResult(name, False, f"no answer within {timeout_s:.0f} s")
    if proc.returncode != 0:
        how, _ = exit_description(proc.returncode)
        tail = " | ".join((proc.stderr or "").strip().splitlines()[-3:])
        return SmokeResult(name, False, f"{how}: {tail}")
    return SmokeResult(name, True, proc.stdout.strip().splitlines()[-1])


def smoke_simulator(binary: Path | None = None, model_path: Path | None = None,
                    startup_timeout_s: float = 300.0) -> SmokeResult:
    """Serve the embedded simulator GGUF with ``llama-server`` and generate 4 tokens.

    The server is its own process (:class:`~rlver_lib.servers.LlamaServerBackend`),
    so a crash comes back as a failed result naming the signal.
    """
    from rlver_lib.backends import BackendError
    from rlver_lib.config import SamplingParams
    from rlver_lib.models import EmbeddedModelError, default_threads, simulator_gguf_path
    from rlver_lib.servers import LlamaServerBackend

    try:
        model_path = model_path or simulator_gguf_path()
    except EmbeddedModelError as err:
        return SmokeResult("simulator", False, str(err))
    name = f"simulator {model_path.name} (llama-server)"
    try:
        with LlamaServerBackend(model_path, n_ctx=512, parallel=1, threads=default_threads(), binary=binary,
                                startup_timeout_s=startup_timeout_s) as backend:
            out = backend.generate([[{"role": "user", "content": "Hello"}]],
                                   SamplingParams(temperature=0, max_new_tokens=SMOKE_TOKENS, seed=0))
    except (BackendError, native.NativeBuildError, OSError) as err:
        return SmokeResult(name, False, str(err).splitlines()[0])
    return SmokeResult(name, True, repr(out[0].text))


def _amx_check(server: Path) -> str:
    """What :func:`rlver_lib.native.amx_instruction_count` says of ``server``, in words."""
    try:
        count = native.amx_instruction_count(server)
    except subprocess.CalledProcessError:
        return "not checked (objdump cannot read it)"
    if count is None:
        return "not checked (objdump not installed)"
    return f"{count} AMX instructions" + (" (can die with SIGILL where AMX is reported)" if count else "")


def repack_line(model_path: Path | None = None, *, remeasure: bool = False) -> str:
    """The report's line on llama-server's weight repacking on this machine: the recorded
    choice (:func:`rlver_lib.native.repack_record`), measured first
    (:func:`rlver_lib.servers.measure_repack`, about 20 s on the embedded simulator) when
    nothing valid is recorded or ``remeasure``; what ``$LLAMA_ARG_REPACK`` says when set.
    A measurement that fails is reported in the line and leaves llama.cpp's default."""
    from rlver_lib import servers
    from rlver_lib.backends import BackendError
    from rlver_lib.models import default_threads, simulator_gguf_path

    if "LLAMA_ARG_REPACK" in os.environ:
        setting = os.environ["LLAMA_ARG_REPACK"]
        return f"llama-server weight repacking: as LLAMA_ARG_REPACK={setting} says (not measured)"
    record = None if remeasure else native.repack_record()
    if record is None:
        try:
            record = servers.measure_repack(model_path or simulator_gguf_path(), threads=default_threads())
        except (BackendError, native.NativeBuildError, OSError) as err:
            return (f"llama-server weight repacking: not measured ({str(err).splitlines()[0]}); "
                    "llama.cpp's default (on) stays")
    rates = record["prefill_tokens_per_s"]
    return (f"llama-server weight repacking: {'on' if record['repack'] else 'off'} on this machine "
            f"(prompt processing {rates['repack']:g} tokens/s with it, {rates['no_repack']:g} without, "
            f"{record['model']}, measured {record['measured']}; off only when {record['margin']:g}x as fast)")


def report(*, policy: bool = True, simulator: bool = True, binary: Path | None = None,
           model_path: Path | None = None, remeasure_repack: bool = False, out=sys.stdout) -> int:
    """Print the health report; returns the exit status (0 all smoke tests ok, else 1).
    With the installed build (``binary`` None) and a passing simulator smoke test, it also
    reports (and first measures, see :func:`repack_line`) the weight repacking choice."""
    flags = native.cpu_flags()
    wanted = native.cmake_args(flags)
    amx = sorted(f for f in flags if f.startswith("amx"))
    print(f"CPU: {native.cpu_model()} ({platform.machine()}, {os.cpu_count()} logical CPUs)", file=out)
    print(f"  llama.cpp options for this CPU: {', '.join(native.enabled_options(wanted)) or 'native'}"
          f"; AMX {'reported (' + ', '.join(amx) + ') but ' if amx else ''}off", file=out)
    info = native.build_info(native.install_dir() if binary is None else binary.parent.parent)
    if binary is not None:
        print(f"  llama-server: {binary} (given)", file=out)
    elif info is None:
        print(f"  llama-server: not built in {native.install_dir()} (run `make native`)", file=out)
    else:
        match = "matches this CPU" if info.get("cmake_args") == wanted else "BUILT FOR ANOTHER CPU"
        print(f"  llama-server: {native.install_dir()} from {info.get('source')}, options "
              f"{', '.join(info.get('options', []))} ({match})", file=out)
    server = binary or native.install_dir() / "bin" / native.BINARY
    if server.is_file():
        print(f"  llama-server machine code: {_amx_check(server)}", file=out)
    try:
        import torch

        print(f"  torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()}, "
              f"{torch.get_num_threads()} intra-op threads", file=out)
    except ImportError:
        print("  torch: not installed", file=out)
    print("threads: " + ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in _THREAD_VARS), file=out)
    results = []
    if simulator:
        results.append(smoke_simulator(binary, model_path))
    if policy:
        results.append(smoke_policy())
    for result in results:
        print(f"smoke {result.model}: {'ok' if result.ok else 'FAILED'} — {result.detail}", file=out)
    failed = [r for r in results if not r.ok]
    if simulator and binary is None and not failed:
        print(repack_line(model_path, remeasure=remeasure_repack), file=out)
    if failed:
        print(f"rlver doctor: {len(failed)} smoke generation(s) failed; see docs/SETUP.md "
              "'The native build' (rebuild with `make native`)", file=out)
    return 1 if failed else 0
