"""Atomic file output and JSON Lines reading/writing shared by every module.

Writes go to a temporary file in the target folder and are renamed into place,
so an interrupted run never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

_UMASK = os.umask(0)
os.umask(_UMASK)


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
