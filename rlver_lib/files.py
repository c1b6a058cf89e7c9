"""Atomic file output, JSON Lines reading/writing, the user cache folder, and every
path of a run folder, a benchmark's folder, an ablation's folder and a checkpoint
(docs/ARCHITECTURE.md "Run folder"), shared by every module.

Writes go to a temporary file in the target folder and are renamed into place,
so an interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

_UMASK = os.umask(0)
os.umask(_UMASK)


def cache_dir() -> Path:
    """The cache of converted models and native builds: ``$RLVER_CACHE`` if set, else
    ``~/.cache/rlver`` (created)."""
    root = Path(os.environ.get("RLVER_CACHE") or Path.home() / ".cache" / "rlver")
    root.mkdir(parents=True, exist_ok=True)
    return root


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temp file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the usual file mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented UTF-8 JSON atomically."""
    return atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=2) + "\n")


def commit_directory(tmp: str | Path, path: str | Path, *,
                     if_exists: Literal["replace", "keep"] = "replace") -> Path:
    """Move the finished folder ``tmp`` to ``path`` by renaming it (same file system).

    ``path`` is then either the complete new folder or, until the rename, whatever it
    was before; never a half-written one. When ``path`` already exists:
    ``"replace"`` swaps it out (renamed aside, then deleted); ``"keep"`` keeps it and
    deletes ``tmp`` (another writer finished first, e.g. a concurrent conversion).
    The folder gets the usual directory mode (umask) rather than ``mkdtemp``'s 0700.
    Returns ``path``.
    """
    tmp, path = Path(tmp), Path(path)
    os.chmod(tmp, 0o777 & ~_UMASK)
    old = None
    if path.exists():
        if if_exists == "keep":
            shutil.rmtree(tmp, ignore_errors=True)
            return path
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if if_exists == "keep" and path.is_dir():  # a concurrent writer got there first
            shutil.rmtree(tmp, ignore_errors=True)
            return path
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


@contextmanager
def atomic_directory(path: str | Path, *,
                     if_exists: Literal["replace", "keep"] = "replace") -> Iterator[Path]:
    """Write a folder atomically: yields a fresh temporary folder beside ``path``, which
    :func:`commit_directory` renames to ``path`` when the block succeeds; on an
    exception the temporary folder is deleted and ``path`` is left as it was.

    ``with atomic_directory(dest) as tmp: model.save_pretrained(tmp)``
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_directory(tmp, path, if_exists=if_exists)


def write_jsonl(path: str | Path, records: Iterable[dict]) -> Path:
    """Write one JSON object per line (UTF-8, ``\\n`` separated) atomically."""
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    return atomic_write_text(path, "".join(line + "\n" for line in lines))


class JsonlError(ValueError):
    """A line of a JSON Lines file that is not valid JSON; ``line`` is 1-based."""

    def __init__(self, path: str | Path, line: int, message: str):
        super().__init__(f"{path}:{line}: {message}")
        self.path, self.line = str(path), line


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, object)`` for each non-blank line of a JSON Lines file.

    Follows the JSON Lines definition: records are separated by ``\\n`` only (a
    U+2028/U+2029 inside a string is data, not a separator); a UTF-8 BOM is
    skipped. Raises :class:`JsonlError` naming the file line on a bad line.
    """
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8-sig")
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise JsonlError(path, number, f"invalid JSON: {err.msg} (column {err.colno})") from None


def process_rank() -> int:
    """This process's rank under ``accelerate launch`` / ``torchrun`` (``$RANK``), else 0:
    rank 0 is the one writer of a run folder's shared files."""
    return int(os.environ.get("RANK", "0"))


PROJECT_ROOT = Path(__file__).resolve().parents[1]

ADAPTER_CONFIG = "adapter_config.json"
"""``peft``'s file in a saved LoRA adapter folder (``save_pretrained``): there once the adapter is saved."""


