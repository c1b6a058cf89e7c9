"""The GPU path, checked on CPU: paper recipes and accelerate configs validate, vLLM
is never imported by CPU code, the vLLM-independent parts of VLLMBackend (adapter
versions, sampling translation, output conversion) behave, and a saved LoRA adapter
hands the updated policy over exactly (transformers backend, embedded SmolLM2), and
``benchmarks/gpu_check.py`` fails fast without CUDA and completes its ``--dry-run``.

Runtime, measured on 2 CPU cores shared with other jobs (load average 6-8): 45 s for
the adapter hand-over (two SmolLM2 loads, 8-token greedy decodes), 145 s for the
gpu_check dry run (two child processes: a 2 x 4-token batch and one tiny GRPO step),
15 s for the served-simulator check (shares the session's llama.cpp server),
everything else < 5 s; about 105 s of CPU time in all.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlver_lib.backends import BackendError, SamplingParams
from rlver_lib.config import load_config
from rlver_lib.vllm_backend import (
    AdapterVersion,
    adapter_version,
    chat_prompt_ids,
    generation_from_vllm,
    request_seed,
    sampling_kwargs,
    save_policy_adapter,
    stale_adapter_dirs,
    structured_output_kwargs,
    vllm_max_lora_rank,
)

ROOT = Path(__file__).resolve().parents[1]
PAPER_PARAMS = sorted((ROOT / "params").glob("paper-*.yaml"))
ACCELERATE_PARAMS = ROOT / "params" / "accelerate"


# ----------------------------------------------------------------- params files


def test_eight_paper_recipes_cover_the_grid():
    names = {p.stem for p in PAPER_PARAMS}
    expected = {
        f"paper-{a}-{t}-{d}"
        for a, t, d in itertools.product(["ppo", "grpo"], ["think", "nothink"], ["moderate", "hard"])
    }
    assert names == expected


@pytest.mark.parametrize("path", PAPER_PARAMS, ids=lambda p: p.stem)
def test_paper_recipe_validates_with_paper_settings(path):
    cfg = load_config(path)
    _, algo, mode, difficulty = path.stem.split("-")
    assert cfg.run_name == path.stem
    assert cfg.training.algorithm == algo
    assert cfg.policy.think is (mode == "think")
    assert cfg.simulator.difficulty == difficulty
    assert cfg.policy.model == "Qwen/Qwen2.5-7B-Instruct"
    assert cfg.policy.backend == "vllm"
    assert cfg.simulator.backend == "openai"
    assert cfg.simulator.base_url == "http://localhost:8000/v1"
    # paper settings (RLVER §4): 32 scenarios/step, GRPO n=4, T=1.0, <= 8 turns,
    # clip 0.2, entropy 0.001, no KL
    assert cfg.training.scenarios_per_step == 32
    assert cfg.training.group_size == (4 if algo == "grpo" else 1)
    assert cfg.policy.temperature == 1.0
    assert cfg.rollout.max_turns == 8
    assert cfg.training.clip_eps == 0.2
    assert cfg.training.entropy_coef == 0.001
    assert cfg.training.kl_coef == 0.0
    assert cfg.scenarios.train == "data/rlver_profiles/train_profile.jsonl"
    assert vllm_max_lora_rank(cfg.policy.lora.r) == cfg.policy.lora.r


@pytest.mark.parametrize(
    "name, distributed_type, zero_stage",
    [("ddp", "MULTI_GPU", None), ("zero2", "DEEPSPEED", 2)],
)
def test_accelerate_config_parses_with_accelerate(name, distributed_type, zero_stage):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(ACCELERATE_PARAMS / f"{name}.yaml"))
    assert isinstance(cfg, ClusterConfig)
    assert cfg.distributed_type.value == distributed_type
    assert str(cfg.mixed_precision) == "bf16"
    assert cfg.num_processes >= 2
    assert cfg.deepspeed_config.get("zero_stage") == zero_stage


# ----------------------------------------------------------------- lazy import


def test_cpu_imports_never_import_vllm():
    code = (
        "import sys, rlver_lib, rlver_lib.vllm_backend, rlver_lib.models, rlver_lib.backends\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def test_backend_without_vllm_names_the_extra():
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed here")
    from rlver_lib.vllm_backend import VLLMBackend

    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'"):
        VLLMBackend("any-model", lora_rank=8)


# ----------------------------------------------------------------- pure helpers


@pytest.mark.parametrize("rank, slot", [(1, 1), (2, 8), (8, 8), (9, 16), (64, 64), (300, 320), (512, 512)])
def test_lora_rank_rounds_up_to_a_vllm_slot(rank, slot):
    assert vllm_max_lora_rank(rank) == slot


@pytest.mark.parametrize("rank", [0, 513])
def test_lora_rank_out_of_range(rank):
    with pytest.raises(ValueError):
        vllm_max_lora_rank(rank)


def test_adapter_versions_are_named_and_numbered_by_step(tmp_path):
    assert adapter_version(tmp_path, 0) == AdapterVersion(0, "policy-step000000", 1, tmp_path / "policy-step000000")
    assert adapter_version(tmp_path, 41).lora_id == 42
    with pytest.raises(ValueError):
        adapter_version(tmp_path, -1)


def test_stale_adapters_are_the_oldest_by_step_number(tmp_path):
    for step in (2, 10, 1):
        adapter_version(tmp_path, step).path.mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "policy-step000099").write_text("a file, not a version")
    assert stale_adapter_dirs(tmp_path, keep=2) == [tmp_path / "policy-step000001"]
    assert stale_adapter_dirs(tmp_path, keep=3) == []
    with pytest.raises(ValueError):
        stale_adapter_dirs(tmp_path, keep=0)


def test_request_seeds_differ_within_a_batch_and_reproduce():
    seeds = [request_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [request_seed(7, i) for i in range(64)]
    assert seeds != [request_seed(8, i) for i in range(64)]
    assert all(0 <= s < 2**31 for s in seeds)
    assert request_seed(None, 3) is None


def test_sampling_translation():
    kwargs = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=33, seed=5), 2, [2])
    assert kwargs == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 33,
        "seed": request_seed(5, 2),
        "logprobs": 0,
        "stop_token_ids": [2],
    }
    with pytest.raises(ValueError, match="top_p"):
        sampling_kwargs(SamplingParams(top_p=0.0), 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sampling_kwargs(SamplingParams(max_new_tokens=0), 0)


@dataclass
class _Params:
    json: dict


def test_structured_output_for_new_and_old_vllm():
    schema = {"type": "object", "properties": {"change": {"type": "integer"}}}
    new = SimpleNamespace(StructuredOutputsParams=_Params, GuidedDecodingParams=_Params)
    old = SimpleNamespace(GuidedDecodingParams=_Params)
    assert structured_output_kwargs(new, schema) == {"structured_outputs": _Params(json=schema)}
    assert structured_output_kwargs(old, schema) == {"guided_decoding": _Params(json=schema)}
    assert structured_output_kwargs(new, None) == {}
    with pytest.raises(BackendError):
        structured_output_kwargs(SimpleNamespace(), schema)


# ----------------------------------------------------------------- output conversion


@dataclass
class _Logprob:  # shaped like vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _request_output(token_ids, logprobs, finish_reason="stop", stop_reason=None):
    completion = SimpleNamespace(
        index=0, text="Hi there", token_ids=token_ids, logprobs=logprobs,
        cumulative_logprob=None, finish_reason=finish_reason, stop_reason=stop_reason,
    )
    return SimpleNamespace(request_id="7", prompt="", prompt_token_ids=[1, 2, 3], outputs=[completion], finished=True)


def test_conversion_takes_the_sampled_tokens_logprob():
    # the sampled token at position 1 (id 9) is not the most likely one (id 4)
    out = _request_output(
        (5, 9, 2),
        [{5: _Logprob(-0.1, 1)}, {4: _Logprob(-0.3, 1), 9: _Logprob(-2.5, 3)}, {2: _Logprob(-0.05, 1)}],
        stop_reason=None,
    )
    gen = generation_from_vllm(out, "policy-step000003")
    assert gen.text == "Hi there"
    assert gen.prompt_ids == [1, 2, 3]
    assert gen.completion_ids == [5, 9, 2]
    assert gen.logprobs == [-0.1, -2.5, -0.05]
    assert gen.finish_reason == "stop"
    assert gen.meta == {"stop_reason": None, "adapter": "policy-step000003"}


def test_conversion_maps_length_and_rejects_bad_outputs():
    assert generation_from_vllm(_request_output((5,), [{5: _Logprob(-1.0)}], "length")).finish_reason == "length"
    with pytest.raises(BackendError, match="abort"):
        generation_from_vllm(_request_output((5,), [{5: _Logprob(-1.0)}], "abort"))
    with pytest.raises(BackendError, match="log-probs"):
        generation_from_vllm(_request_output((5, 6), None))
    with pytest.raises(BackendError, match="log-probs"):
        generation_from_vllm(_request_output((5, 6), [{5: _Logprob(-1.0)}]))
    with pytest.raises(BackendError, match="sampled token 6"):
        generation_from_vllm(_request_output((5, 6), [{5: _Logprob(-1.0)}, {4: _Logprob(-1.0)}]))


# ----------------------------------------------------------------- adapter hand-over (SmolLM2)

CONVERSATION = [{"role": "user", "content": "I failed my driving test again and I feel stupid."}]


@pytest.fixture(scope="module")
def policy_cfg():
    from rlver_lib.config import PolicyConfig

    return PolicyConfig(dtype="float32", max_new_tokens=8)


@pytest.fixture(scope="module")
def live_policy(policy_cfg):
    """The learner's model: SmolLM2 with a fresh LoRA adapter (peft)."""
    from peft import LoraConfig, get_peft_model

    from rlver_lib.models import load_policy

    torch.manual_seed(0)
    base, tokenizer = load_policy(policy_cfg, trainable=True)
    lora = policy_cfg.lora
    model = get_peft_model(
        base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules)
    )
    model.eval()
    return model, tokenizer


