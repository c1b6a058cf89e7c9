"""SAGE transcript scoring: the benchmark's figures read off SAGE's stored result
records (``rlver sage-score``), detected per record by :mod:`rlver_lib.records`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.evaluation.benchmark import transcript_protocol
from rlver_lib.files import EvalFolder, JsonlError
from rlver_lib.records import RecordError, dialogue_view, load_records

# --------------------------------------------------------------------------- SAGE scoring


def sage_score(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Score transcript files: SAGE result files or our ``dialogues.jsonl`` (detected).

    One row per file with ``file`` (name), ``model`` (name without ``_result`` /
    extension, or the parent folder for ``dialogues.jsonl``), ``n``,
    ``sentient_score`` (mean final emotion, 0-100), ``success`` (final >= 100) and
    ``failure`` (final < 10) counts, and the ``protocol`` the transcripts follow
    (:func:`transcript_protocol`: ``sage`` when capped dialogues end with an
    unappraised reply, else ``full``) with ``policy_replies`` / ``appraised_replies``.
    Files are read as JSON Lines (``\\n``-separated).
    Raises ``FileNotFoundError``, :class:`rlver_lib.files.JsonlError` or
    :class:`RecordError` (file and line named).
    """
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        views = [dialogue_view(r) for r in load_records(path)]
        if not views:
            raise RecordError(f"{path}: no dialogue records")
        final = np.array([v.final_emotion for v in views])
        protocol = transcript_protocol(views)
        model = path.parent.name if path == EvalFolder(path.parent).dialogues else re.sub(r"_result$", "", path.stem)
        rows.append({
            "file": path.name, "model": model, "n": int(final.size),
            "sentient_score": float(final.mean()),
            "success": int((final >= SUCCESS_EMOTION).sum()),
            "failure": int((final < FAILURE_EMOTION).sum()),
            "protocol": protocol["protocol"],
            "policy_replies": protocol["policy_replies"],
            "appraised_replies": protocol["appraised_replies"],
        })
    return pd.DataFrame(rows, columns=["file", "model", "n", "sentient_score", "success", "failure",
                                       "protocol", "policy_replies", "appraised_replies"])


def sage_score_command(paths: Sequence[str | Path], as_json: bool = False) -> int:
    """``rlver sage-score FILE ... [--json]``: print the :func:`sage_score` table, then
    which protocol each file follows.

    Returns 0, or 2 after printing the error to stderr when a file is missing or bad.
    """
    try:
        table = sage_score(paths)
    except (FileNotFoundError, JsonlError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(table.to_dict(orient="records"), ensure_ascii=False, indent=2))
        return 0
    print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    for row in table.itertuples():
        what = ("SAGE's turn rule: capped dialogues end with a reply that was never appraised"
                if row.protocol == "sage" else "every policy reply was appraised")
        print(f"{row.file}: protocol {row.protocol} ({what}; {row.appraised_replies} of "
              f"{row.policy_replies} replies appraised)")
    return 0
