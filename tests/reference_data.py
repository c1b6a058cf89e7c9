"""Where the tests find the reference data (SAGE's result files, RLVER's profiles).

``$RLVER_SHARED_DATA``, else ``../shared/data`` next to the checkout. A test that needs a
file calls :func:`reference_file` and is skipped, saying where it looked, when the
file is not there; a newcomer's checkout without the data runs every other test.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(os.environ.get("RLVER_SHARED_DATA")
                   or Path(__file__).resolve().parents[1].parent / "shared" / "data")


def reference_file(*parts: str) -> Path:
    """``SHARED_DATA / parts``; skips the calling test when that path does not exist."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"reference data not found: {path} (set RLVER_SHARED_DATA)")
    return path


def rlver_test_profiles(n: int | None = None) -> list:
    """The first ``n`` of RLVER's test profiles (all when ``n`` is None), as scenarios."""
    from rlver_lib.scenarios import load_scenarios

    return load_scenarios(reference_file("rlver_profiles", "test_profile.jsonl"))[:n]