def _greedy_and_logits(model, tokenizer):
    from rlver_lib.backends import TransformersBackend

    gen = TransformersBackend(model, tokenizer).generate(
        [CONVERSATION], SamplingParams(temperature=0.0, max_new_tokens=8, seed=0)
    )[0]
    ids = torch.tensor([gen.prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return gen, logits


def test_chat_prompt_ids_match_the_rendered_template(live_policy):
    _, tokenizer = live_policy
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert chat_prompt_ids(tokenizer, CONVERSATION) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_saved_adapter_reproduces_the_updated_policy(live_policy, policy_cfg, tmp_path):
    from rlver_lib.models import load_policy

    model, tokenizer = live_policy
    before_gen, before_logits = _greedy_and_logits(model, tokenizer)

    # a LoRA update: move every B matrix away from its zero initialisation
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    live_gen, live_logits = _greedy_and_logits(model, tokenizer)

    version = save_policy_adapter(model, tmp_path, step=3)
    assert version.path == tmp_path / "policy-step000003"
    assert (version.path / "adapter_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy-step000003"]  # no temp folder left
    with pytest.raises(ValueError, match="already saved"):
        save_policy_adapter(model, tmp_path, step=3)

    fresh, fresh_tok = load_policy(policy_cfg.model_copy(update={"adapter": str(version.path)}))
    fresh_gen, fresh_logits = _greedy_and_logits(fresh, fresh_tok)

    assert fresh_gen.prompt_ids == live_gen.prompt_ids
    assert fresh_gen.completion_ids == live_gen.completion_ids
    torch.testing.assert_close(fresh_logits, live_logits, rtol=1e-4, atol=1e-4)
    assert (live_logits - before_logits).abs().max().item() > 1e-2
    assert live_gen.completion_ids != before_gen.completion_ids


def test_saving_a_plain_model_is_refused(live_policy, tmp_path):
    model, _ = live_policy
    with pytest.raises(TypeError, match="PeftModel"):
        save_policy_adapter(model.get_base_model(), tmp_path, step=0)


# ----------------------------------------------------------------- benchmarks/gpu_check.py


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_check_fails_fast_without_cuda(tmp_path, capsys):
    assert _gpu_check().main(["--out", str(tmp_path / "out")]) == 2
    assert "CUDA" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gpu_check_dry_run_writes_its_figures(tmp_path):
    out = tmp_path / "out"
    assert _gpu_check().main(["--out", str(out), "--dry-run"]) == 0
    figures = json.loads((out / "figures.json").read_text(encoding="utf-8"))
    assert figures["environment"]["dry_run"] is True
    tf = figures["throughput"]["transformers"]
    assert 2 <= tf["completion_tokens"] <= 2 * 4  # batch 2, at most 4 new tokens each
    assert tf["tokens_per_s"] == pytest.approx(tf["completion_tokens"] / tf["seconds"])
    assert figures["throughput"]["vllm"] == "skipped (dry run)"
    train = figures["train"]
    assert train["steps"] == 1
    row = train["metrics"][0]
    # 1 scenario x a group of 4, mini-batches of 2 dialogues: 2 optimizer steps of 2 samples
    # (one turn each); the hashed rule reward gives the group signal, so the update ran
    assert (row["step"], row["dialogues"], row["samples"]) == (1, 4, 4)
    assert (row["optimizer_steps"], row["samples_per_update"], row["dialogues_per_update"]) == (2, 2.0, 2.0)
    assert row["zero_variance_group_share"] == 0.0
    assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
    # float32 transformers rollouts: the learner's old log-probs are the sampling ones, the
    # first optimizer step runs at ratio 1 (a wrong temperature, context or chunking shows here)
    assert row["logprob_gap_max"] < 1e-4 and abs(row["is_weight_mean"] - 1.0) < 1e-4
    records = [json.loads(line) for line in (out / "runs" / "grpo" / "train" / "dialogues"
                                              / "step_000001.jsonl").read_text(encoding="utf-8").splitlines()]
    assert row["reward_mean"] == pytest.approx(sum(r["final_emotion"] for r in records) / 100 / len(records))
    assert len({r["reward"] for r in records}) > 1
    text = (out / "table.txt").read_text(encoding="utf-8")
    assert "rollout tokens/s, transformers" in text and "GRPO step 1" in text


def test_policy_backend_factory_builds_vllm_from_the_config(monkeypatch):
    from rlver_lib import models, vllm_backend
    from rlver_lib.config import PolicyConfig

    calls = []
    monkeypatch.setattr(vllm_backend.VLLMBackend, "from_config",
                        classmethod(lambda cls, cfg, path, tokenizer=None, **kw:
                                    calls.append((cfg, path, tokenizer)) or "engine"))
    cfg = PolicyConfig(backend="vllm")
    assert models.make_policy_backend(cfg, object(), "the-tokenizer") == "engine"
    assert calls == [(cfg, models.policy_model_path(cfg.model), "the-tokenizer")]


def test_paper_simulator_section_drives_a_served_model(openai_server, monkeypatch):
    """The recipes' `simulator.backend: openai` section, pointed at a real local
    OpenAI-compatible server (llama.cpp over SmolLM2 standing in for `vllm serve`),
    gets schema-valid structured replies for a batch in flight."""
    import jsonschema

    from rlver_lib.backends import OpenAIBackend
    from rlver_lib.models import make_simulator_backend
    from rlver_lib.simulator import REPLY_SCHEMA

    cfg = load_config(ROOT / "params" / "paper-grpo-nothink-moderate.yaml",
                      [f"simulator.base_url={openai_server}/v1", "simulator.model=smollm2",
                       "simulator.concurrency=2"])
    monkeypatch.delenv(cfg.simulator.api_key_env, raising=False)
    conversations = [[{"role": "user", "content": f"Say hello to person number {i} in one short sentence."}]
                     for i in range(3)]
    with make_simulator_backend(cfg.simulator, seed=0) as backend:
        assert isinstance(backend, OpenAIBackend)
        assert backend.concurrency == 2
        gens = backend.generate(conversations, SamplingParams(temperature=0.0, max_new_tokens=96, seed=0),
                                json_schema=REPLY_SCHEMA)
    assert len(gens) == 3
    for gen in gens:
        jsonschema.validate(json.loads(gen.text, strict=False), REPLY_SCHEMA)
