"""Chat backends: transformers (ids, log-probs, seeding, xgrammar), llama-server, OpenAI HTTP."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jsonschema
import pytest
import torch

from rlver_lib.backends import (
    BackendDied,
    BackendError,
    Generation,
    TransformersBackend,
    UnusableOutput,
    structured_batch,
)
from rlver_lib.config import SamplingParams
from rlver_lib.openai_backend import OpenAIBackend
from rlver_lib.servers import LlamaServerBackend

CONVERSATIONS = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "You are a kind listener."},
     {"role": "user", "content": "My sister forgot my birthday and I feel invisible. What should I do?"}],
    [{"role": "user", "content": "What is the capital of France?"}],
]

# integer ranges as an enum, as the simulator's schemas write them
APPRAISAL_SCHEMA = {
    "type": "object",
    "properties": {
        "change": {"type": "integer", "enum": list(range(-10, 11))},
        "label": {"type": "string", "enum": ["S", "A", "B", "C", "F"]},
        "goodbye": {"type": "boolean"},
    },
    "required": ["change", "label", "goodbye"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(embedded_policy):
    model, tokenizer = embedded_policy
    return TransformersBackend(model, tokenizer)


def _forward_logprobs(model, prompt_ids, completion_ids, temperature):
    """Log-probs of ``completion_ids`` given ``prompt_ids`` from one unpadded forward pass."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def test_prompt_ids_are_the_templated_context(backend, embedded_policy):
    _, tokenizer = embedded_policy
    [gen] = backend.generate(CONVERSATIONS[1:2], SamplingParams(temperature=0, max_new_tokens=2))
    text = tokenizer.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)
    assert gen.prompt_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert text.endswith("<|im_start|>assistant\n")


def test_batched_greedy_equals_single_calls(backend):
    sampling = SamplingParams(temperature=0, max_new_tokens=10)
    batch = backend.generate(CONVERSATIONS, sampling)
    assert len({len(g.prompt_ids) for g in batch}) == 3  # left padding really happened
    for conversation, batched in zip(CONVERSATIONS, batch):
        [single] = backend.generate([conversation], sampling)
        assert batched.completion_ids == single.completion_ids
        assert batched.prompt_ids == single.prompt_ids
        assert batched.text == single.text
        torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(single.logprobs),
                                   atol=1e-3, rtol=0)


def test_seeded_sampling_reproduces_and_seeds_differ(backend):
    conversations = CONVERSATIONS[:2]
    state = torch.random.get_rng_state()
    first = backend.generate(conversations, SamplingParams(temperature=1.0, max_new_tokens=12, seed=7))
    assert torch.equal(torch.random.get_rng_state(), state)  # caller's RNG untouched
    again = backend.generate(conversations, SamplingParams(temperature=1.0, max_new_tokens=12, seed=7))
    other = backend.generate(conversations, SamplingParams(temperature=1.0, max_new_tokens=12, seed=8))
    assert [g.completion_ids for g in first] == [g.completion_ids for g in again]
    assert [g.completion_ids for g in first] != [g.completion_ids for g in other]


def test_logprobs_match_a_forward_pass(backend, embedded_policy):
    model, _ = embedded_policy
    temperature = 0.7
    gens = backend.generate(CONVERSATIONS[:2], SamplingParams(temperature=temperature, max_new_tokens=12, seed=3))
    for gen in gens:
        assert len(gen.logprobs) == len(gen.completion_ids) > 0
        expected = _forward_logprobs(model, gen.prompt_ids, gen.completion_ids, temperature)
        torch.testing.assert_close(torch.tensor(gen.logprobs), expected, atol=1e-3, rtol=0)


def test_completion_ends_with_eos_only_when_stopped(backend, embedded_policy):
    _, tokenizer = embedded_policy
    eos = tokenizer.eos_token_id
    [stopped] = backend.generate(CONVERSATIONS[2:], SamplingParams(temperature=0, max_new_tokens=40))
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids[-1] == eos and eos not in stopped.completion_ids[:-1]
    assert "<|im_end|>" not in stopped.text and "Paris" in stopped.text
    [cut] = backend.generate(CONVERSATIONS[2:], SamplingParams(temperature=0, max_new_tokens=3))
    assert cut.finish_reason == "length"
    assert cut.completion_ids == stopped.completion_ids[:3] and eos not in cut.completion_ids


