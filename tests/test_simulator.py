"""The affective simulated user: update rule, structured parsing, bounded retries, seeding.

Model-free (scripted fake backends); runs in about a second.
"""

from __future__ import annotations

import json

import pytest

from rlver_lib.appraisal import (
    APPRAISAL_MODES,
    AppraisalMode,
    SampledMode,
    SimulatorError,
    apply_change,
    mood_for,
    parse_appraisal,
    parse_reply,
    structured_schemas,
)
from rlver_lib.backends import BackendError, Generation, StructuredResult, derive_seed
from rlver_lib.config import SimulatorConfig
from rlver_lib.scenarios import Scenario
from rlver_lib.simulator import RuleSimulator, UserSimulator, default_change_fn
from rlver_lib.user_prompts import SimulatorRequest, prompt_files


def sampled(**fields) -> SimulatorConfig:
    """A simulator config with the sampled first-person appraisal (the scripted backends
    answer JSON, not next-token log-probs)."""
    return SimulatorConfig(appraisal="first_person", **fields)


def scenario(sid: str = "s1", language: str = "en", opening_line: str | None = "I had a rough day.") -> Scenario:
    return Scenario(
        id=sid, persona=f"Persona of {sid}, a night-shift nurse", situation="Her manager blamed her for a mix-up.",
        personality="negative", hidden_intention="not_at_fault", opening_line=opening_line, language=language,
    )


def request(sid: str = "s1", emotion: int = 50, turn: int = 0, reply: str = "That sounds hard.", language: str = "en"):
    history = [{"role": "user", "content": "I had a rough day."}, {"role": "assistant", "content": reply}]
    return SimulatorRequest(f"{sid}#0", scenario(sid, language), history, emotion, turn)


def appraisal_json(change: int, **extra) -> str:
    return json.dumps({"reply_meaning": "PRIVATE-MEANING", "intention_fit": "PRIVATE-FIT",
                       "inner_reaction": "PRIVATE-REACTION", "change": change, **extra})


def reply_json(message: str | None = "Thanks.", end: bool = False) -> str:
    obj = {"reasoning": "PRIVATE-REASONING", "end_conversation": end}
    if message is not None:
        obj["message"] = message
    return json.dumps(obj)


class ScriptedBackend:
    """Answers by schema: the appraise schema has 'change', the reply schema 'end_conversation'.

    ``appraise`` / ``reply`` are lists of outputs consumed per call (the last one repeats);
    every call's conversations, sampling and schema are recorded.
    """

    def __init__(self, appraise: list[str], reply: list[str] | None = None, opening: list[str] | None = None):
        self.outputs = {"change": list(appraise), "end_conversation": list(reply or [reply_json()]),
                        "message": list(opening or ['{"message": "Hello there."}'])}
        self.calls: list[tuple[list, object, dict | None]] = []

    def generate(self, conversations, sampling, json_schema=None):
        self.calls.append((conversations, sampling, json_schema))
        key = next(k for k in ("change", "end_conversation", "message") if k in json_schema["properties"])
        queue = self.outputs[key]
        text = queue.pop(0) if len(queue) > 1 else queue[0]
        return [Generation(text=text) for _ in conversations]


class FailingBackend:
    def __init__(self):
        self.n_calls = 0

    def generate(self, conversations, sampling, json_schema=None):
        self.n_calls += 1
        raise BackendError("connection refused")


# --------------------------------------------------------------------------- update rule

@pytest.mark.parametrize("e, mood", [(100, "S"), (99, "A"), (70, "A"), (69, "B"), (40, "B"),
                                      (39, "C"), (10, "C"), (9, "F"), (0, "F")])
def test_mood_thresholds(e, mood):
    assert mood_for(e) == mood


@pytest.mark.parametrize("e, change, expected", [
    (50, 7, (7, 57)),
    (50, 25, (10, 60)),      # change clamped to +10
    (50, -50, (-10, 40)),    # the reference code's -50 turn: clamped to -10
    (95, 10, (10, 100)),     # ceiling
    (4, -10, (-10, 0)),      # floor
    (100, 3, (3, 100)),
])
def test_apply_change_clamps_change_then_emotion(e, change, expected):
    assert apply_change(e, change) == expected


