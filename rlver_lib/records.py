"""The stored dialogue record, ours and SAGE's: one reader (docs/ARCHITECTURE.md "Records").

Our records (``dialogues.jsonl`` of ``eval/<label>/`` and ``train/dialogues/step_*.jsonl``)
carry ``final_emotion`` and a ``transcript`` (``turns`` in older run folders); SAGE's
result records carry ``emo_point`` and a ``history``. :func:`dialogue_view` reads either
as a :class:`DialogueView` (emotion in points [0, 100]); :func:`policy_turns` lists the
policy replies of one of ours with the appraisal that followed each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlver_lib.files import iter_jsonl
from rlver_lib.scenarios import INTENTION_BY_ZH, PERSONALITY_BY_ZH, detect_language


def policy_turns(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Policy turns of one of our records (transcript ``turns``): per assistant entry
    ``index`` (its position in ``turns``), ``turn`` (1-based), ``user`` (the message
    it answered), ``reply``, and from the appraisal that followed it ``change``,
    ``emotion_before`` and ``emotion`` (``None`` when it was not appraised)."""
    turns = record_transcript(record)
    out = []
    for i, entry in enumerate(turns):
        if entry.get("role") != "assistant":
            continue
        before = turns[i - 1] if i and turns[i - 1].get("role") == "user" else {}
        after = turns[i + 1] if i + 1 < len(turns) and turns[i + 1].get("role") == "user" else {}
        out.append({"index": i, "turn": len(out) + 1, "user": before.get("content"),
                    "reply": entry.get("content") or "", "change": after.get("change"),
                    "emotion_before": after.get("emotion_before"), "emotion": after.get("emotion")})
    return out


UNKNOWN = "unknown"


class RecordError(ValueError):
    """A dialogue record that is neither one of ours nor a SAGE result record."""


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DialogueView:
    """The benchmark-relevant view of one dialogue record, whatever its format.

    ``emotions``: [initial, after turn 1, ..., after turn k] in emotion points.
    ``scenario_id``: the cluster for resampling (SAGE: the record ``id``);
    ``repeat``: which repeat of its scenario (0 for SAGE records).
    ``n_appraised``: policy replies followed by an emotion update;
    ``last_unappraised``: the transcript ends with a policy reply that was never
    appraised (SAGE's 10th reply), not counting a reply ended by a format violation.
    ``termination``: ours, or ``None`` for SAGE records.
    """

    final_emotion: float
    n_turns: int
    emotions: tuple[float, ...]
    hidden_intention: str
    personality: str
    language: str
    scenario_id: str = UNKNOWN
    repeat: int = 0
    n_appraised: int = 0
    last_unappraised: bool = False
    termination: str | None = None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _our_view(record: dict[str, Any]) -> DialogueView:
    turns = record_transcript(record)
    final = float(record["final_emotion"])
    start = record.get("initial_emotion")
    path = [float(start)] if _number(start) else []
    path += [float(t["emotion"]) for t in turns
             if t.get("role") == "user" and _number(t.get("emotion")) and _number(t.get("change"))]
    if not path or path[-1] != final:
        path.append(final)
    termination = record.get("termination")
    return DialogueView(
        final_emotion=final,
        n_turns=sum(t.get("role") == "assistant" for t in turns),
        emotions=tuple(path),
        hidden_intention=str(record.get("hidden_intention") or UNKNOWN),
        personality=str(record.get("personality") or UNKNOWN),
        language=str(record.get("language") or UNKNOWN),
        scenario_id=str(record.get("scenario_id") or record.get("dialogue_id") or UNKNOWN),
        repeat=int(record.get("repeat") or 0),
        n_appraised=sum(t.get("role") == "user" and _number(t.get("change")) for t in turns),
        last_unappraised=bool(turns) and turns[-1].get("role") == "assistant" and termination != "format_violation",
        termination=termination,
    )


def _sage_view(record: dict[str, Any]) -> DialogueView:
    history = record.get("history") or []
    final = float(record["emo_point"])
    path = [float(m["emotion-point"]) for m in history
            if m.get("role") == "user" and _number(m.get("emotion-point"))]
    if not path or path[-1] != final:
        path.append(final)
    task = str(record.get("task") or UNKNOWN)
    intention = INTENTION_BY_ZH.get(task, task)
    character = str(record.get("character") or UNKNOWN)
    personality = PERSONALITY_BY_ZH.get(character, character)
    appraised = sum(m.get("role") == "user" and _number(m.get("emotion-point"))
                    and i > 0 and history[i - 1].get("role") == "assistant" for i, m in enumerate(history))
    return DialogueView(
        final_emotion=final,
        n_turns=sum(m.get("role") == "assistant" for m in history),
        emotions=tuple(path),
        hidden_intention=intention,
        personality=personality,
        language=detect_language(task),
        scenario_id=str(record.get("id") or UNKNOWN),
        n_appraised=appraised,
        last_unappraised=bool(history) and history[-1].get("role") == "assistant",
    )


def dialogue_view(record: dict[str, Any]) -> DialogueView:
    """Read one record of either format (detected by ``final_emotion`` / ``emo_point``).

    Raises :class:`RecordError` when the record has neither field or it is not a number.
    """
    if _number(record.get("final_emotion")):
        return _our_view(record)
    if _number(record.get("emo_point")):
        return _sage_view(record)
    raise RecordError("record has neither a numeric 'final_emotion' (ours) nor 'emo_point' (SAGE)")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON Lines dialogue file (ours or SAGE), validated.

    Raises :class:`rlver_lib.files.JsonlError` on a bad line and :class:`RecordError`
    naming file and line for a record of neither format.
    """
    records = []
    for line, record in iter_jsonl(path):
        try:
            dialogue_view(record if isinstance(record, dict) else {})
        except RecordError as err:
            raise RecordError(f"{path}:{line}: {err}") from None
        records.append(record)
    return records


def scored_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (:func:`load_records`) that did not end in a simulator
    error, i.e. those a benchmark scores; ``[]`` when the file does not exist."""
    return [r for r in load_records(path) if r.get("termination") != "error"] if path.is_file() else []


def entry_mood(entry: dict[str, Any]) -> str | None:
    """The mood letter of a simulated-user transcript entry: ``mood``, or ``label`` in
    records written before the rename (older run folders); ``None`` when neither is set."""
    return entry.get("mood", entry.get("label"))


def record_transcript(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The transcript entries of a dialogue record: ``transcript``, or ``turns`` in
    records written before the rename (older run folders); ``[]`` when neither is set."""
    transcript = record.get("transcript")
    if transcript is None:
        transcript = record.get("turns")
    return list(transcript or [])
