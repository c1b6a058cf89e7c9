"""The rollout engine: per-dialogue state, termination, think handling, token samples.

Scripted fakes for the engine logic; the embedded SmolLM2 (real model, CPU, a few
short generations) for the token-level and reproducibility checks.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from rlver_lib.algorithms import token_logprobs
from rlver_lib.backends import Generation
from rlver_lib.config import PolicyConfig, SamplingParams, SimulatorConfig
from rlver_lib.rollout import TurnSample, parse_think, policy_messages, run_rollouts
from rlver_lib.scenarios import Scenario
from rlver_lib.simulator import RuleSimulator, UserSimulator

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=16)


def sampled(**fields) -> SimulatorConfig:
    """A simulator config with the sampled first-person appraisal (the scripted backends
    answer JSON, not next-token log-probs)."""
    return SimulatorConfig(appraisal="first_person", **fields)




def scenario(sid: str, opening: str = "I had a rough day.", language: str = "en") -> Scenario:
    return Scenario(
        id=sid, persona=f"Persona {sid}", situation="A conflict at work.", personality="passive",
        hidden_intention="be_heard", opening_line=opening, language=language,
    )


class ScriptedPolicy:
    """Replies with ``reply_fn(conversation)``; records every conversation it saw.

    Token view: prompt ids = one id per character of the rendered conversation,
    completion ids = one id per character of the reply, so masks can be checked.
    """

    def __init__(self, reply_fn):
        self.reply_fn = reply_fn
        self.seen: list[list[dict]] = []
        self.batch_sizes: list[int] = []

    def generate(self, conversations, sampling, json_schema=None):
        self.batch_sizes.append(len(conversations))
        out = []
        for conv in conversations:
            self.seen.append(conv)
            text = self.reply_fn(conv)
            prompt = json.dumps(conv)
            out.append(Generation(text=text, prompt_ids=[ord(c) for c in prompt],
                                  completion_ids=[ord(c) for c in text], logprobs=[-0.5] * len(text)))
        return out


def run(policy, simulator, scenarios, **kw):
    args = dict(max_turns=4, initial_emotion=40, think=False, sampling=SAMPLING, seed=0, progress=False)
    return run_rollouts(policy, simulator, scenarios, **{**args, **kw})


# --------------------------------------------------------------------------- think parsing

@pytest.mark.parametrize("text, thought, reply, ok, problem", [
    ("<think>She feels unheard.</think> That sounds exhausting.", "She feels unheard.", "That sounds exhausting.",
     True, None),
    ("<think>plan</think>", "plan", "", False, "empty_reply"),
    ("<think>I should say that", "I should say that", "", False, "missing_close_tag"),
    ("Hi there <think>secret plan", "secret plan", "Hi there", False, "missing_close_tag"),
    ("<think>a</think>b<think>c</think> final", "a b c", "final", False, "duplicate_tags"),
    ("<think>a</think></think>reply", "a", "reply", False, "duplicate_tags"),
    ("secret</think>reply", "secret", "reply", False, "missing_open_tag"),
    ("Just a reply.", "", "Just a reply.", False, "no_think_block"),
    ("lead <think>t</think>reply", "lead t", "reply", False, "text_before_think"),
])
def test_parse_think(text, thought, reply, ok, problem):
    parsed = parse_think(text)
    got = (re.sub(r"\s+", " ", parsed.thought), parsed.reply, parsed.ok, parsed.problem)
    assert got == (thought, reply, ok, problem)
    assert "<think>" not in parsed.reply and "</think>" not in parsed.reply


def test_policy_messages_language_and_mode():
    history = [{"role": "user", "content": "hi", "extra": "dropped"}]
    en = policy_messages(scenario("a"), history, think=True)
    zh = policy_messages(scenario("b", language="zh"), history, think=False)
    assert "<think>" in en[0]["content"] and en[1] == {"role": "user", "content": "hi"}
    assert "<think>" not in zh[0]["content"] and "聊天伙伴" in zh[0]["content"]


# --------------------------------------------------------------------------- per-dialogue state

def test_dialogues_ending_at_different_turns_get_their_own_reward():
    # dialogue of scenario "k<k>" gets change 2k per turn and says goodbye after k turns:
    # final emotion = 40 + 2k*k, independent of where it sits in the batch
    ks = [3, 1, 4, 2]
    policy = ScriptedPolicy(lambda conv: f"Tell me more ({conv[1]['content'].split()[-1]})")
    simulator = RuleSimulator(
        change_fn=lambda reply: 2 * int(reply.rstrip(")").split("(")[1]),
        reply_fn=lambda req, e: ("ok", len(req.history) // 2 == int(req.dialogue_id[1])),
    )
    trajectories = run(policy, simulator, [scenario(f"k{k}", opening=f"I am {k}") for k in ks], max_turns=6)
    by_id = {t.dialogue_id: t for t in trajectories}
    assert [t.dialogue_id for t in trajectories] == [f"k{k}#0" for k in ks]
    for k in ks:
        t = by_id[f"k{k}#0"]
        assert t.termination == "goodbye"
        assert t.final_emotion == 40 + 2 * k * k and t.reward == pytest.approx((40 + 2 * k * k) / 100)
        assert t.to_record()["policy_turns"] == k and len(t.samples) == k
        assert [u["emotion"] for u in t.transcript if "emotion" in u] == [40 + 2 * k * j for j in range(1, k + 1)]
    # finished dialogues drop out: one batched call per turn over the live ones
    assert policy.batch_sizes == [4, 3, 2, 1]


def test_group_ids_and_replicas():
    policy = ScriptedPolicy(lambda conv: "Why?")
    trajectories = run(policy, RuleSimulator(), [scenario("a"), scenario("b")], n_per_scenario=3, max_turns=1)
    assert [t.dialogue_id for t in trajectories] == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"]
    assert [t.group_id for t in trajectories] == ["a"] * 3 + ["b"] * 3
    with pytest.raises(ValueError, match="unique"):
        run(policy, RuleSimulator(), [scenario("a"), scenario("a")])


@pytest.mark.parametrize("initial, change, max_turns, final, termination, n_policy", [
    (95, 10, 5, 100, "success", 1),    # ceiling reached -> success after one turn
    (12, -5, 5, 7, "failure", 1),      # below 10 -> failure
    (40, 50, 2, 60, "max_turns", 2),   # +50 clamped to +10 per turn; the last reply is scored
    (40, -5, 3, 25, "max_turns", 3),
    (5, -10, 3, 0, "failure", 1),      # floor at 0
])
def test_update_rule_and_termination(initial, change, max_turns, final, termination, n_policy):
    t, = run(ScriptedPolicy(lambda c: "Hm."), RuleSimulator(lambda r: change), [scenario("a")],
             initial_emotion=initial, max_turns=max_turns)
    assert (t.final_emotion, t.termination, t.to_record()["policy_turns"]) == (final, termination, n_policy)
    assert t.transcript[-1]["role"] == "user" and t.transcript[-1]["emotion"] == final  # last reply appraised


# --------------------------------------------------------------------------- think mode

def test_thought_never_reaches_simulator_or_later_context():
    outputs = iter(["<think>SECRET-1</think>How are you?", "<think>SECRET-2 no close", "<think>SECRET-3</think>Okay?"])
    policy = ScriptedPolicy(lambda conv: next(outputs))
    seen_by_simulator = []

    def change_fn(reply):
        seen_by_simulator.append(reply)
        return 1

    t, = run(policy, RuleSimulator(change_fn), [scenario("a")], think=True, max_turns=3)
    assert seen_by_simulator == ["How are you?", "", "Okay?"]
    assert not any("SECRET" in json.dumps(conv) for conv in policy.seen)
    policy_turns = [x for x in t.transcript if x["role"] == "assistant"]
    assert [x["thought"] for x in policy_turns] == ["SECRET-1", "SECRET-2 no close", "SECRET-3"]
    assert [x["format_ok"] for x in policy_turns] == [True, False, True] and t.format_violations == 1
    assert policy_turns[1]["content"] == "" and policy_turns[1]["format_problem"] == "missing_close_tag"


def test_format_violation_can_end_the_dialogue_without_reaching_the_user():
    policy = ScriptedPolicy(lambda conv: "<think>SECRET<think> twice</think>Reply")
    calls = []
    t, = run(policy, RuleSimulator(lambda r: calls.append(r) or 1), [scenario("a")], think=True,
             format_violation="end_dialogue")
    assert t.termination == "format_violation" and t.format_violations == 1 and calls == []
    assert t.final_emotion == 40 and len(t.samples) == 1


def test_simulator_error_ends_dialogue_and_private_fields_never_leak():
    class NoMessage:
        """Valid appraisals; reply outputs lacking the message field."""

        def __init__(self):
            self.calls = 0

        def generate(self, conversations, sampling, json_schema=None):
            self.calls += 1
            if "change" in json_schema["properties"]:
                text = json.dumps({"reply_meaning": "PRIVATE", "intention_fit": "PRIVATE",
                                   "inner_reaction": "PRIVATE", "change": 4})
            else:
                text = json.dumps({"reasoning": "PRIVATE ANALYSIS", "end_conversation": False})
            return [Generation(text=text) for _ in conversations]

    backend = NoMessage()
    policy = ScriptedPolicy(lambda conv: "I hear you.")
    ok_policy_dialogue, = run(ScriptedPolicy(lambda c: "Fine."), RuleSimulator(), [scenario("b")], max_turns=1)
    t, = run(policy, UserSimulator(backend, sampled(max_retries=2), seed=0), [scenario("a")], max_turns=3)
    assert t.termination == "error" and backend.calls == 1 + 3
    assert t.transcript[-1]["attempts"] == 4 and t.transcript[-1]["content"] is None and t.transcript[-1]["error"]
    assert len(policy.seen) == 1 and "PRIVATE" not in json.dumps(policy.seen)
    assert ok_policy_dialogue.termination == "max_turns"


def test_simulator_answering_for_other_dialogues_is_an_error():
    class Swapped(RuleSimulator):
        def step(self, requests):
            turns = super().step(requests)
            turns[0].dialogue_id = "someone-else#0"
            return turns

    with pytest.raises(ValueError, match="dialogue ids"):
        run(ScriptedPolicy(lambda c: "Hm."), Swapped(), [scenario("a"), scenario("b")])


def test_failed_opening_is_an_error_dialogue():
    class Broken:
        def generate(self, conversations, sampling, json_schema=None):
            return [Generation(text="garbage") for _ in conversations]

    policy = ScriptedPolicy(lambda conv: "Hi.")
    t, = run(policy, UserSimulator(Broken(), sampled(max_retries=1), seed=0), [scenario("a", opening=None)])
    assert t.termination == "error" and t.final_emotion == 40 and policy.seen == []


# --------------------------------------------------------------------------- samples

def test_samples_hold_context_and_completion_ids():
    policy = ScriptedPolicy(lambda conv: "Why?")
    t, = run(policy, RuleSimulator(), [scenario("a")], max_turns=2)
    assert [s.turn for s in t.samples] == [0, 1]
    for k, sample in enumerate(t.samples):
        text = json.dumps(policy.seen[k]) + "Why?"  # what the policy saw, then what it wrote
        assert "".join(map(chr, sample.input_ids)) == text
        assert [i for i, m in enumerate(sample.loss_mask) if m] == list(range(len(text) - 4, len(text)))
        assert sample.old_logprobs == [-0.5] * 4
    # turn 1's context is turn 0's conversation plus the reply and the user's answer, as ids
    first, second = json.dumps(policy.seen[0]), "".join(map(chr, t.samples[1].context_ids))
    assert second.startswith(first[:-1]) and '{"role": "assistant", "content": "Why?"}' in second


def test_context_budget_ends_dialogue_before_an_oversized_turn():
    class Counting(ScriptedPolicy):
        def prompt_ids(self, conversation):
            return [ord(c) for c in json.dumps(conversation)]

    policy = Counting(lambda conv: "Why?")
    first = len(json.dumps(policy_messages(scenario("a"), [{"role": "user", "content": "I had a rough day."}], False)))
    t, = run(policy, RuleSimulator(lambda r: 1), [scenario("a")], max_turns=5, max_context_tokens=first + 16)
    # turn 0 fits exactly (context + 16 new tokens); turn 1's context is longer, so it never runs
    assert t.termination == "context_limit" and t.to_record()["policy_turns"] == 1 and t.final_emotion == 41
    assert len(policy.seen) == 1 and max(len(json.dumps(c)) for c in policy.seen) + 16 <= first + 16


def test_a_reply_that_hit_max_new_tokens_is_recorded_as_cut():
    class Cutting(ScriptedPolicy):
        def generate(self, conversations, sampling, json_schema=None):
            out = super().generate(conversations, sampling, json_schema)
            for g, conv in zip(out, conversations):
                g.finish_reason = "length" if "sister" in json.dumps(conv) else "stop"
            return out

    scenarios = [scenario("a", "My sister ignored me."), scenario("b")]
    a, b = run(Cutting(lambda conv: "Go on."), RuleSimulator(lambda r: 1), scenarios, max_turns=2)
    cut = {t.dialogue_id: [x["cut"] for x in t.transcript if x["role"] == "assistant"] for t in (a, b)}
    assert cut == {a.dialogue_id: [True, True], b.dialogue_id: [False, False]}


def test_turn_sample_mask_shapes():
    s = TurnSample("a#0", 0, [1, 2, 3], [4, 5], [-0.1, -0.2])
    assert s.input_ids == [1, 2, 3, 4, 5] and s.loss_mask == [0, 0, 0, 1, 1]
    empty = TurnSample("a#0", 0, [7], [], [])
    assert empty.input_ids == [7] and empty.loss_mask == [0]


# --------------------------------------------------------------------------- real embedded policy

@pytest.fixture(scope="module")
def smollm2_backend():
    from rlver_lib.backends import TransformersBackend
    from rlver_lib.models import load_policy

    model, tokenizer = load_policy(PolicyConfig(dtype="float32"))
    return TransformersBackend(model, tokenizer)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("think", [False, True])
def test_mask_one_tokens_are_exactly_the_policys_turns(smollm2_backend, think):
    tok = smollm2_backend.tokenizer
    scenarios = [scenario("a", "My sister ignored my birthday."), scenario("b", "I failed my driving test again.")]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    by_id = {s.id: s for s in scenarios}
    trajectories = run(smollm2_backend, RuleSimulator(), scenarios, max_turns=2, think=think, sampling=sampling)
    for t in trajectories:
        policy_turns = [x for x in t.transcript if x["role"] == "assistant"]
        assert len(t.samples) == len(policy_turns) == 2
        for k, (sample, turn) in enumerate(zip(t.samples, policy_turns)):
            # the mask-0 part is exactly the chat template of the visible history before this turn
            visible = [{"role": x["role"], "content": x["content"]} for x in t.transcript[: 2 * k + 1]]
            expected = tok.apply_chat_template(policy_messages(by_id[t.scenario_id], visible, think),
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
            assert sample.context_ids == list(expected)
            assert [i for i, m in enumerate(sample.loss_mask) if m] == list(range(len(expected), len(sample.input_ids)))
            assert tok.decode(sample.input_ids[len(expected):], skip_special_tokens=True) == turn["raw"]
            # the ids after the context are the ones sampled: their recorded log-probs are the
            # model's own at those positions (teacher-forced, temperature 1, fp32)
            ids = torch.tensor([sample.input_ids])
            with torch.no_grad():
                scored = token_logprobs(smollm2_backend.model(input_ids=ids).logits, ids)[0, len(expected) - 1:]
            torch.testing.assert_close(torch.tensor(sample.old_logprobs), scored, atol=1e-4, rtol=0)
            assert all(v in tok.decode(sample.context_ids) for v in (m["content"] for m in visible))
            if think and turn["thought"] and k == 0:
                assert turn["thought"] not in tok.decode(t.samples[1].context_ids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_backend_logprobs_are_the_models_at_the_sampling_temperature(smollm2_backend):
    from rlver_lib.backends import TransformersBackend

    conversations = [[{"role": "user", "content": "My sister ignored my birthday."}],
                     [{"role": "user", "content": "Work is too much lately, I can't sleep."}]]
    sampling = SamplingParams(temperature=0.7, max_new_tokens=9, seed=3)
    for g in smollm2_backend.generate(conversations, sampling):  # batched, left-padded, KV cache
        ids = torch.tensor([g.prompt_ids + g.completion_ids])
        with torch.no_grad():
            logits = smollm2_backend.model(input_ids=ids).logits / 0.7
        scored = token_logprobs(logits, ids)[0, len(g.prompt_ids) - 1:]
        assert len(g.logprobs) == len(g.completion_ids) > 0
        torch.testing.assert_close(torch.tensor(g.logprobs), scored, atol=1e-4, rtol=0)
    quiet = TransformersBackend(smollm2_backend.model, smollm2_backend.tokenizer, return_logprobs=False)
    plain = quiet.generate(conversations, sampling)
    assert all(g.logprobs is None for g in plain)
    assert [g.completion_ids for g in plain] == [g.completion_ids for g in smollm2_backend.generate(conversations,
                                                                                                   sampling)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_seed_same_transcripts_with_real_policy(smollm2_backend):
    scenarios = [scenario("a", "Nobody at work listens to me."), scenario("b", "I think my friend is avoiding me.")]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10)

    def transcripts(seed):
        out = run(smollm2_backend, RuleSimulator(), scenarios, max_turns=2, sampling=sampling, seed=seed)
        return [t.to_record() for t in out], [s.completion_ids for t in out for s in t.samples]

    first, again, other = transcripts(7), transcripts(7), transcripts(8)
    assert first == again
    assert first[1] != other[1]