@pytest.mark.parametrize("e, change", [(50, None), (50, True), ("50", 1)])
def test_apply_change_rejects_non_numbers(e, change):
    with pytest.raises(TypeError):
        apply_change(e, change)


def test_default_change_fn():
    assert default_change_fn("How do you feel?") == 10
    assert default_change_fn("你还好吗？ ") == 10
    assert default_change_fn("Get over it.") == -5


def test_derive_seed_is_stable_and_distinguishes_parts():
    assert derive_seed(0, "appraise", 1, 0) == derive_seed(0, "appraise", 1, 0)
    assert len({derive_seed(0, "appraise", t, a) for t in range(5) for a in range(3)}) == 15
    assert 0 <= derive_seed("x") < 2**31


# --------------------------------------------------------------------------- parsing

def test_parse_appraisal_accepts_valid_and_code_fenced_output():
    assert parse_appraisal(appraisal_json(-3))["change"] == -3
    assert parse_appraisal("```json\n" + appraisal_json(4) + "\n```")["change"] == 4
    raw_newline = '{"reply_meaning": "line one\nline two", "intention_fit": "f", "inner_reaction": "r", "change": 0}'
    assert parse_appraisal(raw_newline)["reply_meaning"] == "line one\nline two"


@pytest.mark.parametrize("text, problem", [
    ("I feel better", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"reply_meaning": "a", "intention_fit": "b", "change": 2}), "inner_reaction"),
    (appraisal_json(11), "not on the scale"),
    (appraisal_json(-11), "not on the scale"),
    (appraisal_json("5"), "not an integer"),
    (appraisal_json(True), "not an integer"),
])
def test_parse_appraisal_rejects_unusable_output(text, problem):
    with pytest.raises(SimulatorError, match=problem):
        parse_appraisal(text)


def test_parse_reply_never_falls_back_to_reasoning():
    with pytest.raises(SimulatorError, match="message"):
        parse_reply(reply_json(message=None))
    with pytest.raises(SimulatorError, match="empty"):
        parse_reply(reply_json(message="  "))
    with pytest.raises(SimulatorError, match="end_conversation"):
        parse_reply(json.dumps({"reasoning": "r", "message": "m", "end_conversation": "yes"}))
    assert parse_reply(reply_json("Bye.", end=True)) == {"reasoning": "PRIVATE-REASONING", "message": "Bye.",
                                                          "end_conversation": True}


# --------------------------------------------------------------------------- UserSimulator

def test_step_applies_update_rule_and_records_everything():
    backend = ScriptedBackend([appraisal_json(8)], [reply_json("You get it. Thanks, bye!", end=True)])
    sim = UserSimulator(backend, sampled(), seed=3)
    [turn] = sim.step([request(emotion=95)])
    # 95 + 8 = 103 -> ceiling 100
    assert (turn.raw_change, turn.change, turn.emotion_before, turn.emotion, turn.mood) == (8, 8, 95, 100, "S")
    assert turn.reply == "You get it. Thanks, bye!" and turn.goodbye is True
    assert turn.appraisal["intention_fit"] == "PRIVATE-FIT" and turn.appraisal["reply_reasoning"] == "PRIVATE-REASONING"
    assert turn.attempts == 2 and len(turn.raw_outputs) == 2 and turn.error is None
    # one batched appraise call, one batched reply call; the reply prompt shows the updated label S
    assert len(backend.calls) == 2
    reply_prompt = backend.calls[1][0][0][1]["content"]
    assert "mood S" in reply_prompt and "say goodbye" in reply_prompt
    assert backend.calls[0][2]["properties"]["change"]["enum"] == list(range(-10, 11))


@pytest.mark.timeout(30)
def test_garbage_output_is_retried_then_recorded_as_error():
    backend = ScriptedBackend(["not json at all"])
    sim = UserSimulator(backend, sampled(max_retries=2), seed=0)
    [turn] = sim.step([request(emotion=50)])
    assert turn.attempts == 3 and turn.raw_outputs == ["not json at all"] * 3 and len(turn.failures) == 3
    assert turn.error is not None and "appraisal" in turn.error
    assert turn.change is None and turn.raw_change is None and turn.emotion == 50 and turn.reply is None
    assert len(backend.calls) == 3  # no reply call after a failed appraisal
    # each retry is a fresh seed
    assert len({call[1].seed for call in backend.calls}) == 3


