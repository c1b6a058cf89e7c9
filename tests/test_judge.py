"""The benchmark's judge (rlver_lib.evaluation.judge): its identity (description, prompt and
schema fingerprints, the model a server serves) and the refusal of mixed judges."""

from __future__ import annotations

import hashlib as _hashlib
import http.server as _http_server
import json
import threading as _threading
from contextlib import contextmanager as _contextmanager
from pathlib import Path as _Path

import pytest

from rlver_lib.config import EvaluationConfig, JudgeConfig


def test_mixed_judges_are_refused():
    from rlver_lib.evaluation.judge import JudgeMismatchError, check_same_judge

    proto = {"name": "full", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 10, "repeats": 1}
    moderate = {"backend": "llamacpp", "model": "m", "difficulty": "moderate", "seed": 0}
    check_same_judge({"x": {"judge": moderate, "protocol": proto}, "y": {"judge": dict(moderate), "protocol": proto}})
    with pytest.raises(JudgeMismatchError, match=r"judge\.difficulty: x='moderate' vs y='hard'"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto},
                          "y": {"judge": {**moderate, "difficulty": "hard"}, "protocol": proto}})
    with pytest.raises(JudgeMismatchError, match="protocol.name"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto},
                          "y": {"judge": moderate, "protocol": {**proto, "name": "sage"}}})
    with pytest.raises(JudgeMismatchError, match="no judge and protocol recorded for old"):
        check_same_judge({"x": {"judge": moderate, "protocol": proto}, "old": {"sentient_score": {}}})


# Every sampling setting, the field caps, n_ctx, the prompt files and schemas actually
# used, and the model behind a served alias are part of a judge's identity (issue 21,
# point 2).

_PROMPTS = _Path(__file__).resolve().parents[1] / "rlver_lib" / "prompts"


def _judge_ns(**overrides):
    """A judge config (``JudgeConfig``): its sampling settings, caps and n_ctx off their defaults."""
    fields = {"backend": "openai", "model": "judge-alias", "base_url": "http://judge.invalid/v1",
              "api_key_env": "OPENAI_API_KEY", "difficulty": "moderate",
              "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.1,
              "presence_penalty": 0.3, "frequency_penalty": -0.2, "max_new_tokens": 512, "max_retries": 3,
              "timeout_s": 180.0, "concurrency": 64, "n_threads": None, "n_ctx": 8192, "appraisal_chars": 1200,
              "message_chars": 900, "appraisal": "sage", "seed": None}
    fields.update(overrides)
    return JudgeConfig(**fields)


def _sha_of_files(names):
    digest = _hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode() + b"\0" + (_PROMPTS / name).read_bytes() + b"\0")
    return digest.hexdigest()