def test_json_schema_output_parses_and_validates(backend):
    gens = backend.generate(CONVERSATIONS, SamplingParams(temperature=1.0, max_new_tokens=40, seed=11),
                            json_schema=APPRAISAL_SCHEMA)
    for gen in gens:
        assert gen.finish_reason == "stop"
        jsonschema.validate(json.loads(gen.text), APPRAISAL_SCHEMA)


def test_peft_model_and_policy_sync(embedded_policy):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = embedded_policy
    sampling = SamplingParams(temperature=0, max_new_tokens=8)
    base_out = TransformersBackend(model, tokenizer).generate(CONVERSATIONS[:1], sampling)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft_model.train()
    backend = TransformersBackend(peft_model, tokenizer)
    # a fresh LoRA adapter (B = 0) leaves the policy unchanged
    assert backend.generate(CONVERSATIONS[:1], sampling)[0].completion_ids == base_out[0].completion_ids
    assert peft_model.training  # training mode restored after generation
    backend.sync_policy(peft_model, step=5)
    assert backend.policy_step == 5
    assert backend.generate(CONVERSATIONS[:1], sampling)[0].meta["policy_step"] == 5
    with pytest.raises(ValueError, match="same model"):
        backend.sync_policy(model, step=6)


def test_empty_conversation_rejected(backend):
    with pytest.raises(ValueError, match="at least one message"):
        backend.generate([[]], SamplingParams())
    assert backend.generate([], SamplingParams()) == []


# ---------------------------------------------------------------- llama-server (real server on loopback)


@pytest.fixture(scope="module")
def llama_backend():
    from rlver_lib.models import smollm2_gguf_path

    with LlamaServerBackend(smollm2_gguf_path(), n_ctx=1024, parallel=2, threads=1, seed=0) as backend:
        yield backend


def test_llama_server_json_output_valid_and_seeded(llama_backend):
    sampling = SamplingParams(temperature=0.8, max_new_tokens=120, seed=5)
    first = llama_backend.generate(CONVERSATIONS[:2], sampling, json_schema=APPRAISAL_SCHEMA)
    for gen in first:
        assert gen.finish_reason == "stop", gen.text  # room enough to close the object
        jsonschema.validate(json.loads(gen.text, strict=False), APPRAISAL_SCHEMA)
        assert gen.meta["usage"]["completion_tokens"] > 0 and gen.prompt_ids is None
    again = llama_backend.generate(CONVERSATIONS[:2], sampling, json_schema=APPRAISAL_SCHEMA)
    assert [g.text for g in first] == [g.text for g in again]
    # the server takes the OpenAI json_schema form as it is
    assert llama_backend.client._schema_style == "json_schema"


def test_ngram_speculation_drafts_from_earlier_outputs_and_keeps_the_greedy_output():
    """``speculative: ngram`` (servers.NGRAM_SPECULATION, the annotator's default) through
    make_simulator_backend: the greedy JSON of a conversation asked twice is the plain
    server's, and the second answer is drafted from the first one's n-grams, the model
    accepting them; the plain server drafts nothing."""
    from rlver_lib.config import AnnotatorConfig
    from rlver_lib.models import EMBEDDED_POLICY, make_simulator_backend

    sampling = SamplingParams(temperature=0, max_new_tokens=120, seed=0)
    answers = {}
    for speculative in ("none", "ngram"):
        cfg = AnnotatorConfig(model=EMBEDDED_POLICY, n_ctx=1024, n_threads=1, speculative=speculative)
        with make_simulator_backend(cfg, seed=0) as backend:
            answers[speculative] = [backend.generate(CONVERSATIONS[:1], sampling, json_schema=APPRAISAL_SCHEMA)[0]
                                    for _ in range(2)]
    plain, drafted = answers["none"], answers["ngram"]
    assert {g.text for g in plain + drafted} == {plain[0].text}
    jsonschema.validate(json.loads(plain[0].text, strict=False), APPRAISAL_SCHEMA)
    assert not any("draft_n" in g.meta["timings"] for g in plain)
    # 23 of 51 tokens accepted on a Zen 4 EPYC; the plain path verifies one token a step
    assert drafted[1].meta["timings"]["draft_n_accepted"] >= drafted[1].meta["usage"]["completion_tokens"] // 4