@pytest.mark.timeout(30)
def test_backend_errors_are_bounded_and_recorded():
    backend = FailingBackend()
    [turn] = UserSimulator(backend, sampled(max_retries=1), seed=0).step([request()])
    assert backend.n_calls == 2 and turn.attempts == 2 and turn.raw_outputs == []
    assert "connection refused" in turn.error


def test_retry_succeeds_after_an_unusable_output():
    backend = ScriptedBackend(["{broken", appraisal_json(-4)])
    [turn] = UserSimulator(backend, sampled(max_retries=2), seed=0).step([request(emotion=50)])
    assert turn.error is None and turn.change == -4 and turn.emotion == 46
    assert turn.raw_outputs[0] == "{broken" and turn.attempts == 3  # 2 appraise + 1 reply
    assert turn.failures == [turn.failures[0]] and turn.failures[0].startswith("appraise attempt 1")


def test_missing_reply_field_is_a_failure_not_a_leak():
    backend = ScriptedBackend([appraisal_json(3)], [reply_json(message=None)])
    [turn] = UserSimulator(backend, sampled(max_retries=2), seed=0).step([request(emotion=50)])
    assert turn.reply is None and turn.error is not None and "reply" in turn.error
    assert turn.attempts == 1 + 3
    assert turn.change == 3 and turn.emotion == 53  # the appraisal itself was genuine


def test_out_of_range_change_is_unusable_not_clamped():
    backend = ScriptedBackend([appraisal_json(-50)])
    [turn] = UserSimulator(backend, sampled(max_retries=0), seed=0).step([request(emotion=50)])
    assert turn.attempts == 1 and turn.error is not None and turn.emotion == 50 and turn.change is None


class SeedEcho:
    """Output depends only on (seed, conversation), like a per-conversation seeded sampler."""

    def generate(self, conversations, sampling, json_schema=None):
        out = []
        for conv in conversations:
            change = derive_seed(sampling.seed, json.dumps(conv)) % 21 - 10
            text = appraisal_json(change) if "change" in json_schema["properties"] else reply_json(f"msg {change}")
            out.append(Generation(text=text))
        return out


def test_results_do_not_depend_on_batch_composition():
    sim = UserSimulator(SeedEcho(), sampled(), seed=11)
    alone = sim.step([request("a", turn=2)])[0]
    batched = sim.step([request("b", turn=2), request("c", turn=2), request("a", turn=2)])[2]
    assert (alone.change, alone.reply, alone.raw_outputs) == (batched.change, batched.reply, batched.raw_outputs)
    other_seed = UserSimulator(SeedEcho(), sampled(), seed=12).step([request("a", turn=2)])[0]
    assert other_seed.raw_outputs != alone.raw_outputs


def test_appraise_only_matches_step_and_has_no_reply():
    sim = UserSimulator(SeedEcho(), sampled(), seed=5)
    only = sim.appraise([request("a")])[0]
    full = sim.step([request("a")])[0]
    assert only.reply is None and only.goodbye is False and only.error is None
    assert (only.change, only.emotion) == (full.change, full.emotion)


def test_prompts_follow_language_and_difficulty():
    backend = ScriptedBackend([appraisal_json(1)])
    for difficulty in ("easy", "hard"):
        UserSimulator(backend, sampled(difficulty=difficulty), seed=0).step([request(language="zh")])
    easy, hard = backend.calls[0][0][0], backend.calls[2][0][0]
    assert "你正在扮演" in easy[0]["content"] and "评估助手的最新回复" in easy[1]["content"]
    assert "宽容" in easy[1]["content"] and "拿不准时，选择负的变化" in hard[1]["content"]
    assert "宽容" not in hard[1]["content"]
    # the hidden intention and the transcript are in the prompt
    assert scenario(language="zh").intention_text in easy[0]["content"]
    assert "That sounds hard." in easy[1]["content"]


def test_history_must_end_with_policy_reply():
    bad = request()
    bad.history = bad.history[:1]
    with pytest.raises(ValueError, match="policy reply"):
        UserSimulator(ScriptedBackend([appraisal_json(1)]), sampled(), seed=0).step([bad])


