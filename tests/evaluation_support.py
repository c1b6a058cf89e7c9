"""What the tests of rlver_lib.evaluation share: stored dialogue records, a scripted
policy, the scenarios the benchmark runs on."""

from __future__ import annotations

from reference_data import rlver_test_profiles

from rlver_lib.backends import Generation


def our_record(final, emotions, **extra):
    """One of our records: opening, then per emotion an assistant and a user entry."""
    turns = [{"role": "user", "content": "hello"}]
    before = 40
    for e in emotions:
        turns += [{"role": "assistant", "content": "reply"},
                  {"role": "user", "content": "ok", "change": e - before, "emotion_before": before, "emotion": e}]
        before = e
    return {"dialogue_id": f"d{final}", "scenario_id": "s", "initial_emotion": 40, "turns": turns,
            "final_emotion": final, "reward": final / 100, "termination": "max_turns", **extra}


FIXTURE = [
    our_record(100, [70, 100], hidden_intention="be_heard", personality="negative", language="en"),
    our_record(5, [5], hidden_intention="be_heard", personality="passive", language="zh"),
    our_record(60, [50, 55, 60], hidden_intention="deep_empathy", personality="negative", language="en"),
]


class ScriptedPolicy:
    """Replies by scenario (keyed on the opening line): ``ask`` always ends with a
    question, ``tell`` never does, ``alternate`` asks on odd policy turns."""

    def __init__(self, mode_by_opening):
        self.mode_by_opening = mode_by_opening

    def generate(self, conversations, sampling, json_schema=None):
        out = []
        for conv in conversations:
            opening = next(m["content"] for m in conv if m["role"] == "user")
            mode = self.mode_by_opening[opening]
            n_prev = sum(m["role"] == "assistant" for m in conv)
            ask = mode == "ask" or (mode == "alternate" and n_prev % 2 == 0)
            out.append(Generation(text="How do you feel about it?" if ask else "I see."))
        return out


def three_scenarios():
    return rlver_test_profiles(3)


def scored(sid, repeat, final, termination="max_turns"):
    return {"dialogue_id": f"{sid}#{repeat}", "scenario_id": sid, "repeat": repeat, "initial_emotion": 40,
            "turns": [], "final_emotion": final, "termination": termination}