@dataclass(frozen=True)
class Folder:
    """A folder whose files are named by the subclass's properties, under ``root``
    (any path-like, kept as a :class:`~pathlib.Path`). Paths only."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))


@dataclass(frozen=True)
class RunFolder(Folder):
    """Every path of a run folder (docs/ARCHITECTURE.md "Run folder"), named once:
    ``RunFolder(cfg.run_dir).eval_dir("trained").summary``. Paths only; nothing is
    created or read here."""

    @property
    def config(self) -> Path:
        """``config.yaml``: the resolved config the run saved."""
        return self.root / "config.yaml"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def lock(self) -> Path:
        """``run.lock``: held (``flock``) by the ``rlver run`` writing the folder; holds its pid."""
        return self.root / "run.lock"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    @property
    def notebooks(self) -> Path:
        """The executed notebooks (``rank<r>/`` inside for other ranks of a launch)."""
        return self.root / "notebooks"

    def rank_notebooks(self, rank: int) -> Path:
        """``notebooks/rank<r>/``: what another rank of a launch executed, with its ``config.yaml``."""
        return self.notebooks / f"rank{rank}"

    @property
    def figures(self) -> Path:
        return self.root / "figures"

    def scenarios(self, split: str) -> Path:
        """``scenarios/<split>.jsonl`` (``train`` or ``test``) as notebook 01 wrote it."""
        return self.root / "scenarios" / f"{split}.jsonl"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    def eval_dir(self, label: str) -> EvalFolder:
        """``eval/<label>/``: one benchmark (``baseline``, ``trained``)."""
        return EvalFolder(self.eval / label)

    def eval_dirs(self) -> list[EvalFolder]:
        """Every ``eval/<label>/`` folder, sorted by label."""
        return [EvalFolder(p) for p in sorted(self.eval.iterdir()) if p.is_dir()] if self.eval.is_dir() else []

    def summaries(self) -> list[Path]:
        """Every ``eval/<label>/summary.json`` there is, sorted by label."""
        return [b.summary for b in self.eval_dirs() if b.summary.is_file()]

    def eval_trajectories(self) -> list[Path]:
        """Every ``eval/<label>/trajectory.csv`` there is, sorted by label."""
        return [b.trajectory for b in self.eval_dirs() if b.trajectory.is_file()]

    def eval_figure(self, label: str, kind: str) -> Path:
        """``figures/eval_<label>_<kind>.png``: a benchmark's figure (``trajectory``, ``breakdown``)."""
        return self.figures / f"eval_{label}_{kind}.png"

    @property
    def paired(self) -> Path:
        """``eval/paired.json``: trained minus baseline on the same scenarios."""
        return self.eval / "paired.json"

    def analysis_table(self, name: str) -> Path:
        """``analysis/<name>.csv``."""
        return self.root / "analysis" / f"{name}.csv"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def metrics_csv(self) -> Path:
        """``train/metrics.csv``: :attr:`metrics` as a table."""
        return self.train / "metrics.csv"

    @property
    def tensorboard(self) -> Path:
        """``train/tensorboard/``: the event files when ``training.tensorboard`` is on."""
        return self.train / "tensorboard"

    @staticmethod
    def step_name(step: int) -> str:
        """``step_NNNNNN``: a training step's name (its dialogues file, its checkpoint folder)."""
        return f"step_{step:06d}"

    @property
    def train_dialogues(self) -> Path:
        """``train/dialogues/``: one ``step_NNNNNN.jsonl`` per training step."""
        return self.train / "dialogues"

    def step_dialogues_file(self, step: int, *, failed: bool = False) -> Path:
        """``train/dialogues/step_NNNNNN.jsonl``; ``step_NNNNNN.failed.jsonl`` for the
        dialogues of a step stopped by a dead simulator (never trained)."""
        return self.train_dialogues / f"{self.step_name(step)}{'.failed' if failed else ''}.jsonl"

    def step_dialogues(self) -> list[Path]:
        """Every trained step's ``train/dialogues/step_*.jsonl``, sorted by step; a
        dead simulator's ``step_*.failed.jsonl`` (never trained, and redone under the
        same step number on resume) is left out."""
        return sorted(p for p in self.train_dialogues.glob("step_*.jsonl") if not p.name.endswith(".failed.jsonl"))

    @property
    def checkpoints(self) -> Path:
        """``train/checkpoints/``: the run's checkpoints (:mod:`rlver_lib.checkpoint`)."""
        return self.train / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        """``train/checkpoints/step_NNNNNN/``: the checkpoint after ``step`` (:class:`CheckpointFolder`)."""
        return self.checkpoints / self.step_name(step)

    @property
    def adapter(self) -> Path:
        """``train/adapter/``: the final LoRA adapter."""
        return self.train / "adapter"

    @property
    def adapter_config(self) -> Path:
        """``train/adapter/adapter_config.json`` (:data:`ADAPTER_CONFIG`): there once the final adapter is saved."""
        return self.adapter / ADAPTER_CONFIG