def test_llama_server_context_overflow_is_backend_error(llama_backend):
    long = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(BackendError, match="HTTP 400"):
        llama_backend.generate([long], SamplingParams(max_new_tokens=4))
    llama_backend.check_alive()  # a rejected request leaves the server up


@pytest.mark.skipif(sys.platform != "linux", reason="prctl(PR_SET_PDEATHSIG) is Linux's")
@pytest.mark.parametrize("guarded", [True, False])
def test_a_server_dies_with_a_killed_parent(guarded, process_alive):
    """A SIGKILLed parent (a Jupyter kernel killed after its shutdown wait) skips every
    clean-up; the guarded child goes with it, an unguarded one (the control) is orphaned."""
    script = ("import subprocess, sys, time\n"
              "from rlver_lib.servers import die_with_parent\n"
              f"child = subprocess.Popen(['sleep', '60'], preexec_fn={'die_with_parent()' if guarded else 'None'})\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert process_alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while process_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_alive(child) is not guarded
    finally:
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


def test_openai_backend_against_real_server(openai_server):
    conversations = [CONVERSATIONS[0], CONVERSATIONS[1], CONVERSATIONS[0], CONVERSATIONS[1]]
    sampling = SamplingParams(temperature=0, max_new_tokens=120, seed=0)  # room to close the object
    with OpenAIBackend(openai_server, "smollm2", timeout_s=120, max_retries=1, concurrency=4) as client:
        gens = client.generate(conversations, sampling, json_schema=APPRAISAL_SCHEMA)
        for gen in gens:
            jsonschema.validate(json.loads(gen.text, strict=False), APPRAISAL_SCHEMA)
            assert gen.meta["attempts"] == 1
        # order kept under concurrency: the server's prompt-token counts follow the
        # conversations (the long one second and fourth)
        prompt_tokens = [g.meta["usage"]["prompt_tokens"] for g in gens]
        assert prompt_tokens[0] == prompt_tokens[2] < prompt_tokens[1] == prompt_tokens[3]
        [plain] = client.generate(CONVERSATIONS[2:], SamplingParams(temperature=0, max_new_tokens=16))
        assert plain.text and plain.meta["usage"]["completion_tokens"] <= 16


# ---------------------------------------------------------------- OpenAI HTTP, retries and timeouts

COMPLETION = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
              "usage": {"completion_tokens": 1}}


