"""Notebook execution (rlver_lib.pipeline.execution) with the stand-in templates
(tests/pipeline_support.py)."""

import nbformat
import pytest

from rlver_lib.pipeline.execution import execute_notebook


def test_execute_notebook_passes_the_parameters_and_keeps_the_executed_copy(tmp_path, notebooks):
    output = tmp_path / "run" / "notebooks" / "05_ablations.ipynb"
    execute_notebook("05_ablations.ipynb", output, {"grid_dir": str(tmp_path), "run_dirs": ["a", "b", "c"]})
    assert (tmp_path / "compared.txt").read_text() == "3"
    executed = nbformat.read(output, as_version=4)
    assert executed.metadata["papermill"]["parameters"] == {"grid_dir": str(tmp_path), "run_dirs": ["a", "b", "c"]}


def test_a_missing_template_is_named(tmp_path, notebooks):
    with pytest.raises(FileNotFoundError, match="no_such.ipynb does not exist"):
        execute_notebook("no_such.ipynb", tmp_path / "out.ipynb", {})
    assert not (tmp_path / "out.ipynb").exists()
