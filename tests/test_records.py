"""The stored dialogue record (rlver_lib.records): one reader for ours and SAGE's, and
older run folders still read after a key was renamed."""

from __future__ import annotations

from rlver_lib.records import dialogue_view, entry_mood, policy_turns, record_transcript
from rlver_lib.rollout import Trajectory


def test_records_hold_the_transcript_and_old_records_still_read():
    transcript = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "ok", "change": 5, "emotion": 45, "label": "B"}]
    record = Trajectory("a#0", "a", "a", transcript, final_emotion=45, reward=0.45,
                        termination="max_turns", initial_emotion=40).to_record()
    assert record["transcript"] == transcript and "turns" not in record and record["policy_turns"] == 1
    old = {k: v for k, v in record.items() if k != "transcript"} | {"turns": transcript}  # an older run folder
    assert record_transcript(record) == record_transcript(old) == transcript
    assert record_transcript({"final_emotion": 3}) == []
    assert dialogue_view(old).emotions == dialogue_view(record).emotions == (40.0, 45.0)


def test_the_mood_letter_reads_from_new_and_old_entries():
    assert entry_mood({"role": "user", "mood": "B"}) == entry_mood({"role": "user", "label": "B"}) == "B"
    assert entry_mood({"role": "user"}) is None


def test_policy_turns_pair_each_reply_with_its_appraisal():
    transcript = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                  {"role": "user", "content": "ok", "change": 5, "emotion_before": 40, "emotion": 45}]
    (turn,) = policy_turns({"transcript": transcript})
    assert (turn["turn"], turn["user"], turn["reply"], turn["change"], turn["emotion"]) == (1, "hi", "hello", 5, 45)