def test_opening_lines_given_generated_or_none():
    given, missing = scenario("g"), scenario("m", opening_line=None)
    backend = ScriptedBackend([appraisal_json(0)], opening=['{"message": "Can we talk?"}'])
    lines = UserSimulator(backend, sampled(), seed=0).opening_lines([given, missing])
    assert lines == ["I had a rough day.", "Can we talk?"]
    assert len(backend.calls) == 1 and len(backend.calls[0][0]) == 1  # only the missing one is generated
    broken = ScriptedBackend([appraisal_json(0)], opening=['{"text": "wrong field"}'])
    assert UserSimulator(broken, sampled(max_retries=1), seed=0).opening_lines([missing]) == [None]
    assert len(broken.calls) == 2


def test_rule_simulator_clamps_and_scripts_replies():
    sim = RuleSimulator(lambda reply: 40 if "!" in reply else -40,
                        reply_fn=lambda req, e: (f"now {e}", e >= 60))
    up, down = sim.step([request("a", emotion=55, reply="Great!"), request("b", emotion=15, reply="No.")])
    assert (up.raw_change, up.change, up.emotion, up.reply, up.goodbye) == (40, 10, 65, "now 65", True)
    assert (down.raw_change, down.change, down.emotion, down.mood, down.goodbye) == (-40, -10, 5, "F", False)
    assert RuleSimulator().opening_lines([scenario(opening_line=None, language="zh")])[0].startswith("你好")


def _rendered(messages) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages)


@pytest.mark.parametrize("language", ["en", "zh"])
def test_prompt_prefix_is_stable_across_calls_and_turns(language):
    from rlver_lib.user_prompts import appraise_messages, reply_messages

    opening = {"role": "user", "content": "I had a rough day."}
    turn0 = SimulatorRequest("s1#0", scenario("s1", language), [opening, {"role": "assistant", "content": "Oh no."}],
                             50, 0)
    later = [*turn0.history, {"role": "user", "content": "It was my manager."},
             {"role": "assistant", "content": "What happened?"}]
    turn1 = SimulatorRequest("s1#0", scenario("s1", language), later, 57, 1)
    appraisal = {"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r"}
    first = appraise_messages(turn0, "moderate")
    # everything up to the end of turn 0's transcript is shared by turn 0's reply call
    # and by turn 1's appraise call, although the score changed from 50 to 57
    transcript_end = first[1]["content"].index(turn0.history[-1]["content"]) + len(turn0.history[-1]["content"])
    shared = _rendered(first)[: len(f"<system>{first[0]['content']}<user>") + transcript_end]
    assert "50" not in first[0]["content"]  # no score in the static part
    assert _rendered(reply_messages(turn0, appraisal, 57)).startswith(shared)
    assert _rendered(appraise_messages(turn1, "moderate")).startswith(shared)
    assert "57" in appraise_messages(turn1, "moderate")[1]["content"]


@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("difficulty", ["easy", "moderate", "hard"])
def test_every_difficulty_penalises_non_natural_language(language, difficulty):
    from rlver_lib.user_prompts import appraise_messages

    text = appraise_messages(request(language=language), difficulty)[1]["content"]
    assert ("not natural language" in text) if language == "en" else ("不是自然语言" in text)
    assert "-8" in text and "-10" in text


def test_reply_step_rules_follow_personality():
    from rlver_lib.user_prompts import reply_messages

    appraisal = {"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r"}
    passive = SimulatorRequest("p#0", scenario("p").model_copy(update={"personality": "passive"}),
                               request().history, 50, 0)
    text = reply_messages(passive, appraisal, 50)[1]["content"]
    assert "do not ask the assistant questions" in text
    assert "never the assistant" in text and "Do not repeat" in text
    negative = reply_messages(request(), appraisal, 50)[1]["content"]
    assert "do not ask the assistant questions" not in negative and "push back" in negative


