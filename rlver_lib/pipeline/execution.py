"""Notebook execution: papermill runs a template of ``notebooks/`` with its parameters
into a run folder (docs/ARCHITECTURE.md "Data flow"); what a stage, a rank's training
and an ablation's comparison all go through.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import papermill

from rlver_lib.files import PROJECT_ROOT

NOTEBOOK_DIR = Path(os.environ.get("RLVER_NOTEBOOKS", PROJECT_ROOT / "notebooks"))
"""The template notebooks: ``notebooks/``, or ``$RLVER_NOTEBOOKS`` (stand-ins in tests)."""


def execute_notebook(template: str, output: Path, parameters: dict[str, Any],
                     *, cwd: Path | None = None) -> None:
    """Execute ``notebooks/<template>`` (:data:`NOTEBOOK_DIR`) with papermill
    ``parameters`` into ``output``, in ``cwd`` (default: the current folder).

    Raises :class:`FileNotFoundError` when the template does not exist and
    :class:`papermill.PapermillExecutionError` when a cell fails; the partially
    executed notebook is kept at ``output``.
    """
    source = NOTEBOOK_DIR / template
    if not source.exists():
        raise FileNotFoundError(f"pipeline notebook {source} does not exist")
    output.parent.mkdir(parents=True, exist_ok=True)
    papermill.execute_notebook(
        str(source), str(output), parameters=parameters,
        cwd=str(cwd or Path.cwd()), progress_bar=False, log_output=False,
        kernel_name="python3",
        # the kernel listens on loopback (127.0.0.1); its start-up warning that TCP is not
        # encrypted would print on every stage, and its errors still show
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