@dataclass(frozen=True)
class EvalFolder(Folder):
    """One benchmark's files: ``eval/<label>/`` of a run folder (:meth:`RunFolder.eval_dir`),
    or any folder a benchmark is written to (``out_dir`` of
    :func:`rlver_lib.evaluation.benchmark.run_benchmark`). docs/ARCHITECTURE.md "Run
    folder". Paths only."""

    @property
    def dialogues(self) -> Path:
        """``dialogues.jsonl``: one dialogue record per line (docs/ARCHITECTURE.md "Records")."""
        return self.root / "dialogues.jsonl"

    @property
    def summary(self) -> Path:
        """``summary.json``: the benchmark's figures, its judge and protocol."""
        return self.root / "summary.json"

    @property
    def breakdown(self) -> Path:
        """``breakdown.csv``: the figures per level of each breakdown factor (``benchmark.breakdown_table``)."""
        return self.root / "breakdown.csv"

    @property
    def trajectory(self) -> Path:
        """``trajectory.csv``: the mean emotion (points) per turn (``benchmark.trajectory_table``)."""
        return self.root / "trajectory.csv"

    @property
    def capability(self) -> Path:
        """``capability.json``: the capability-retention headline figures."""
        return self.root / "capability.json"

    @property
    def humaneval(self) -> Path:
        """``humaneval.jsonl``: one HumanEval problem's outcome per line."""
        return self.root / "humaneval.jsonl"

    @property
    def math(self) -> Path:
        """``math.json``: the maths accuracy with its interval and every item."""
        return self.root / "math.json"

    @property
    def lm_eval(self) -> Path:
        """``lm_eval.json``: the ``lm-eval`` harness's results per task."""
        return self.root / "lm_eval.json"


@dataclass(frozen=True)
class AblationFolder(Folder):
    """An ablation's folder, ``<output_root>/<grid name>/`` (RLVER §5): the grid file,
    one run folder per cell, and the comparison's notebook and report where a run keeps
    its own (:class:`RunFolder`). Paths only."""

    @property
    def grid(self) -> Path:
        """``grid.yaml``: a copy of the grid file the ablation ran."""
        return self.root / "grid.yaml"

    @property
    def notebooks(self) -> Path:
        """``notebooks/``: the executed comparison notebook."""
        return RunFolder(self.root).notebooks

    @property
    def report(self) -> Path:
        """``report.html``: the comparison of the cells."""
        return RunFolder(self.root).report

    def cell(self, name: str) -> RunFolder:
        """``<cell>/``: one cell's run folder."""
        return RunFolder(self.root / name)

    def cells(self) -> list[RunFolder]:
        """Every cell that has started (its ``config.yaml`` written), sorted by name."""
        return [RunFolder(p) for p in sorted(self.root.iterdir()) if RunFolder(p).config.is_file()] \
            if self.root.is_dir() else []


@dataclass(frozen=True)
class CheckpointFolder(Folder):
    """Our files in one checkpoint folder, ``train/checkpoints/step_NNNNNN/``, beside
    what accelerate saves there (:mod:`rlver_lib.checkpoint`). Paths only."""

    @property
    def adapter(self) -> Path:
        """``adapter/``: the LoRA adapter at this step (``peft`` ``save_pretrained``)."""
        return self.root / "adapter"

    @property
    def config(self) -> Path:
        """``config.yaml``: the run's resolved config."""
        return self.root / "config.yaml"

    @property
    def state(self) -> Path:
        """``trainer_state.json``: step, data position, algorithm, number of processes;
        its presence marks the checkpoint complete."""
        return self.root / "trainer_state.json"