class _ScriptedServer:
    """A loopback HTTP server: the first ``fail`` requests get ``status`` (or sleep ``sleep_s``)."""

    def __init__(self, *, fail: int = 0, status: int = 503, sleep_s: float = 0.0):
        self.fail, self.status, self.sleep_s = fail, status, sleep_s
        self.requests = 0
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                    server.bodies.append(body)
                    failing = server.requests <= server.fail
                if failing and server.sleep_s:
                    time.sleep(server.sleep_s)
                code = server.status if failing and not server.sleep_s else 200
                answer = json.dumps(COMPLETION if code == 200 else {"error": "scripted"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _client(url, **kwargs):
    return OpenAIBackend(url, "m", backoff_s=0.01, **{"timeout_s": 5.0, **kwargs})


@pytest.mark.timeout(30)
def test_retries_then_succeeds_on_5xx():
    with _ScriptedServer(fail=2, status=503) as server, _client(server.url, max_retries=2) as client:
        [gen] = client.generate(CONVERSATIONS[:1], SamplingParams())
    assert gen.text == "ok" and gen.meta["attempts"] == 3 and server.requests == 3


@pytest.mark.timeout(30)
def test_gives_up_after_bounded_retries_on_429():
    with _ScriptedServer(fail=100, status=429) as server, _client(server.url, max_retries=2) as client:
        with pytest.raises(BackendError, match="after 3 attempts: HTTP 429"):
            client.generate(CONVERSATIONS[:1], SamplingParams())
    assert server.requests == 3


@pytest.mark.timeout(30)
def test_client_error_is_not_retried():
    with _ScriptedServer(fail=100, status=404) as server, _client(server.url, max_retries=3) as client:
        with pytest.raises(BackendError, match="HTTP 404") as info:
            client.generate(CONVERSATIONS[:1], SamplingParams())
    assert server.requests == 1 and info.value.results == [None]


@pytest.mark.timeout(30)
def test_timeout_is_retried_and_bounded():
    with _ScriptedServer(fail=100, sleep_s=3.0) as server, \
            _client(server.url, max_retries=1, timeout_s=0.3) as client:
        start = time.monotonic()
        with pytest.raises(BackendError, match="after 2 attempts: ReadTimeout"):
            client.generate(CONVERSATIONS[:1], SamplingParams())
        elapsed = time.monotonic() - start
    assert server.requests == 2 and elapsed < 2.5


@pytest.mark.timeout(30)
def test_partial_batch_failure_keeps_successes():
    with _ScriptedServer(fail=1, status=500) as server, \
            _client(server.url, max_retries=0, concurrency=1) as client:
        with pytest.raises(BackendError, match="1 of 3 requests failed") as info:
            client.generate(CONVERSATIONS, SamplingParams())
    assert server.requests == 3
    assert info.value.results[0] is None and [g.text for g in info.value.results[1:]] == ["ok", "ok"]


@pytest.mark.timeout(30)
def test_connection_refused_is_bounded():
    from conftest import free_port

    with _client(f"http://127.0.0.1:{free_port()}", max_retries=2) as client:
        with pytest.raises(BackendError, match="after 3 attempts: ConnectError"):
            client.generate(CONVERSATIONS[:1], SamplingParams())


@pytest.mark.timeout(30)
def test_request_body_is_openai_json_schema_with_per_conversation_seeds():
    with _ScriptedServer() as server, _client(server.url, response_format="json_schema") as client:
        client.generate(CONVERSATIONS[:2], SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=7, seed=40),
                        json_schema=APPRAISAL_SCHEMA)
    bodies = sorted(server.bodies, key=lambda b: b["messages"] == CONVERSATIONS[1])
    assert [b["messages"] for b in bodies] == CONVERSATIONS[:2]
    seeds = [b["seed"] for b in bodies]
    assert seeds[0] != seeds[1] and all(0 <= s < 2**31 for s in seeds)
    # a conversation's seed depends on its content, not on its batch or position
    with _ScriptedServer() as server, _client(server.url, response_format="json_schema") as client:
        client.generate([CONVERSATIONS[1]], SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=7, seed=40),
                        json_schema=APPRAISAL_SCHEMA)
    assert server.bodies[0]["seed"] == seeds[1]
    assert bodies[0]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "response", "schema": APPRAISAL_SCHEMA, "strict": True}}
    assert (bodies[0]["temperature"], bodies[0]["top_p"], bodies[0]["max_tokens"]) == (0.5, 0.9, 7)


# ---------------------------------------------------------------- structured_batch


class _ScriptedJSON:
    """Answers each conversation (by its content) with the next of its scripted outputs; records each call.
    ``error`` is raised instead of answering on the call numbered ``error_call``."""

    def __init__(self, script, error=None, error_call=0):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls = []
        self.error, self.error_call = error, error_call

    def generate(self, conversations, sampling, json_schema=None):
        self.calls.append(([c[-1]["content"] for c in conversations], sampling.seed))
        if self.error is not None and len(self.calls) - 1 == self.error_call:
            raise self.error
        return [Generation(text=self.script[c[-1]["content"]].pop(0)) for c in conversations]


def _parse_v(text, item):
    """``{"v": value}`` -> value; invalid JSON is unusable (with its reason); ``{"v": null}`` returns None."""
    try:
        return json.loads(text)["v"]
    except json.JSONDecodeError:
        raise UnusableOutput(f"not JSON: {text}") from None


def _ask(item):
    return [{"role": "user", "content": item}]


_SCRIPT = {"a": ['{"v": 1}'], "b": ["bad", '{"v": 2}'], "c": ["bad", "bad", "bad"], "d": ['{"v": null}', '{"v": 4}']}