def test_field_caps_are_settings():
    from rlver_lib.appraisal import appraisal_schema

    sent = []

    class Recording:
        def generate(self, conversations, sampling, json_schema=None):
            sent.append(json_schema)
            out = {"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r", "change": 1}
            if "message" in json_schema["properties"]:
                out = {"reasoning": "x", "message": "ok", "end_conversation": False}
            return [Generation(text=json.dumps(out)) for _ in conversations]

    cfg = sampled(appraisal_chars=900, message_chars=1500)
    UserSimulator(Recording(), cfg).step([request()])
    assert sent[0] == appraisal_schema(900)
    assert sent[0]["properties"]["reply_meaning"]["maxLength"] == 900
    assert sent[1]["properties"]["message"]["maxLength"] == 1500


# --------------------------------------------------------------------------- expected-value appraisal

import math  # noqa: E402

from rlver_lib.appraisal import GUARD_FLOOR, expected_change  # noqa: E402
from rlver_lib.backends import BackendError as _BackendError  # noqa: E402
from rlver_lib.backends import UnusableOutput, answer_probability  # noqa: E402
from rlver_lib.simulator import fit_history  # noqa: E402
from rlver_lib.user_prompts import checklist, checklist_messages, shorten_history  # noqa: E402

EXPECTED = SimulatorConfig(appraisal="expected", expected_center=0.6, expected_scale=50.0,
                           expected_answer_order="both", expected_questions=["on_situation", "understood", "intention"])


class ScriptedScorer(ScriptedBackend):
    """A next-token scorer: P(yes) per question from ``p_yes[key]``, read off the question
    text (the checklist's wording), as log-probs over "Yes" / " no" / "The" tokens."""

    def __init__(self, p_yes: dict[str, float], fail: set[str] = frozenset(), reply=None):
        super().__init__([appraisal_json(0)], reply or [json.dumps({"message": "Hm.", "end_conversation": False})])
        self.p_yes, self.fail, self.scored = p_yes, fail, []

    def next_token_logprobs(self, conversations, top_n=20):
        out, errors = [], []
        for conv in conversations:
            key = next(k for k, q in self._questions.items() if q in conv[-1]["content"])
            self.scored.append((key, conv))
            if key in self.fail:
                out.append(None)
                errors.append(f"HTTP 400: {key} too long")
                continue
            # a position bias: the answer named first gains 0.05, which averaging both orders cancels
            p = self.p_yes[key] + (-0.05 if "no or yes" in conv[-1]["content"] else 0.05) * (0 < self.p_yes[key] < 1)
            # 10 % of the mass on an unrelated token: P(yes | yes or no) must renormalise it away
            top = {"Yes": 0.9 * p, " no": 0.9 * (1 - p), "The": 0.1}
            out.append({token: math.log(q) for token, q in top.items() if q > 0})
            errors.append(None)
        if any(e for e in errors):
            raise _BackendError("some failed", results=out, errors=errors)
        return out

    def bind(self, scenario_):
        self._questions = {q.key: q.text for q in checklist(scenario_)}
        return self


def test_answer_probability_sums_variants_and_renormalises():
    top = {"Yes": math.log(0.5), " yes": math.log(0.1), "No": math.log(0.2), "Maybe": math.log(0.2)}
    assert answer_probability(top) == pytest.approx(0.6 / 0.8)
    with pytest.raises(UnusableOutput, match="neither yes nor no"):
        answer_probability({"Maybe": 0.0})


def test_expected_change_by_hand():
    # s = (0.9 + 0.7) / 2 = 0.8; 50 * (0.8 - 0.6) = 10 (at the cap); guard 0.9 >= 0.5: untouched
    assert expected_change([0.9, 0.7], 0.9, center=0.6, scale=50.0) == pytest.approx(10.0)
    # guard 0.2: weight 0.2 / 0.5 = 0.4: 0.4 * 10 + 0.6 * -10 = -2
    assert expected_change([0.9, 0.7], 0.2, center=0.6, scale=50.0) == pytest.approx(-2.0)
    # below the center: 50 * (0.5 - 0.6) = -5; guard 1: -5
    assert expected_change([0.5], 1.0, center=0.6, scale=50.0) == pytest.approx(-5.0)
    # gibberish: guard 0 -> -10 whatever the content
    assert expected_change([1.0], 0.0, center=0.6, scale=50.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError):
        expected_change([], 0.5, center=0.6, scale=50.0)
    with pytest.raises(ValueError):
        expected_change([1.2], 0.5, center=0.6, scale=50.0)


