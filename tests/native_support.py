"""Fake ``llama-server`` executables, shared by tests/test_native.py and tests/test_doctor.py
(the fake GGUF file they are started on is conftest's ``fake_gguf``)."""

from __future__ import annotations

import stat
import sys
import textwrap
from pathlib import Path


def executable_script(path: Path, body: str) -> Path:
    """``path`` as an executable Python script (this interpreter) running ``body``."""
    path.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


SIGILL_SERVER = """
import os, signal
os.kill(os.getpid(), signal.SIGILL)
"""