def test_structured_batch_resends_only_the_failed_items_at_seed_plus_attempt():
    backend = _ScriptedJSON(_SCRIPT)
    results, died = structured_batch(backend, ["a", "b", "c", "d"], {"type": "object"}, _parse_v,
                                     SamplingParams(seed=10), max_retries=2, render=_ask, name="judge")
    # attempt 0 sends all four; b, c (bad JSON) and d (None) are asked again; only c a third time
    assert backend.calls == [(["a", "b", "c", "d"], 10), (["b", "c", "d"], 11), (["c"], 12)]
    assert [r.value for r in results] == [1, 2, None, 4] and died is None
    assert [r.attempts for r in results] == [1, 2, 3, 2]
    assert results[1].raw_outputs == ["bad", '{"v": 2}']
    assert results[1].failures == ["judge attempt 1: not JSON: bad"]
    assert results[2].failures == [f"judge attempt {n}: not JSON: bad" for n in (1, 2, 3)]
    assert results[3].failures == ["judge attempt 1: unusable output"]


def test_structured_batch_batches_per_attempt_and_takes_a_seed_function():
    backend = _ScriptedJSON(_SCRIPT)
    results, _ = structured_batch(backend, ["a", "b", "c", "d"], {}, _parse_v, SamplingParams(seed=None),
                                  max_retries=1, render=_ask, batch_size=2, attempt_seed=lambda a: 100 * a + 7)
    assert backend.calls == [(["a", "b"], 7), (["c", "d"], 7), (["b", "c"], 107), (["d"], 107)]
    assert [r.value for r in results] == [1, 2, None, 4] and results[2].attempts == 2
    # no seed and no seed function: every attempt unseeded
    backend = _ScriptedJSON(_SCRIPT)
    structured_batch(backend, ["b"], {}, _parse_v, SamplingParams(), max_retries=1, render=_ask)
    assert backend.calls == [(["b"], None), (["b"], None)]


def test_structured_batch_renders_when_sending():
    accepted = []

    def parse(text, item):
        value = _parse_v(text, item)
        if value is not None:
            accepted.append(value)
        return value

    backend = _ScriptedJSON({"b after 0": ["bad"], "c after 0": ["bad"], "b after 1": ['{"v": 2}'],
                             "c after 1": ["bad"], "a after 0": ['{"v": 1}']})
    results, _ = structured_batch(backend, ["a", "b", "c"], {}, parse, SamplingParams(seed=0), max_retries=1,
                                  render=lambda item: _ask(f"{item} after {len(accepted)}"))
    assert [c[0] for c in backend.calls] == [["a after 0", "b after 0", "c after 0"], ["b after 1", "c after 1"]]
    assert accepted == [1, 2] and [r.value for r in results] == [1, 2, None]


def test_structured_batch_backend_errors():
    # not tolerated: the error propagates
    with pytest.raises(BackendError, match="down"):
        structured_batch(_ScriptedJSON(_SCRIPT, BackendError("down")), ["a"], {}, _parse_v, SamplingParams(seed=0),
                         max_retries=2, render=_ask)
    # tolerated: the call's items fail and are asked again
    backend = _ScriptedJSON(_SCRIPT, BackendError("down"))
    results, died = structured_batch(backend, ["a", "b"], {}, _parse_v, SamplingParams(seed=0), max_retries=1,
                                     render=_ask, name="reply", tolerate_errors=True)
    assert backend.calls == [(["a", "b"], 0), (["a", "b"], 1)] and died is None
    assert [r.value for r in results] == [1, None]
    assert results[0].failures == ["reply attempt 1: backend error: down"] and results[0].raw_outputs == ['{"v": 1}']
    assert results[1].attempts == 2 and results[1].raw_outputs == ["bad"]
    # the backend died: no retry; one line for the attempt that was not made
    backend = _ScriptedJSON(_SCRIPT, BackendDied("gone"))
    results, died = structured_batch(backend, ["a"], {}, _parse_v, SamplingParams(seed=0), max_retries=2,
                                     render=_ask, name="reply", tolerate_errors=True)
    assert len(backend.calls) == 1 and died == "gone"
    assert results[0].failures == ["reply attempt 1: backend died: gone", "reply: backend died: gone"]
    assert results[0].attempts == 1 and results[0].value is None
    # it died on the last attempt: nothing left to record
    backend = _ScriptedJSON(_SCRIPT, BackendDied("gone"), error_call=1)
    results, died = structured_batch(backend, ["b"], {}, _parse_v, SamplingParams(seed=0), max_retries=1,
                                     render=_ask, name="reply", tolerate_errors=True)
    assert died == "gone" and results[0].failures == ["reply attempt 1: not JSON: bad",
                                                      "reply attempt 2: backend died: gone"]
    # died in an earlier call: nothing is sent
    backend = _ScriptedJSON(_SCRIPT)
    results, died = structured_batch(backend, ["a", "b"], {}, _parse_v, SamplingParams(seed=0), max_retries=2,
                                     render=_ask, name="reply", tolerate_errors=True, died="earlier")
    assert backend.calls == [] and died == "earlier"
    assert [(r.attempts, r.failures) for r in results] == [(0, ["reply: backend died: earlier"])] * 2