def test_apply_change_over_real_numbers():
    assert apply_change(40.0, -3.25) == (-3.25, 36.75)
    assert apply_change(99.5, 7.5) == (7.5, 100)
    assert apply_change(3, -12.5) == (-10, 0)
    with pytest.raises(ValueError):
        apply_change(50, float("nan"))


def test_checklist_has_the_intention_question_and_the_guard():
    questions = checklist(scenario())
    assert [q.key for q in questions] == ["on_situation", "understood", "intention", "guard"]
    assert "not at fault" in questions[2].text and questions[-1].guard
    zh = checklist(scenario(language="zh"))
    assert "没有错" in zh[2].text


def test_expected_appraisal_reads_probabilities_and_updates_by_hand():
    sc = scenario()
    backend = ScriptedScorer({"on_situation": 0.8, "understood": 0.7, "intention": 0.9, "guard": 0.95}).bind(sc)
    assert GUARD_FLOOR < 0.95
    [turn] = UserSimulator(backend, EXPECTED, seed=0).step([request(emotion=50)])
    # s = 0.8; 50 * (0.8 - 0.6) = 10; the guard (0.95) is above its floor
    assert turn.change == pytest.approx(10.0) and turn.emotion == pytest.approx(60.0)
    assert turn.appraisal["content_score"] == pytest.approx(0.8)
    rows = {r["key"]: r for r in turn.appraisal["checklist"]}
    assert rows["intention"]["p_yes"] == pytest.approx(0.9)
    assert rows["intention"]["p_yes_by_order"] == pytest.approx({"yes_no": 0.95, "no_yes": 0.85})
    assert "Yes" in rows["intention"]["top_logprobs"]["no_yes"]
    # the whole distribution is kept, in the raw outputs too: four questions, each in both orders
    assert len(backend.scored) == 8 and len(turn.raw_outputs) == 9  # 8 distributions + the reply
    # one round per (question, order): a round asks one question about every request
    assert [k for k, _ in backend.scored] == [k for k in ("on_situation", "understood", "intention", "guard")
                                              for _ in range(2)]
    # after a checklist the reply schema has no reasoning field and its prompt shows the answers
    reply_call = backend.calls[-1]
    assert "reasoning" not in reply_call[2]["properties"]
    assert "(0.90)" in reply_call[0][0][1]["content"]
    assert turn.reply == "Hm." and turn.error is None


def test_expected_appraisal_in_one_answer_order_keeps_its_bias():
    sc = scenario()
    probs = {"on_situation": 0.7, "understood": 0.7, "intention": 0.7, "guard": 1.0}
    one = EXPECTED.model_copy(update={"expected_answer_order": "no_yes"})
    backend = ScriptedScorer(probs).bind(sc)
    [turn] = UserSimulator(backend, one, seed=0).appraise([request()])
    # only "no or yes" asked: P(yes) 0.7 - 0.05 = 0.65 per question; 50 * (0.65 - 0.6) = 2.5
    assert len(backend.scored) == 4 and turn.change == pytest.approx(2.5)
    assert all("no or yes" in conv[-1]["content"] for _, conv in backend.scored)


def test_expected_appraisal_difficulty_moves_the_center():
    sc = scenario()
    probs = {"on_situation": 0.62, "understood": 0.62, "intention": 0.62, "guard": 1.0}
    changes = {d: UserSimulator(ScriptedScorer(probs).bind(sc), EXPECTED.model_copy(update={"difficulty": d}),
                                seed=0).appraise([request()])[0].change for d in ("easy", "moderate", "hard")}
    # 50 * (0.62 - (0.6 + shift)): easy +3.5, moderate +1, hard -1.5
    assert changes == pytest.approx({"easy": 3.5, "moderate": 1.0, "hard": -1.5})


