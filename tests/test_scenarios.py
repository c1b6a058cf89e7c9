"""Scenario schema, loaders, validation, splits and generation (rlver_lib.scenarios)."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import pytest
from reference_data import reference_file

from rlver_lib.backends import Generation
from rlver_lib.scenarios import (
    GENERATION_SCHEMA,
    HIDDEN_INTENTIONS,
    PERSONALITY_TYPES,
    Scenario,
    ScenarioFileError,
    Situation,
    generate_scenarios,
    load_scenarios,
    persona_disjoint_split,
    scenario_similarity,
    validate_command,
    validate_file,
)

# The eight fixed RLVER ``task`` sentences, keyed by our intention names (written out
# here independently of the module's table).
TASKS = {
    "你希望对方辩证地分析事件中的问题": "analyse_problem",
    "你想获得能真实帮助你解决当下困境的建议": "practical_advice",
    "你想分析事件中其他人物这么做的原因": "understand_others",
    "你希望对方引导你针对事件进行自我反思，收获自我成长": "reflect_grow",
    "你希望对方真诚地夸奖你在事件中的具体行为": "specific_praise",
    "你希望对方用心倾听你的情绪宣泄": "be_heard",
    "你希望对方深刻共情你的感受，而不是简单的安慰": "deep_empathy",
    "你认为自己在事件中没有任何责任和错误，你想要对方也认同你没有错": "not_at_fault",
}

SITUATION = {
    "background": "Sam lost the keys to the community garden shed.",
    "conflict": "The garden committee thinks Sam was careless.",
    "current_state": "Sam is waiting for the committee meeting on Friday.",
    "mood_high": "Sam jokes about it.",
    "mood_low": "Sam says they will quit the garden.",
    "mood_normal": "Sam explains the story again.",
    "reply_fit": "Sam relaxes when someone hears them out.",
    "reply_miss": "Sam bristles at quick fixes.",
}


def record(**changes) -> dict:
    base = {"id": "s1", "persona": "Sam Lee, 30, gardener in Leeds. Talks slowly.",
            "situation": dict(SITUATION), "personality": "passive", "hidden_intention": "be_heard",
            "opening_line": "Lost the shed keys. Again."}
    base.update(changes)
    return base


def write_lines(path: Path, lines: list[str], *, bom: bool = False) -> Path:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(line + "\n" for line in lines).encode("utf-8"))
    return path


@pytest.fixture(scope="module")
def raw_profiles() -> dict[str, list[dict]]:
    texts = {name: reference_file("rlver_profiles", f"{name}_profile.jsonl").read_text("utf-8")
             for name in ("train", "test")}
    return {name: [json.loads(line) for line in text.splitlines() if line.strip()] for name, text in texts.items()}


@pytest.fixture(scope="module")
def profiles(raw_profiles) -> dict[str, list[Scenario]]:
    return {name: load_scenarios(reference_file("rlver_profiles", f"{name}_profile.jsonl")) for name in raw_profiles}


# --------------------------------------------------------------------------- RLVER/SAGE profiles


def test_all_rlver_profiles_load_with_intentions_mapped(profiles, raw_profiles):
    assert len(profiles["train"]) == 500 and len(profiles["test"]) == 100
    for name in ("train", "test"):
        expected = collections.Counter(TASKS[r["task"]] for r in raw_profiles[name])
        assert collections.Counter(s.hidden_intention for s in profiles[name]) == expected
        personality_key = {"负面型": "negative", "被动型": "passive", "回避型": "avoidant"}
        expected_personality = collections.Counter(personality_key[r["main_cha"]] for r in raw_profiles[name])
        assert collections.Counter(s.personality for s in profiles[name]) == expected_personality
        assert [s.id for s in profiles[name]] == [r["id"] for r in raw_profiles[name]]
    assert {s.language for s in profiles["train"] + profiles["test"]} == {"zh"}
    # The RLVER train file's hand-counted figures.
    train_counts = collections.Counter(s.hidden_intention for s in profiles["train"])
    assert train_counts["not_at_fault"] == 66 and train_counts["specific_praise"] == 57


def test_profile_fields_carried_over(profiles, raw_profiles):
    first, raw = profiles["test"][0], raw_profiles["test"][0]
    assert first.opening_line == raw["first_talk"]
    assert first.persona == raw["player"]
    assert first.traits == tuple(raw["cha_group"])
    assert first.intention_text == raw["task"]
    # the trailing hidden-theme line is removed from the situation; the rest is kept
    assert not first.situation_text.rstrip().endswith(raw["task"])
    assert raw["scene"].startswith(first.situation_text)
    assert all(s.opening_line is None for s in profiles["train"])


def test_only_the_final_hidden_theme_trailer_is_stripped_from_all_600_scenes(profiles, raw_profiles):
    # Independent of the loader's regex: split each raw scene into lines, find the last
    # line that starts with "####隐藏主题", and expect every line before it, unchanged.
    mentions_before = 0  # scenes with an earlier "...隐藏主题：" heading (the old regex cut there)
    for name in ("train", "test"):
        for scenario, raw in zip(profiles[name], raw_profiles[name]):
            lines = raw["scene"].split("\n")
            heading = max(i for i, line in enumerate(lines) if line.startswith("####隐藏主题"))
            assert heading >= len(lines) - 2  # the trailer: the heading and at most the task line
            assert raw["task"] in "\n".join(lines[heading:])
            assert scenario.situation_text == "\n".join(lines[:heading]).strip()
            mentions_before += any("隐藏主题：" in line or "隐藏主题:" in line for line in lines[:heading])
    assert mentions_before == 22  # the issue's count of scenes the old loader truncated
    assert sum(len(v) for v in profiles.values()) == 600


def test_54_test_personas_reappear_in_train(profiles, raw_profiles):
    train_keys = {s.persona_key for s in profiles["train"]}
    assert sum(s.persona_key in train_keys for s in profiles["test"]) == 54
    # independent count on the raw persona text
    raw_train = {r["player"] for r in raw_profiles["train"]}
    assert sum(r["player"] in raw_train for r in raw_profiles["test"]) == 54


def test_persona_disjoint_split_of_rlver_profiles(profiles):
    everything = profiles["train"] + profiles["test"]
    train, test = persona_disjoint_split(everything, test_fraction=0.2, seed=3)
    assert len(train) + len(test) == 600
    assert not {s.persona_key for s in train} & {s.persona_key for s in test}
    n_personas = len({s.persona_key for s in everything})
    assert len({s.persona_key for s in test}) == round(0.2 * n_personas)
    again = persona_disjoint_split(everything, test_fraction=0.2, seed=3)
    assert [s.id for s in again[1]] == [s.id for s in test]
    other = persona_disjoint_split(everything, test_fraction=0.2, seed=4)
    assert [s.id for s in other[1]] != [s.id for s in test]


def test_split_rejects_bad_arguments():
    one = load_scenarios("builtin:all")[:1]
    with pytest.raises(ValueError, match="two distinct personas"):
        persona_disjoint_split(one, 0.5, 0)
    with pytest.raises(ValueError, match="test_fraction"):
        persona_disjoint_split(load_scenarios("builtin:all"), 1.0, 0)


# --------------------------------------------------------------------------- shipped set


def test_shipped_set_covers_every_cell_with_opening_lines():
    scenarios = load_scenarios("builtin:all")
    assert len(scenarios) >= 48
    cells = collections.Counter((s.hidden_intention, s.personality) for s in scenarios)
    assert set(cells) == set(itertools.product(HIDDEN_INTENTIONS, PERSONALITY_TYPES))
    assert min(cells.values()) >= 2
    assert all(s.opening_line and s.language == "en" for s in scenarios)
    assert all(isinstance(s.situation, Situation) for s in scenarios)
    assert len({s.persona_key for s in scenarios}) == len(scenarios)
    assert all(s.intention_text == HIDDEN_INTENTIONS[s.hidden_intention].en for s in scenarios)


def test_shipped_split_is_persona_disjoint():
    train, test = load_scenarios("builtin:train"), load_scenarios("builtin:test")
    assert len(train) + len(test) == len(load_scenarios("builtin:all"))
    assert not {s.persona_key for s in train} & {s.persona_key for s in test}
    assert 0.25 <= len(test) / (len(train) + len(test)) <= 0.4
    assert {s.hidden_intention for s in test} == set(HIDDEN_INTENTIONS)


def test_unknown_builtin_name():
    with pytest.raises(ValueError, match="builtin:train"):
        load_scenarios("builtin:dev")


@pytest.mark.parametrize("which", ["builtin", "profiles"])
def test_record_round_trip(tmp_path, which, profiles):
    # imported profiles keep a free-text situation; it must load back unchanged too
    scenarios = load_scenarios("builtin:test") if which == "builtin" else profiles["test"][:20]
    path = write_lines(tmp_path / "copy.jsonl", [json.dumps(s.to_record()) for s in scenarios])
    assert load_scenarios(path) == scenarios


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("lines", "line", "field", "message"),
    [
        ([json.dumps(record()), "{not json"], 2, None, "invalid JSON"),
        ([json.dumps(record()), json.dumps(record(id="s2", persona=None))], 2, "persona",
         "wrong type"),
        ([json.dumps({k: v for k, v in record().items() if k != "hidden_intention"})], 1, "hidden_intention",
         "missing field"),
        ([json.dumps(record(situation=SITUATION | {"conflict": "  "}))], 1, "situation.conflict", "empty field"),
        ([json.dumps(record(situation=42))], 1, "situation", "wrong type"),
        ([json.dumps(record()), "", json.dumps(record(id="s2", hidden_intention="revenge"))], 3, "hidden_intention",
         "unknown intention"),
        ([json.dumps(record(personality="cheerful"))], 1, "personality", "unknown personality"),
        ([json.dumps(record()), json.dumps(record())], 2, "id", "duplicate id"),
        ([json.dumps(record(mood="x"))], 1, "mood", "unknown field"),
        ([json.dumps(record(language="zh"))], 1, "language", "reads as 'en'"),
        (["[1, 2]"], 1, None, "expected an object"),
        ([json.dumps({"id": "p1", "player": "* 姓名：李雷", "scene": "## 背景", "main_cha": "乐观型",
                      "task": next(iter(TASKS))})], 1, "main_cha", "unknown personality"),
        ([json.dumps({"id": "p1", "player": "* 姓名：李雷", "scene": "## 背景", "main_cha": "负面型",
                      "task": "你想要钱"})], 1, "task", "unknown intention"),
    ],
)
def test_malformed_files_name_line_and_field(tmp_path, lines, line, field, message):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    issues = validate_file(path)
    assert len(issues) == 1, issues
    assert (issues[0].file, issues[0].line, issues[0].field) == (str(path), line, field)
    assert message in issues[0].message
    with pytest.raises(ScenarioFileError) as err:
        load_scenarios(path)
    assert f"{path}:{line}" in str(err.value)


def test_empty_file_is_an_issue(tmp_path):
    path = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    [issue] = validate_file(path)
    assert issue.line == 0 and "empty file" in issue.message


def test_validate_command_exit_codes(tmp_path, capsys):
    good = write_lines(tmp_path / "good.jsonl", [json.dumps(record())])
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps(record()), json.dumps(record(personality="x"))])
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert validate_command(good) == 0
    assert "OK: 1 scenarios" in capsys.readouterr().out
    assert validate_command(bad) == 1
    assert f"{bad}:2: personality: unknown personality" in capsys.readouterr().out
    assert validate_command(binary) == 2
    assert validate_command(tmp_path / "missing.jsonl") == 2
    assert "cannot read file" in capsys.readouterr().out


def test_bom_and_unicode_line_separators_load(tmp_path):
    separated = record(opening_line="First part\u2028second part\u2029third part")
    path = write_lines(tmp_path / "bom.jsonl", [json.dumps(separated, ensure_ascii=False),
                                                 json.dumps(record(id="s2"))], bom=True)
    assert validate_file(path) == []
    first, second = load_scenarios(path)
    assert first.opening_line == "First part\u2028second part\u2029third part"
    assert (first.id, second.id) == ("s1", "s2")
    assert first.source == "bom.jsonl:1" and second.source == "bom.jsonl:2"


def test_yaml_loads_and_errors_point_at_the_field_line(tmp_path):
    good = tmp_path / "set.yaml"
    good.write_text(
        "scenarios:\n"
        "  - id: y1\n"
        "    persona: Ana Silva, 33, baker in Porto. Warm and talkative.\n"
        "    personality: negative\n"
        "    hidden_intention: deep_empathy\n"
        "    situation:\n" + "".join(f"      {k}: {v}\n" for k, v in SITUATION.items()), encoding="utf-8")
    [scenario] = load_scenarios(good)
    assert (scenario.id, scenario.language, scenario.opening_line) == ("y1", "en", None)
    assert scenario.situation.conflict == SITUATION["conflict"]

    bad = tmp_path / "bad.yml"
    bad.write_text(
        "- id: y1\n"
        "  persona: Ana Silva, 33, baker in Porto.\n"
        "  personality: negative\n"
        "  hidden_intention: deep_empathy\n"
        "  situation:\n" + "".join(f"    {k}: {v if k != 'mood_low' else 3}\n" for k, v in SITUATION.items()),
        encoding="utf-8")
    [issue] = validate_file(bad)
    assert (issue.line, issue.field) == (6 + list(SITUATION).index("mood_low"), "situation.mood_low")
    assert "wrong type" in issue.message

    broken = tmp_path / "broken.yaml"
    broken.write_text("- id: y1\n  persona: [unclosed\n", encoding="utf-8")
    [issue] = validate_file(broken)
    assert issue.line >= 2 and "invalid YAML" in issue.message


# --------------------------------------------------------------------------- generation


STORIES = {
    "Kofi": ["His hospital ward lost two nurses and he covers both rotas.",
             "His manager calls the overtime voluntary.", "He has not had a day off in a month.",
             "He hums while charting.", "He stops answering.", "He speaks in lists.",
             "He warms to someone who follows his account.", "He goes silent at slogans."],
    "Marta": ["After forty years on the trams she retired, and her days feel empty.",
              "Her daughter says she should finally relax; Marta misses being useful.",
              "She has started volunteering at a library but feels out of place.",
              "She tells funny stories about passengers.", "She complains about the weather.",
              "She chats about the neighbours.", "She lights up when asked about her career.",
              "She bristles at being called old."],
    "Juan": ["A storm wrecked the boat Juan shares with his cousin.",
             "The cousin wants to sell the licence and move inland.",
             "Juan is repairing the hull alone at dawn.", "He talks about the sea.", "He grunts.",
             "He is laconic.", "He softens when his effort is noticed.", "He leaves when lectured."],
    "Wang": ["王芳的学生在考试中作弊被发现。", "家长指责她监考不严。", "她正在写情况说明。", "她语气轻松。",
             "她沉默不语。", "她语气平淡。", "被理解时她放松下来。", "被说教时她更加紧张。"],
}


def generated(persona: str, opening: str = "Hi.") -> str:
    story = STORIES[persona.split(",")[0].split()[0].replace("王芳", "Wang")]
    return json.dumps({"persona": persona, "situation": dict(zip(SITUATION, story)), "opening_line": opening},
                      ensure_ascii=False)


class ScriptedBackend:
    """A ChatBackend returning canned outputs in order; records each call."""

    def __init__(self, outputs: list[str]):
        self.outputs = list(outputs)
        self.calls: list[tuple[list, object, dict | None]] = []

    def generate(self, conversations, sampling, json_schema=None):
        self.calls.append((list(conversations), sampling, json_schema))
        return [Generation(text=self.outputs.pop(0)) for _ in conversations]


def test_generation_keeps_exactly_the_valid_unique_scenarios():
    shipped = load_scenarios("builtin:all")
    first_shipped = shipped[0]
    copy_of_shipped = json.dumps({"persona": first_shipped.persona,
                                  "situation": first_shipped.situation.model_dump(),
                                  "opening_line": "Hello."})
    outputs = [
        generated("Kofi Mensah, 29, nurse in Kumasi. Quiet and precise."),          # valid
        generated("Kofi Mensah, 29, nurse in Kumasi. Quiet and precise!"),         # near-duplicate of the first
        "{\"persona\": \"Half an object\"",                                         # invalid JSON
        copy_of_shipped,                                                            # duplicate of existing
        json.dumps({"persona": "Rita", "situation": {"background": "x"}, "opening_line": "Hi"}),  # missing fields
        generated("Marta Kowalska, 61, retired tram driver in Kraków. Chatty."),   # valid
        # second round, for the three unfilled targets
        generated("Juan Pérez, 45, fisherman in Valparaíso. Laconic."),            # valid
        "not json at all",
        generated("Juan Pérez, 45, fisherman in Valparaíso. Laconic."),            # duplicate within the round
        generated("王芳, 五十岁，杭州的中学老师，说话温和。"),                           # wrong language
    ]
    backend = ScriptedBackend(outputs)
    result = generate_scenarios(backend, 6, seed=7, existing=shipped, intentions=["be_heard", "reflect_grow"],
                                personalities=["passive"], max_rounds=2)
    assert [s.persona.split(",")[0] for s in result] == ["Kofi Mensah", "Marta Kowalska", "Juan Pérez"]
    assert len(backend.calls) == 2
    assert [len(c[0]) for c in backend.calls] == [6, 4]
    assert backend.calls[0][2] is GENERATION_SCHEMA
    assert [c[1].seed for c in backend.calls] == [7, 8]
    assert all(s.source == "generated" and s.language == "en" and s.personality == "passive" for s in result)
    assert {s.hidden_intention for s in result} <= {"be_heard", "reflect_grow"}
    assert len({s.id for s in result}) == 3
    # the six targets cycle through the two requested cells: three prompts each
    prompts = [conversation[1]["content"] for conversation in backend.calls[0][0]]
    assert sum(HIDDEN_INTENTIONS["be_heard"].en in p for p in prompts) == 3
    assert sum(HIDDEN_INTENTIONS["reflect_grow"].en in p for p in prompts) == 3
    assert all(PERSONALITY_TYPES["passive"].en in p for p in prompts)


def test_generation_rejects_unknown_cells():
    with pytest.raises(ValueError, match="unknown"):
        generate_scenarios(ScriptedBackend([]), 1, seed=0, intentions=["revenge"])


def test_similarity_threshold_separates_rewording_from_distinct():
    shipped = load_scenarios("builtin:all")
    base = shipped[0]
    reworded = base.model_copy(update={"persona": base.persona.replace("41", "42").replace("fast", "quickly")})
    assert scenario_similarity(base, base) == 1.0
    assert scenario_similarity(base, reworded) > 0.7
    assert max(scenario_similarity(a, b) for a, b in itertools.combinations(shipped, 2)) < 0.6


# ------------------------------------------------------------ a run's persona-disjoint split


def _with_personas(*personas: str) -> list[Scenario]:
    """Builtin scenarios given these persona cards (ids made unique and readable)."""
    base = load_scenarios("builtin:all")
    return [base[i].model_copy(update={"id": f"s{i}", "persona": p}) for i, p in enumerate(personas)]


def test_split_for_run_drops_training_scenarios_whose_persona_is_tested():
    from rlver_lib.config import ScenarioConfig
    from rlver_lib.scenarios import split_for_run

    train = _with_personas("Ann, 30.", "Bo, 41.", "Cy, 25.", "  bo,   41. ")  # s1 and s3: one persona
    test = _with_personas("BO, 41.", "Di, 60.")
    section = ScenarioConfig(train="a.jsonl", test="b.jsonl")
    split = split_for_run(train, test, section, seed=0)
    assert [s.id for s in split.train] == ["s0", "s2"]
    assert [s.id for s in split.dropped] == ["s1", "s3"]
    assert [s.persona for s in split.test] == ["BO, 41.", "Di, 60."]
    limited = split_for_run(train, test, ScenarioConfig(train="a.jsonl", test="b.jsonl",
                                                        n_train_scenarios=1, n_test_scenarios=1))
    assert [s.id for s in limited.train] == ["s0"] and [s.persona for s in limited.test] == ["BO, 41."]
    assert [s.id for s in limited.dropped] == ["s1", "s3"]  # counted before the limits


def test_split_for_run_splits_one_source_by_persona():
    from rlver_lib.config import ScenarioConfig
    from rlver_lib.scenarios import split_for_run

    pool = _with_personas("Ann.", "Bo.", "Cy.", "Ann.", "Bo.", "Cy.")
    unrelated = _with_personas("Zed.")  # the test list is not used when both specs name one source
    section = ScenarioConfig(train="builtin:all", test="builtin:all")
    split = split_for_run(pool, unrelated, section, seed=5)
    # round(3 personas / 3) = 1 persona (both of its scenarios) goes to test, input order kept
    assert len({s.persona_key for s in split.test}) == 1 and len(split.test) == 2
    assert sorted(s.id for s in split.train + split.test) == [f"s{i}" for i in range(6)]
    assert not {s.persona_key for s in split.train} & {s.persona_key for s in split.test}
    assert split.dropped == [] and "zed." not in {s.persona_key for s in split.test}
    assert [s.id for s in split.train] == sorted(s.id for s in split.train)
    assert split_for_run(pool, unrelated, section, seed=5) == split  # seeded
    with pytest.raises(ValueError, match="two distinct personas"):
        split_for_run(_with_personas("Ann.", "ann."), [], section)
