"""Atomic file output, JSON Lines reading/writing and the user cache folder, shared by
every module.

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


@dataclass(frozen=True)
class RunFolder:
    """Every path of a run folder (docs/ARCHITECTURE.md "Run folder"), named once:
    ``RunFolder(cfg.run_dir).eval_dir("trained") / "summary.json"``. Paths only; nothing
    is created or read here."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

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

    def eval_dir(self, label: str) -> Path:
        """``eval/<label>/``: one benchmark (``baseline``, ``trained``)."""
        return self.eval / label

    def eval_dialogues(self, label: str) -> Path:
        return self.eval_dir(label) / "dialogues.jsonl"

    def eval_summary(self, label: str) -> Path:
        """``eval/<label>/summary.json``: the benchmark's figures and its judge."""
        return self.eval_dir(label) / "summary.json"

    def summaries(self) -> list[Path]:
        """Every ``eval/<label>/summary.json``, sorted."""
        return sorted(self.eval.glob("*/summary.json"))

    def eval_trajectories(self) -> list[Path]:
        """Every ``eval/<label>/trajectory.csv``, sorted."""
        return sorted(self.eval.glob("*/trajectory.csv"))

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


@dataclass(frozen=True)
class CheckpointFolder:
    """Our files in one checkpoint folder, ``train/checkpoints/step_NNNNNN/``, beside
    what accelerate saves there (:mod:`rlver_lib.checkpoint`). Paths only."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

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