def test_expected_appraisal_failed_question_fails_only_its_turn():
    a, b = request("a"), request("b", reply="Whatever.")
    backend = ScriptedScorer({"on_situation": 0.8, "understood": 0.7, "intention": 0.9, "guard": 1.0})
    backend._questions = {q.key: q.text for q in checklist(a.scenario)}
    # b's history is longer than a's: fail only b's questions by failing on its reply text
    original = backend.next_token_logprobs

    def flaky(conversations, top_n=20):
        results = original([c for c in conversations if "Whatever." not in c[-1]["content"]], top_n)
        it = iter(results)
        out = [None if "Whatever." in c[-1]["content"] else next(it) for c in conversations]
        errors = [None if r is not None else "HTTP 400: context" for r in out]
        if any(errors):
            raise _BackendError("one failed", results=out, errors=errors)
        return out

    backend.next_token_logprobs = flaky
    turns = UserSimulator(backend, EXPECTED.model_copy(update={"max_retries": 1}), seed=0).appraise([a, b])
    assert turns[0].error is None and turns[0].change == pytest.approx(10.0)
    assert turns[1].change is None and "HTTP 400: context" in turns[1].error
    assert turns[1].attempts == 16  # four questions in two orders, each sent twice (one retry)


def test_default_checklist_asks_the_configured_questions_and_the_guard():
    sc = scenario()
    backend = ScriptedScorer({"on_situation": 0.9, "understood": 0.8, "intention": 0.1, "guard": 1.0}).bind(sc)
    [turn] = UserSimulator(backend, SimulatorConfig(appraisal="expected", expected_center=0.8, expected_scale=100.0),
                           seed=0).appraise([request()])
    # default: on_situation and understood (one order each), then the guard; the intention is not asked
    assert [k for k, _ in backend.scored] == ["on_situation", "understood", "guard"]
    # s = (0.95 + 0.85) / 2 = 0.9 ("yes or no" adds the scripted 0.05); 100 * (0.9 - 0.8) = 10
    assert turn.change == pytest.approx(10.0)


def test_expected_mode_refuses_a_backend_without_logprobs():
    with pytest.raises(TypeError, match="next_token_logprobs"):
        UserSimulator(ScriptedBackend([appraisal_json(0)]), SimulatorConfig(appraisal="expected"))


def test_sage_mode_uses_sages_scale():
    backend = ScriptedBackend([appraisal_json(3), appraisal_json(-5)], [reply_json()])
    [turn] = UserSimulator(backend, SimulatorConfig(appraisal="sage", max_retries=1), seed=0).step([request()])
    assert backend.calls[0][2]["properties"]["change"]["enum"] == [-10, -5, 0, 5, 10]
    # +3 is off SAGE's scale: unusable, asked again, the -5 is kept
    assert turn.change == -5 and "not on the scale" in turn.failures[0]


def test_fit_history_leaves_out_oldest_exchanges_and_counts_them():
    history = [{"role": "user", "content": "opening"}]
    for k in range(4):
        history += [{"role": "assistant", "content": f"reply {k} " + "x" * 400},
                    {"role": "user", "content": f"user {k} " + "y" * 400}]
    history.append({"role": "assistant", "content": "last reply"})
    req = SimulatorRequest("d", scenario(), history, 50, 4)
    render = lambda r: [{"role": "user", "content": "\n".join(m["content"] for m in r.history)}]  # noqa: E731
    count = lambda convs: [len(c[0]["content"]) for c in convs]  # noqa: E731  one "token" per character
    fitted, dropped = fit_history(req, render, count, budget=1500)
    # 3,277 characters; 4 exchanges of 815: three must go (1,647 > 1,500 after two)
    assert dropped == 6
    assert fitted.history[0]["content"] == "opening" and fitted.history[-1]["content"] == "last reply"
    assert "6 earlier messages" in fitted.history[1]["content"] and fitted.history[2]["content"].startswith("reply 3")
    assert count([render(fitted)])[0] <= 1500
    with pytest.raises(Exception, match="context overflow"):
        fit_history(req, render, count, budget=20)
    assert shorten_history(history, 0, "en") == history


