"""``rlver doctor`` (rlver_lib.doctor): it names the model it smoke-tests and fails, with
the CPU's build options and threads in its report, when llama-server dies by SIGILL."""

from __future__ import annotations

import io

from native_support import SIGILL_SERVER, executable_script


def test_doctor_names_the_model_and_fails_on_sigill(tmp_path, fake_gguf):
    from rlver_lib.doctor import report

    binary = executable_script(tmp_path / "llama-server", SIGILL_SERVER)
    out = io.StringIO()
    status = report(policy=False, binary=binary, model_path=fake_gguf, out=out)
    text = out.getvalue()
    assert status == 1
    assert "smoke simulator fake-model.gguf (llama-server): FAILED" in text
    assert "killed by SIGILL" in text
    assert "llama.cpp options for this CPU" in text and "threads: OMP_NUM_THREADS=" in text
    assert "llama-server machine code: not checked (objdump cannot read it)" in text  # a script


def test_doctor_cli_exit_status(tmp_path, fake_gguf):
    from rlver_lib.cli import main

    binary = executable_script(tmp_path / "llama-server", SIGILL_SERVER)
    assert main(["doctor", "--no-policy", "--llama-server", str(binary),
                 "--simulator-gguf", str(fake_gguf)]) == 1