def test_a_judges_description_records_every_sampling_setting_cap_and_n_ctx():
    from rlver_lib.evaluation.judge import Judge

    d = Judge(_judge_ns(), 11).description
    assert {k: d[k] for k in ("backend", "model", "base_url", "difficulty", "appraisal", "temperature", "top_p",
                              "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                              "max_new_tokens", "n_ctx", "appraisal_chars", "message_chars", "seed")} == {
        "backend": "openai", "model": "judge-alias", "base_url": "http://judge.invalid/v1", "difficulty": "moderate",
        "appraisal": "sage", "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.02, "repetition_penalty": 1.1,
        "presence_penalty": 0.3, "frequency_penalty": -0.2, "max_new_tokens": 512, "n_ctx": 8192,
        "appraisal_chars": 1200, "message_chars": 900, "seed": 11}
    # settings that do not change an answer are not identity; nothing was asked of a server
    assert not {"max_retries", "timeout_s", "concurrency", "n_threads", "api_key_env", "initial_emotion",
                "served"} & set(d)
    assert d == Judge(_judge_ns(concurrency=2, timeout_s=5.0, max_retries=0), 11).description
    for key, value in {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "top_p": 1.0, "n_ctx": 4096, "message_chars": 400}.items():
        assert Judge(_judge_ns(**{key: value}), 11).description[key] == value
        assert Judge(_judge_ns(**{key: value}), 11).description != d, key


def test_a_judges_description_expected_settings_only_for_the_expected_appraisal():
    from rlver_lib.evaluation.judge import Judge

    extra = {"expected_center": 0.6, "expected_scale": 30.0, "expected_answer_order": "no_yes"}
    sage = Judge(_judge_ns(appraisal="sage", **extra), 0).description
    assert not any(k.startswith("expected_") for k in sage)
    expected = Judge(_judge_ns(appraisal="expected", **extra), 0).description
    assert {k: expected[k] for k in extra} == extra
    from rlver_lib.simulator import UserSimulator

    assert expected["expected_top_logprobs"] == UserSimulator.TOP_N
    assert expected["expected_difficulty_shift"] == 0.0  # moderate
    hard = Judge(_judge_ns(appraisal="expected", difficulty="hard", **extra), 0).description
    assert hard["expected_difficulty_shift"] > 0  # a harsh user needs a clearer "yes"


def test_judge_prompt_fingerprint_covers_the_files_of_its_mode_and_difficulty():
    from rlver_lib import user_prompts
    from rlver_lib.evaluation.judge import Judge

    sage = Judge(_judge_ns(appraisal="sage"), 0).description
    files = set(sage["prompt_files"])
    assert {"sim_appraise_sage_en.txt", "sim_appraise_sage_zh.txt", "sim_difficulty_moderate_sage_en.txt",
            "sim_difficulty_moderate_sage_zh.txt", "sim_system_en.txt", "sim_system_zh.txt", "sim_vocab_en.json",
            "sim_vocab_zh.json", "sim_reply_en.txt", "sim_reply_zh.txt", "sim_opening_en.txt",
            "sim_opening_zh.txt"} <= files
    assert not files & {"sim_appraise_en.txt", "sim_appraise_zh.txt", "sim_difficulty_moderate_en.txt",
                        "sim_difficulty_hard_sage_en.txt", "sim_difficulty_easy_sage_zh.txt",
                        "sim_checklist_en.json"}
    assert sage["prompts_sha256"] == _sha_of_files(sage["prompt_files"])
    first = Judge(_judge_ns(appraisal="first_person"), 0).description
    assert {"sim_appraise_en.txt", "sim_difficulty_moderate_en.txt"} <= set(first["prompt_files"])
    assert not {n for n in first["prompt_files"] if "_sage_" in n or n.startswith("sim_checklist_")}
    assert first["prompts_sha256"] == _sha_of_files(first["prompt_files"]) != sage["prompts_sha256"]
    expected = Judge(_judge_ns(appraisal="expected"), 0).description
    assert {"sim_checklist_en.json", "sim_checklist_zh.json", "sim_system_en.txt"} <= set(expected["prompt_files"])
    assert not {n for n in expected["prompt_files"] if n.startswith(("sim_appraise_", "sim_difficulty_"))}
    hard = Judge(_judge_ns(appraisal="sage", difficulty="hard"), 0).description
    assert "sim_difficulty_hard_sage_en.txt" in hard["prompt_files"]
    assert hard["prompts_sha256"] != sage["prompts_sha256"]
    # the simulator's own list is what is recorded
    assert sage["prompt_files"] == user_prompts.prompt_files(_judge_ns(appraisal="sage"))


def test_judge_schema_fingerprint_is_the_schemas_built_in_code():
    from rlver_lib import appraisal
    from rlver_lib.evaluation.judge import Judge

    # the reply schema follows the field caps, so a cap is part of the fingerprint
    assert (Judge(_judge_ns(message_chars=300), 0).description["schemas_sha256"]
            != Judge(_judge_ns(message_chars=301), 0).description["schemas_sha256"])
    first = Judge(_judge_ns(appraisal="first_person", appraisal_chars=50), 0).description
    built = {"appraise": appraisal.appraisal_schema(50), "reply": appraisal.reply_schema(50, 900),
             "opening": appraisal.OPENING_SCHEMA}
    text = json.dumps(built, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert first["schemas_sha256"] == _hashlib.sha256(text.encode("utf-8")).hexdigest()
    sage = Judge(_judge_ns(appraisal="sage", appraisal_chars=50), 0).description
    assert sage["schemas_sha256"] != first["schemas_sha256"]  # the same caps, SAGE's five-value scale
    expected = Judge(_judge_ns(appraisal="expected", appraisal_chars=50), 0).description
    built = {"reply": appraisal.reply_schema(50, 900, reasoning=False), "opening": appraisal.OPENING_SCHEMA}
    text = json.dumps(built, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert expected["schemas_sha256"] == _hashlib.sha256(text.encode("utf-8")).hexdigest()


@_contextmanager
def _stub_server(routes):
    """A loopback HTTP server answering GET ``path`` with ``routes[path]`` as JSON, else 404."""

    class Handler(_http_server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = routes.get(self.path)
            payload = json.dumps(body).encode() if body is not None else b'{"error": "not found"}'
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = _http_server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = _threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_judge_server_identity_tolerates_404_and_keeps_what_names_the_weights():
    from conftest import free_port

    from rlver_lib.evaluation.judge import served_model_identity

    vllm_like = {"object": "list", "data": [
        {"id": "simulator", "object": "model", "created": 1712345678, "owned_by": "vllm",
         "root": "deepseek-ai/DeepSeek-V3", "parent": None, "max_model_len": 16384,
         "permission": [{"id": "modelperm-abc", "created": 1712345678}]},
        {"id": "judge", "object": "model", "created": 1712345678, "owned_by": "vllm",
         "root": "deepseek-ai/DeepSeek-V3", "parent": None, "max_model_len": 16384}]}
    with _stub_server({"/v1/models": vllm_like}) as url:
        got = served_model_identity(url + "/v1", 5, model="simulator")
        assert got == {"models": [{"id": "simulator", "owned_by": "vllm", "root": "deepseek-ai/DeepSeek-V3",
                                   "parent": None, "max_model_len": 16384}],
                       "model_listed": True, "props_error": "HTTP 404"}
        unknown = served_model_identity(url, 5, model="no-such-alias")
        assert unknown["model_listed"] is False and [m["id"] for m in unknown["models"]] == ["simulator", "judge"]
    with _stub_server({}) as url:
        assert served_model_identity(url, 5) == {"models_error": "HTTP 404", "props_error": "HTTP 404"}
    assert served_model_identity(f"http://127.0.0.1:{free_port()}", 2) == {"models_error": "ConnectError",
                                                                          "props_error": "ConnectError"}


def test_judge_server_identity_of_a_real_llama_server(openai_server):
    from rlver_lib.evaluation.judge import served_model_identity
    from rlver_lib.models import smollm2_gguf_path

    got = served_model_identity(openai_server, 30, model="smollm2")
    assert got["model_listed"] is True and [m["id"] for m in got["models"]] == ["smollm2"]
    assert "created" not in got["models"][0]
    props = got["props"]
    assert props["model_path"] == str(smollm2_gguf_path())
    assert props["default_generation_settings"]["n_ctx"] == 2048  # the fixture's context per slot
    assert len(props["chat_template_sha256"]) == 64
    # the same answer through the /v1 root and on a second call: nothing volatile is kept
    assert served_model_identity(openai_server + "/v1", 30, model="smollm2") == got


def test_a_built_judge_records_the_model_behind_the_alias(openai_server, monkeypatch):
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import Judge, served_model_identity
    from rlver_lib.models import smollm2_gguf_path

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    eval_cfg = EvaluationConfig(judge=JudgeConfig(backend="openai", base_url=openai_server + "/v1", model="smollm2",
                                                  concurrency=1))
    judge = Judge.from_config(eval_cfg, run_seed=4)
    before = judge.description
    assert "served" not in before and judge.served is None  # nothing asked before its simulator is built
    with judge:
        assert judge.simulator.seed == 4
        assert judge.served == served_model_identity(openai_server, 30, model="smollm2")
        described = judge.description
        assert described["served"] == judge.served
        assert {k: v for k, v in described.items() if k != "served"} == before
        assert described["served"]["props"]["model_path"] == str(smollm2_gguf_path())
        name = judge.name
        assert name == Judge.name_of(described)  # a recorded description reads the same
        assert f"`smollm2` (serving `{smollm2_gguf_path().name}`) through `openai` at {openai_server}/v1" in name
        assert "top_k" in name and "min_p" in name and "seed 4" in name
    # closed, it keeps what it learnt; another judge of the same server has asked nothing
    assert judge.description == described
    assert "served" not in Judge.from_config(eval_cfg, run_seed=4).description


def test_a_built_judge_asks_the_llama_server_it_started():
    """A ``llamacpp`` judge: the server the backend started on a free port is asked."""
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import Judge
    from rlver_lib.models import EMBEDDED_POLICY, smollm2_gguf_path

    eval_cfg = EvaluationConfig(judge=JudgeConfig(backend="llamacpp", model=EMBEDDED_POLICY, concurrency=1,
                                                  n_ctx=1024, n_threads=1))
    with Judge.from_config(eval_cfg, run_seed=0) as judge:
        assert judge.simulator.seed == 0
        served = judge.description["served"]
        assert served["model_listed"] is True
        assert [m["id"] for m in served["models"]] == [smollm2_gguf_path().stem]  # the backend's alias
        assert served["props"]["model_path"] == str(smollm2_gguf_path())
        assert served["props"]["default_generation_settings"]["n_ctx"] == 1024


def test_check_same_judge_names_nested_served_and_sampling_differences():
    from rlver_lib.evaluation.judge import JudgeMismatchError, check_same_judge

    proto = {"name": "full", "initial_emotion": 40, "max_policy_turns": 10, "appraised_turns": 10, "repeats": 1}
    judge = {"backend": "openai", "model": "simulator", "top_k": 0, "seed": 0,
             "served": {"models": [{"id": "simulator", "root": "Qwen/Qwen2.5-72B-Instruct"}],
                        "props": {"model_path": "/m/a.gguf"}}}
    check_same_judge({"x": {"judge": judge, "protocol": proto},
                      "y": {"judge": json.loads(json.dumps(judge)), "protocol": proto}})
    other = {**judge, "top_k": 40, "served": {**judge["served"], "props": {"model_path": "/m/b.gguf"}}}
    with pytest.raises(JudgeMismatchError) as err:
        check_same_judge({"x": {"judge": judge, "protocol": proto}, "y": {"judge": other, "protocol": proto}})
    assert "judge.top_k: x=0 vs y=40" in str(err.value)
    assert "judge.served.props.model_path: x='/m/a.gguf' vs y='/m/b.gguf'" in str(err.value)
    unserved = {k: v for k, v in judge.items() if k != "served"}
    with pytest.raises(JudgeMismatchError, match=r"judge\.served\.props\.model_path: x='/m/a\.gguf' vs y=None"):
        check_same_judge({"x": {"judge": judge, "protocol": proto}, "y": {"judge": unserved, "protocol": proto}})


def test_the_judge_module_keeps_no_mutable_state():
    """Each judge holds what it learnt (its seed, what its server serves); the module and
    the class hold only constants, so one judge's answer cannot reach another's
    description (issue 33: no module global linking free functions)."""
    import ast
    import inspect
    from collections.abc import MutableMapping, MutableSequence, MutableSet

    from rlver_lib.evaluation import judge as module

    def is_mutable(value):
        return (isinstance(value, (MutableMapping, MutableSequence, MutableSet, bytearray))
                or hasattr(value, "cache_info"))  # a functools cache

    tree = ast.parse(inspect.getsource(module))
    assigned = {target.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Name)}
    assert "_JUDGE_OPERATIONAL" in assigned  # the module's own constants are read
    assert [name for name in sorted(assigned) if is_mutable(getattr(module, name))] == []
    assert [name for name, value in vars(module).items() if callable(value) and hasattr(value, "cache_info")] == []
    assert [name for name, value in vars(module.Judge).items() if not name.startswith("__") and is_mutable(value)] == []
    assert not [node for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal))]


def test_each_judge_keeps_its_own_server_answer(monkeypatch):
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import Judge

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    listing = {"data": [{"id": "judge", "owned_by": "vllm", "root": "org/judge-weights", "created": 1}]}
    with _stub_server({"/v1/models": listing}) as url:
        eval_cfg = EvaluationConfig(judge=JudgeConfig(backend="openai", base_url=url + "/v1", model="judge"))
        first = Judge.from_config(eval_cfg, run_seed=3)
        with first:
            assert first.simulator.seed == 3
        second = Judge.from_config(eval_cfg, run_seed=3)  # the same backend, URL and model
        assert first.served == {"models": [{"id": "judge", "owned_by": "vllm", "root": "org/judge-weights"}],
                                "model_listed": True, "props_error": "HTTP 404"}
        assert second.served is None and "served" not in second.description
        assert {k: v for k, v in first.description.items() if k != "served"} == second.description
        assert "(serving `org/judge-weights`)" in first.name and "serving" not in second.name


def test_the_quickstart_judge_is_described_as_before():
    """The quickstart judge's description, as the free functions gave it before the judge
    was an object: computed here from the config's fields and the prompt files' bytes, so
    summaries scored before compare equal with new ones."""
    from rlver_lib import appraisal, user_prompts
    from rlver_lib.evaluation.judge import Judge
    from rlver_lib.params import load_config

    cfg = load_config(_PROMPTS.parents[1] / "params" / "quickstart.yaml")
    judge_cfg = cfg.evaluation.judge
    fields = judge_cfg.model_dump()
    assert (fields["backend"], fields["appraisal"], fields["difficulty"], fields["seed"]) == (
        "llamacpp", "expected", "moderate", None)  # what the dict below is written for
    operational = {"max_retries", "timeout_s", "concurrency", "n_threads", "api_key_env", "initial_emotion", "seed"}
    first = ["backend", "model", "base_url", "difficulty", "appraisal", "temperature", "top_p", "top_k", "min_p",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "max_new_tokens", "n_ctx",
             "appraisal_chars", "message_chars"]
    files = user_prompts.prompt_files(judge_cfg)
    schemas = {"reply": appraisal.reply_schema(judge_cfg.appraisal_chars, judge_cfg.message_chars, reasoning=False),
               "opening": appraisal.OPENING_SCHEMA}
    schemas_text = json.dumps(schemas, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    expected = {**{k: fields[k] for k in first},
                **{k: fields[k] for k in sorted(set(fields) - operational - set(first))},
                "expected_difficulty_shift": 0.0, "expected_top_logprobs": 20,  # moderate; 20 answers read
                "seed": cfg.seed, "prompt_files": files, "prompts_sha256": _sha_of_files(files),
                "schemas_sha256": _hashlib.sha256(schemas_text.encode("utf-8")).hexdigest()}
    assert {"expected_questions", "expected_center", "expected_scale", "expected_answer_order"} <= set(expected)
    judge = Judge.from_config(cfg.evaluation, cfg.seed)
    assert judge.seed == cfg.seed == 0 and judge.config is judge_cfg
    assert judge.description == expected
    assert list(judge.description) == list(expected)  # in the order reports and summaries read it
    assert judge.name == ("`embedded:qwen2.5-coder-1.5b-instruct-q4km` through `llamacpp`, moderate difficulty, "
                          f"expected appraisal, temperature {judge_cfg.temperature}, top_p 1.0, top_k 0, min_p 0.0, "
                          "repetition_penalty 1.0, presence_penalty 0.0, frequency_penalty 0.0, seed 0")


def test_a_judge_seed_is_its_own_else_the_runs():
    from rlver_lib.config import JudgeConfig
    from rlver_lib.evaluation.judge import Judge

    assert Judge.from_config(EvaluationConfig(), run_seed=7).seed == 7
    assert Judge.from_config(EvaluationConfig(judge=JudgeConfig(seed=2)), run_seed=7).seed == 2
    rule = Judge.from_config(EvaluationConfig(judge=JudgeConfig(backend="rule")), run_seed=0)
    assert rule.description == {"backend": "rule", "change_function": "default_change_fn"}
    assert rule.name == "the rule simulator (no language model)"