def test_checklist_questions_share_the_transcript_prefix_with_the_reply_call():
    from rlver_lib.user_prompts import reply_messages

    req = request()
    first, last = (checklist_messages(req, q) for q in (checklist(req.scenario)[0], checklist(req.scenario)[-1]))
    reply = reply_messages(req, {"reply_meaning": "m", "intention_fit": "f", "inner_reaction": "r"}, 55)
    end = first[1]["content"].index("That sounds hard.") + len("That sounds hard.")
    prefix = first[1]["content"][:end]
    assert last[1]["content"].startswith(prefix) and reply[1]["content"].startswith(prefix)
    assert first[0] == reply[0]
    assert "yes or no" in first[1]["content"] and "no or yes" in checklist_messages(req, checklist(req.scenario)[0],
                                                                                    "no_yes")[1]["content"]


# --------------------------------------------------------------------------- a new appraisal mode


class ThreePointMode(SampledMode):
    """A sampled mode on a three-point scale, reading the first-person prompts."""

    name = "three_point"
    scale = (-10, 0, 10)


class ConstantMode(AppraisalMode):
    """A mode without a model call: every reply moves the emotion by 2.5."""

    name = "constant"
    reasoning = False

    def appraise(self, user, requests):
        return (list(requests), [0] * len(requests), [{"checklist": [], "change": 2.5} for _ in requests],
                [StructuredResult() for _ in requests])


def test_a_registered_sampled_mode_is_used_by_the_simulator_as_it_is(monkeypatch):
    """Adding a mode is one class and one registry line: the simulator, its prompts and
    schemas and a judge's prompt list need nothing else (the config's validation is
    passed by here; a real mode adds its name to ``UserModelConfig.appraisal``)."""
    monkeypatch.setitem(APPRAISAL_MODES, "three_point", ThreePointMode)
    cfg = sampled(max_retries=1).model_copy(update={"appraisal": "three_point"})
    backend = ScriptedBackend([appraisal_json(5), appraisal_json(10)], [reply_json()])
    [turn] = UserSimulator(backend, cfg, seed=0).step([request()])
    assert backend.calls[0][2]["properties"]["change"]["enum"] == [-10, 0, 10]
    # +5 is off its scale: unusable, asked again, the +10 is kept
    assert turn.change == 10 and "not on the scale" in turn.failures[0]
    assert turn.appraisal["reply_reasoning"] == "PRIVATE-REASONING"
    assert structured_schemas(cfg)["appraise"]["properties"]["change"]["enum"] == [-10, 0, 10]
    assert prompt_files(cfg) == prompt_files(sampled())


def test_a_registered_mode_without_a_model_call_is_used_by_the_simulator_as_it_is(monkeypatch):
    monkeypatch.setitem(APPRAISAL_MODES, "constant", ConstantMode)
    cfg = sampled().model_copy(update={"appraisal": "constant"})
    backend = ScriptedBackend([appraisal_json(0)], [json.dumps({"message": "Fine.", "end_conversation": False})])
    [turn] = UserSimulator(backend, cfg, seed=0).step([request(emotion=50)])
    assert (turn.change, turn.emotion, turn.reply, turn.error) == (2.5, 52.5, "Fine.", None)
    # one call, the reply, without reasoning
    [(_, _, schema)] = backend.calls
    assert set(schema["properties"]) == {"message", "end_conversation"}
    assert set(structured_schemas(cfg)) == {"reply", "opening"}
    assert not {n for n in prompt_files(cfg) if n.startswith(("sim_appraise_", "sim_checklist_"))}


def test_the_learned_mode_reads_its_appraiser_once_and_makes_no_appraise_call(monkeypatch):
    made = []

    class FakeHead:
        def __init__(self):
            made.append(self)

        def __call__(self, requests):
            return [{"mode": "learned", "checklist": [], "change": -3.25, "texts_cut": 0} for _ in requests]

    monkeypatch.setattr("rlver_lib.appraisal.LearnedAppraisal", FakeHead)
    backend = ScriptedBackend([appraisal_json(0)], [json.dumps({"message": "Hm.", "end_conversation": False})])
    sim = UserSimulator(backend, SimulatorConfig(appraisal="learned"), seed=0)
    assert len(made) == 1  # read at construction, before any dialogue
    [turn] = sim.step([request(emotion=50)])
    assert (turn.change, turn.emotion, turn.appraisal["mode"]) == (-3.25, 46.75, "learned")
    [(_, _, schema)] = backend.calls  # the reply only, without reasoning
    assert "reasoning" not in schema["properties"] and len(made) == 1