# ---------------------------------------------------------------- next-token log-probs, prompt lengths, sampling fields


def test_transformers_next_token_logprobs_match_a_plain_forward_pass(backend, embedded_policy):
    model, _ = embedded_policy
    tops = backend.next_token_logprobs(CONVERSATIONS, top_n=5)
    for conv, top in zip(CONVERSATIONS, tops):
        # independently: one unpadded forward pass, log-softmax of the last position
        ids = torch.tensor([backend.prompt_ids(conv)])
        with torch.no_grad():
            expected = torch.log_softmax(model(ids).logits[0, -1].float(), -1).topk(5)
        assert len(top) <= 5 and max(top.values()) <= 0.0
        first = backend.tokenizer.decode([int(expected.indices[0])])
        assert top[first] == pytest.approx(float(expected.values[0]), abs=1e-4)  # left padding changes nothing
        # the most likely token is what greedy decoding emits first
        [greedy] = backend.generate([conv], SamplingParams(temperature=0, max_new_tokens=1))
        assert greedy.completion_ids[0] == int(expected.indices[0])
    assert backend.prompt_tokens(CONVERSATIONS) == [len(backend.prompt_ids(c)) for c in CONVERSATIONS]


def test_llama_server_next_token_logprobs_and_prompt_tokens(llama_backend):
    sampling = SamplingParams(temperature=0, max_new_tokens=1)
    tops = llama_backend.next_token_logprobs(CONVERSATIONS, top_n=10)
    for conv, top in zip(CONVERSATIONS, tops):
        assert 1 <= len(top) <= 10 and sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-6
        [greedy] = llama_backend.generate([conv], sampling)
        # greedy's first token is the most likely one the server reports
        assert max(top, key=top.get) == greedy.text or greedy.text.startswith(max(top, key=top.get).strip())
        # the server's own count of the prompt, from a real completion, equals the exact count
        assert llama_backend.prompt_tokens([conv]) == [greedy.meta["usage"]["prompt_tokens"]]


def test_a_request_too_long_for_the_context_fails_alone(llama_backend):
    """One conversation of the batch exceeds the slot's context: it fails, the others keep
    their outputs (structured_batch asks again only for it)."""
    too_long = [{"role": "user", "content": "word " * 2000}]
    items = [CONVERSATIONS[0], too_long, CONVERSATIONS[2]]
    results, died = structured_batch(
        llama_backend, items, APPRAISAL_SCHEMA, lambda text, _: json.loads(text, strict=False),
        SamplingParams(temperature=0, max_new_tokens=60, seed=0), max_retries=1, tolerate_errors=True)
    assert died is None
    assert results[0].value is not None and results[2].value is not None
    assert (results[0].attempts, results[2].attempts) == (1, 1)
    assert results[1].value is None and results[1].attempts == 2
    assert all("backend error" in f and "HTTP 400" in f for f in results[1].failures)


@pytest.mark.timeout(30)
def test_every_sampling_parameter_is_sent():
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, seed=1, top_k=0, min_p=0.0,
                              repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3)
    with _ScriptedServer() as server, _client(server.url) as client:
        client.generate(CONVERSATIONS[:1], sampling)
    body = server.bodies[0]
    assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_penalty",
                                 "presence_penalty", "frequency_penalty", "max_tokens")} == {
        "temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.1,
        "repeat_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3, "max_tokens": 5}
    # a hosted API that refuses unknown fields gets OpenAI's own, and a cut it cannot send is an error
    with _ScriptedServer() as server, _client(server.url, sampling_fields="openai") as client:
        client.generate(CONVERSATIONS[:1], SamplingParams(temperature=0.7))
        assert "top_k" not in server.bodies[0] and server.bodies[0]["presence_penalty"] == 0.0
        with pytest.raises(ValueError, match="top_k=40"):
            client.generate(CONVERSATIONS[:1], SamplingParams(top_k=40))
