"""What the tests of rlver_lib.pipeline share: stand-in notebooks and a run config.

The stand-in notebooks take the same papermill parameters as the real ones and write
the files that mark a stage complete, so the tests exercise papermill, the manifest and
nbconvert without loading any model (kernel start-ups set their time). The
``notebooks`` fixture (tests/conftest.py) puts them where the pipeline looks.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from rlver_lib.config import RunConfig
from rlver_lib.params import build_config

STAND_IN = {
    "01_scenarios.ipynb": "(run / 'scenarios').mkdir(parents=True, exist_ok=True)\n"
                          "(run / 'scenarios' / 'test.jsonl').write_text('{}\\n')",
    "04_evaluation.ipynb": "import os\n"
                           "if os.environ.get('FAIL_STAGE') == label: raise RuntimeError('boom in ' + label)\n"
                           "(run / 'eval' / label).mkdir(parents=True, exist_ok=True)\n"
                           "(run / 'eval' / label / 'summary.json').write_text('{}')",
    "06_analysis.ipynb": "%matplotlib inline\nimport matplotlib.pyplot as plt\n"
                         "from IPython.display import display\n"
                         "fig, ax = plt.subplots(); ax.plot([0, 1], [40, 60]); ax.set_title('Stand-in curve')\n"
                         "display(fig)\nplt.close(fig)\nSECRET_SOURCE_MARKER = 1",
    "05_ablations.ipynb": "from pathlib import Path\nprint('compared', len(run_dirs), 'runs')\n"
                          "Path(grid_dir, 'compared.txt').write_text(str(len(run_dirs)))",
}
"""The body of each stand-in template, by the name of the notebook it stands in for."""

RUN_PARAMETERS = "params_file = None\nrun_dir = None\noverrides = {}\nlabel = 'baseline'\nadapter = None\n"
"""The papermill parameters cell of a stage's stand-in."""


def stand_in(body: str, parameters: str) -> nbformat.NotebookNode:
    """A notebook: a markdown title, the ``parameters`` cell (tagged), then ``body``."""
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [new_markdown_cell("## Stand-in section"), params, new_code_cell(body)]
    return nb


def write_stand_ins(folder: Path) -> Path:
    """Write every :data:`STAND_IN` template into ``folder``; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in STAND_IN.items():
        if name == "05_ablations.ipynb":
            nb = stand_in(body, "grid_dir = None\nrun_dirs = []\naxes = []\n")
        else:
            nb = stand_in("from pathlib import Path\nrun = Path(run_dir)\n" + body, RUN_PARAMETERS)
        nbformat.write(nb, folder / name)
    return folder


def run_config(tmp_path: Path, **overrides) -> RunConfig:
    """A rule-simulator run ``r`` under ``tmp_path/out`` with the scenarios, baseline and
    analysis stages; ``overrides`` are dotted keys."""
    data = {"run_name": "r", "output_root": str(tmp_path / "out"), "simulator": {"backend": "rule"},
            "stages": ["scenarios", "baseline", "analysis"]}
    return build_config(data, overrides)
