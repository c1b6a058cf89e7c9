"""The code base is ruff-clean under the rules in pyproject.toml ([tool.ruff])."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    try:
        import ruff  # noqa: F401  (the dev extra installs it)
    except ImportError as err:
        raise AssertionError("ruff is missing: pip install -e '.[dev]'") from err
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "rlver_lib", "tests", "benchmarks"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
