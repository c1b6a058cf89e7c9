"""In-character checks of the simulated user, on hand-written transcripts."""

from __future__ import annotations

from rlver_lib.character import assistant_voice, character_breaks, states_wish, summarize


def test_wish_leak_needs_a_wish_and_the_key_idea():
    # the example from a real quickstart dialogue: the user named its own hidden wish
    assert states_wish("Let's be fair. I just want you to weigh both shops and my blind spots.", "analyse_problem")
    assert not states_wish("I want to keep both shops open.", "analyse_problem")  # a wish, not the hidden one
    assert not states_wish("We weighed the options last year.", "analyse_problem")  # no wish stated
    assert states_wish("I need you to tell me it's not my fault.", "not_at_fault")
    assert states_wish("我只是希望你能认同我没有错。", "not_at_fault", "zh")
    assert not states_wish("我希望明天天气好。", "not_at_fault", "zh")


def test_assistant_voice():
    assert assistant_voice("What are some of the main points you want to discuss?")
    assert assistant_voice("Feel free to   tell me more.")
    assert not assistant_voice("I don't know what to do anymore.")
    assert assistant_voice("有什么可以帮你的吗？", "zh")


def test_character_breaks_counts_each_kind():
    transcript = [
        {"role": "user", "content": "My shop is losing money."},
        {"role": "assistant", "content": "That sounds hard."},
        {"role": "user", "content": "What are some of the main points you want to discuss?", "emotion": 52,
         "goodbye": False},
        {"role": "assistant", "content": "Tell me about the shop."},
        {"role": "user", "content": "my shop is  losing money.", "emotion": 50, "goodbye": False},
        {"role": "assistant", "content": "Why?"},
        {"role": "user", "content": "I really want you to analyse it from several sides. Bye.", "emotion": 42,
         "goodbye": True},
        {"role": "assistant", "content": "Okay."},
        {"role": "user", "content": None, "error": "failed"},
    ]
    assert character_breaks(transcript, "analyse_problem") == {
        "user_messages": 4, "wish_leaks": 1, "assistant_voice": 1, "verbatim_repeats": 1, "midrange_goodbyes": 1}


def test_goodbye_at_success_or_failure_is_not_midrange():
    for emotion in (100, 9):
        transcript = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "Bye.", "emotion": emotion, "goodbye": True}]
        assert character_breaks(transcript, "be_heard")["midrange_goodbyes"] == 0


def test_summarise_over_records():
    class S:
        hidden_intention, language = "be_heard", "en"

    records = [{"scenario_id": "a", "turns": [{"role": "user", "content": "How can I help you?"}]},
               {"scenario_id": "a", "transcript": [{"role": "user", "content": "I just need you to listen."}]}]
    total = summarize(records, {"a": S()})
    assert total == {"dialogues": 2, "user_messages": 2, "wish_leaks": 1, "assistant_voice": 1,
                     "verbatim_repeats": 0, "midrange_goodbyes": 0}


def test_wish_phrasings_with_contractions_and_curly_apostrophes():
    assert states_wish("I'd like some practical advice on this.", "practical_advice")
    assert states_wish("I’m looking for some practical advice, honestly.", "practical_advice")
    assert not states_wish("I like advice columns.", "practical_advice")  # no wish stated
