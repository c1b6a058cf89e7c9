"""In-process vLLM policy backend for GPU rollouts (DESIGN §3 "backends", issue: GPU path).

:class:`VLLMBackend` runs the policy's base model in ``vllm.LLM`` with LoRA enabled
and generates with the *current* LoRA adapter: after every learner update the
trainer calls :meth:`VLLMBackend.sync_policy`, which saves the peft adapter to a
versioned folder and switches to a new ``LoRARequest`` for the next rollout.
Each :class:`~rlver_lib.backends.Generation` carries the exact prompt token ids,
the sampled completion ids (end-of-turn token included when emitted) and their
log-probabilities under the sampling distribution (vLLM ``processed_logprobs``,
i.e. after temperature / top-p), so the learner trains on exactly what was sampled
(DESIGN §2, "train on the ids that were sampled").

vLLM is CUDA-only and an optional extra (``pip install '.[gpu]'``); it is imported
inside :class:`VLLMBackend` only, so importing this module never imports vLLM.
The vLLM-independent logic (adapter versions, sampling translation, output
conversion) lives in small pure functions below, tested on CPU.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from rlver_lib.backends import BackendError, Conversation, Generation, SamplingParams

if TYPE_CHECKING:
    from rlver_lib.config import PolicyConfig

#: LoRA ranks vLLM can allocate for (``vllm.config.LoRAConfig.max_lora_rank``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Name prefix of the versioned adapter folders written by :meth:`VLLMBackend.sync_policy`.
ADAPTER_PREFIX = "policy-step"
#: vLLM id of an adapter loaded at start-up (``policy.adapter``); synced versions use ``step + 1``.
INITIAL_ADAPTER_ID = 2**31 - 1
_INSTALL_HINT = "vLLM is not installed; the GPU path needs it: pip install '.[gpu]' (CUDA only)"


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
    version.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=version.path.parent, prefix=f".{version.name}."))
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        os.replace(tmp, version.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return version


def import_vllm() -> Any:
    """Import and return the ``vllm`` module; ``ImportError`` with the install hint if absent."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return vllm


# --------------------------------------------------------------------------- backend


def _colocate_distributed_env() -> None:
    """Environment for ``distributed_executor_backend="external_launcher"``.

    The engine joins this process's torch.distributed world (one vLLM engine per
    rank under ``accelerate launch``; a world of one otherwise), the way TRL's
    colocate mode does.
    """
    from accelerate import PartialState
    from trl.trainer.utils import ensure_master_addr_port

    state = PartialState()
    os.environ["RANK"] = str(state.process_index)
    os.environ["LOCAL_RANK"] = str(state.local_process_index)
    os.environ["WORLD_SIZE"] = str(state.num_processes)
    ensure_master_addr_port()


class VLLMBackend:
    """Policy rollouts with an in-process ``vllm.LLM`` and a per-step LoRA adapter.

    Args:
        model_path: base model (Hugging Face id or local folder, e.g.
            ``rlver_lib.models.policy_model_path(cfg.policy.model)``).
        lora_rank: rank r of the trained adapter; rounded up to a vLLM slot.
        max_loras: adapters resident on the GPU at once (one policy -> 1).
        gpu_memory_utilization: share of GPU memory vLLM may take (0, 1]; the
            learner lives on the same device, so keep room for it.
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"auto"``.
        seed: engine seed; per-request seeds come from ``SamplingParams.seed``.
        max_model_len: prompt + completion tokens per request.
        enforce_eager: skip CUDA graph capture (faster start, slower decode).
        adapter_root: folder for the versioned adapters (a private temp folder
            when ``None``); ``keep_adapters`` newest versions are kept on disk.
        initial_adapter: a saved peft adapter to generate with before the first
            :meth:`sync_policy` (``policy.adapter``); ``None`` = base model, which
            equals a freshly initialised LoRA (B = 0).
        tokenizer: the learner's tokenizer, so prompts are templated exactly as
            the learner sees them; ``None`` = vLLM's tokenizer for ``model_path``.

    Raises ``ImportError`` (with ``pip install '.[gpu]'``) when vLLM is missing and
    ``RuntimeError`` when no CUDA device is visible.
    """

    def __init__(
        self,
        model_path: str,
        *,
        lora_rank: int,
        max_loras: int = 1,
        gpu_memory_utilization: float = 0.5,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int = 4096,
        enforce_eager: bool = False,
        adapter_root: str | Path | None = None,
        keep_adapters: int = 2,
        initial_adapter: str | Path | None = None,
        tokenizer: Any = None,
    ):
        import torch

        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise RuntimeError("VLLMBackend needs a CUDA device; none is visible (use policy.backend=transformers)")
        from vllm.lora.request import LoRARequest

        self._vllm = vllm
        self._lora_request_cls = LoRARequest
        self.max_model_len = max_model_len
        self.keep_adapters = keep_adapters
        self.adapter_root = Path(adapter_root or tempfile.mkdtemp(prefix="rlver-policy-adapters-"))
        self.adapter_root.mkdir(parents=True, exist_ok=True)
        _colocate_distributed_env()
        self.llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_lora=True,
            max_lora_rank=vllm_max_lora_rank(lora_rank),
            max_loras=max_loras,
            logprobs_mode="processed_logprobs",
            distributed_executor_backend="external_launcher",
        )
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self._stop_ids = end_of_turn_ids(self.tokenizer)
        self.lora_request = None
        if initial_adapter is not None:
            self.lora_request = LoRARequest("policy-initial", INITIAL_ADAPTER_ID, str(initial_adapter))

    @classmethod
    def from_config(
        cls,
        policy_cfg: "PolicyConfig",
        tokenizer: Any = None,
        *,
        seed: int = 0,
        adapter_root: str | Path | None = None,
    ) -> "VLLMBackend":
        """Build from the ``policy`` section (what ``models.make_policy_backend`` calls):
        model resolved by ``rlver_lib.models.policy_model_path``, ``lora.r``,
        ``dtype``, ``gpu_memory_utilization``, ``adapter`` as the initial adapter,
        ``max_model_len = max_context_tokens + max_new_tokens``."""
        from rlver_lib.models import policy_model_path

        return cls(
            policy_model_path(policy_cfg.model),
            lora_rank=policy_cfg.lora.r,
            gpu_memory_utilization=policy_cfg.gpu_memory_utilization,
            dtype=policy_cfg.dtype,
            seed=seed,
            max_model_len=policy_cfg.max_context_tokens + policy_cfg.max_new_tokens,
            adapter_root=adapter_root,
            initial_adapter=policy_cfg.adapter,
            tokenizer=tokenizer,
        )

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """One completion per conversation, in order, with the current adapter.

        Prompts are built with the tokenizer's chat template and handed to vLLM
        as token ids, so ``Generation.prompt_ids`` is exactly the context the
        policy saw. Raises :class:`BackendError` when a prompt leaves no room for
        ``max_new_tokens`` within ``max_model_len``, or on a malformed output.
        """
        if not conversations:
            return []
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
