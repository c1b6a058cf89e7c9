"""Chat backends: one small protocol for every model the workbench talks to (docs/ARCHITECTURE.md "Code map").

A backend takes a batch of chat conversations (each a list of ``{"role": ..., "content": ...}``
messages) and returns one :class:`Generation` per conversation, in order. Sampling
settings and the seed come in a :class:`SamplingParams`; ``json_schema`` optionally
constrains the output to a JSON object of that schema, and :func:`structured_batch`
asks again for the outputs that cannot be used.

Implementations: :class:`TransformersBackend` (here: a local HF or peft model; token ids
and log-probs for training; xgrammar for structured output),
:class:`~rlver_lib.servers.LlamaServerBackend` (a GGUF model in its own ``llama-server``
process: crash-isolated, batched), :class:`~rlver_lib.openai_backend.OpenAIBackend` (any
OpenAI-compatible server, with timeouts, bounded retries and concurrent requests) and
``VLLMBackend`` in :mod:`rlver_lib.vllm_backend` (GPU, imported lazily).
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Callable, Iterator, Protocol, Self, Sequence, TypeVar, runtime_checkable

import numpy as np

from rlver_lib.config import SamplingParams

log = logging.getLogger(__name__)

Message = dict[str, str]
Conversation = list[Message]


@dataclass
class Generation:
    """One completion.

    ``text``: the decoded completion (no special tokens).
    For local policy backends the token-level view is filled in too:
    ``prompt_ids`` (the exact context the model saw, chat template applied),
    ``completion_ids`` (the sampled ids, including the end-of-turn token when the
    model emitted it) and ``logprobs`` (one float per completion id, log-probability
    under the sampling distribution). HTTP backends leave them ``None``.
    ``finish_reason``: ``"stop"`` (end-of-turn emitted) or ``"length"``.
    """

    text: str
    prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ChatBackend(Protocol):
    """Anything that turns a batch of conversations into completions."""

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """Return one :class:`Generation` per conversation, in the same order."""
        ...


@runtime_checkable
class PolicyBackend(ChatBackend, Protocol):
    """A :class:`ChatBackend` that generates the rollouts of a policy being trained:
    :class:`TransformersBackend` (the live model) or
    :class:`~rlver_lib.vllm_backend.VLLMBackend` (an engine with its own copy)."""

    def sync_policy(self, model: Any, step: int) -> Any:
        """Generate with ``model``'s weights (the trainer's policy after ``step`` updates) from now on."""
        ...


class BackendError(RuntimeError):
    """A backend call that failed after its bounded retries.

    ``results`` holds, for a batched call, the generations that did succeed
    (``None`` where a conversation failed), so a caller can keep them, and
    ``errors`` why each failed one failed (``None`` where it succeeded);
    ``status`` is the HTTP status of a rejected request (HTTP backends).
    """

    def __init__(self, message: str, results: list[Any] | None = None,
                 status: int | None = None, errors: list[str | None] | None = None):
        super().__init__(message)
        self.results = results
        self.errors = errors
        self.status = status


class BackendDied(BackendError):
    """The process serving a model is gone (crashed, killed, or never came up).

    Not retried: every later call fails the same way. ``signal`` names the signal
    that ended the process (``"SIGILL"``...), or is ``None`` for a plain exit.
    """

    def __init__(self, message: str, signal: str | None = None):
        super().__init__(message)
        self.signal = signal


def derive_seed(*parts: Any) -> int:
    """A 31-bit seed from any parts (``repr`` hashed with SHA-256); stable across runs."""
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def conversation_seed(seed: int | None, conversation: Conversation) -> int | None:
    """Seed of one conversation of a batch: derived from the call's ``seed`` and the
    conversation's content, so a conversation samples the same way whichever batch
    (and position) it is sent in. ``None`` when ``seed`` is ``None``."""
    if seed is None:
        return None
    return derive_seed(seed, json.dumps(list(conversation), sort_keys=True, ensure_ascii=False))


# ---------------------------------------------------------------- structured output with retries

Item = TypeVar("Item")
Held = TypeVar("Held")


class UnusableOutput(ValueError):
    """A structured output that cannot be used (the message says why)."""


@dataclass
class StructuredResult:
    """One item of :func:`structured_batch`: ``value`` (the parsed output, ``None`` when
    every attempt failed), ``raw_outputs`` (every text received, in order), ``failures``
    (why each failed attempt was unusable) and ``attempts`` (how often it was sent)."""

    value: Any = None
    raw_outputs: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    attempts: int = 0


def structured_batch(
    backend: ChatBackend,
    items: Sequence[Item],
    json_schema: dict[str, Any],
    parse: Callable[[str, Item], Any],
    sampling: SamplingParams,
    *,
    max_retries: int,
    render: Callable[[Item], Conversation] | None = None,
    attempt_seed: Callable[[int], int | None] | None = None,
    batch_size: int | None = None,
    name: str = "output",
    tolerate_errors: bool = False,
    died: str | None = None,
) -> tuple[list[StructuredResult], str | None]:
    """One JSON-schema constrained output per item, asking again only for the unusable ones.

    Attempt ``a`` (0 to ``max_retries``) sends, in order, every item without a usable
    output yet, ``batch_size`` conversations per call (default: all in one call), each
    rendered by ``render(item)`` when it is sent (default: the item is the conversation),
    at seed ``attempt_seed(a)`` (default: ``sampling.seed + a``). Each output is parsed at
    once, in order, by ``parse(text, item)``: the value, or ``None`` or
    :class:`UnusableOutput` (the reason) when it cannot be used; failures read
    ``"<name> attempt <a + 1>: <reason>"``.

    Backend errors propagate unless ``tolerate_errors``: then a :class:`BackendError` fails
    the items of that call (``backend error: ...``; they are asked again), and a
    :class:`BackendDied` fails them (``backend died: ...``) and ends the retries: what is
    still pending records ``"<name>: backend died: <reason>"`` once, unsent. ``died`` (the
    reason from an earlier call) says the backend is gone already: nothing is sent.

    Returns one :class:`StructuredResult` per item, in order, and the reason the backend
    died (``died``, or this call's), else ``None``.
    """
    results = [StructuredResult() for _ in items]
    pending = list(range(len(items)))
    for attempt in range(max_retries + 1):
        if not pending:
            break
        if died is not None:
            for i in pending:
                results[i].failures.append(f"{name}: backend died: {died}")
            break
        if attempt_seed is not None:
            seed = attempt_seed(attempt)
        else:
            seed = None if sampling.seed is None else sampling.seed + attempt
        attempt_sampling = replace(sampling, seed=seed)
        size = batch_size or len(pending)
        still_pending = []
        for start in range(0, len(pending), size):
            chunk = pending[start:start + size]
            if died is not None:  # died earlier in this attempt: the rest is not sent
                for i in chunk:
                    results[i].failures.append(f"{name}: backend died: {died}")
                continue
            conversations = [render(items[i]) if render is not None else items[i] for i in chunk]
            problems: list[str | None] = [None] * len(chunk)
            try:
                texts: list[str | None] = [
                    g.text for g in backend.generate(conversations, attempt_sampling, json_schema=json_schema)]
            except BackendError as err:
                if not tolerate_errors:
                    raise
                texts, problems = _partial_results(err, len(chunk))
                if isinstance(err, BackendDied):
                    died = str(err)
            for i, text, problem in zip(chunk, texts, problems):
                result = results[i]
                result.attempts += 1
                reason = problem
                if text is not None:
                    result.raw_outputs.append(text)
                    try:
                        value = parse(text, items[i])
                    except UnusableOutput as err:
                        reason = str(err)
                    else:
                        if value is not None:
                            result.value = value
                            continue
                        reason = "unusable output"
                result.failures.append(f"{name} attempt {attempt + 1}: {reason}")
                still_pending.append(i)
        pending = still_pending
    return results, died


def _partial_results(err: BackendError, n: int) -> tuple[list[str | None], list[str | None]]:
    """``(texts, problems)`` of a batched call that raised ``err``: a request that failed
    fails alone (its problem names why), the others keep their text. A dead backend, or an
    error without per-request results, fails all ``n``."""
    kind = "died" if isinstance(err, BackendDied) else "error"
    if isinstance(err, BackendDied) or err.results is None or len(err.results) != n:
        return [None] * n, [f"backend {kind}: {err}"] * n
    errors = err.errors or [None] * n
    texts = [g.text if g is not None else None for g in err.results]
    problems = [None if g is not None else f"backend error: {e or err}" for g, e in zip(err.results, errors)]
    return texts, problems


# ---------------------------------------------------------------- next-token probabilities


class NextTokenScorer(Protocol):
    """A backend that can show its next-token distribution (the expected-value appraisal)."""

    def next_token_logprobs(self, conversations: Sequence[Conversation], top_n: int = 20) -> list[dict[str, float]]:
        """Per conversation, the ``top_n`` most likely first tokens of the assistant's answer
        (token text -> natural-log probability under the unmodified model, temperature 1,
        no cuts). Raises :class:`BackendError` (``errors`` per conversation) on failure."""
        ...


def answer_probability(top: dict[str, float], yes: Sequence[str] = ("yes",), no: Sequence[str] = ("no",)) -> float:
    """P(yes | yes or no) from a next-token distribution ``top`` (token -> log-prob).

    A token counts for an answer when, stripped of spaces and quotes and lower-cased, it is
    one of the answer's words (``"Yes"``, ``" yes"``, ``"YES"`` all count for ``yes``);
    their probabilities are summed. Returns a probability in [0, 1]. Raises
    :class:`UnusableOutput` when neither answer is among the tokens.
    """
    import math

    mass = {"yes": 0.0, "no": 0.0}
    for token, logprob in top.items():
        word = token.strip().strip("\"'“”‘’").lower()
        for answer, words in (("yes", yes), ("no", no)):
            if word in words:
                mass[answer] += math.exp(logprob)
    total = mass["yes"] + mass["no"]
    if total <= 0.0:
        shown = ", ".join(repr(t) for t in list(top)[:5])
        raise UnusableOutput(f"neither yes nor no among the top {len(top)} next tokens ({shown})")
    return mass["yes"] / total


# ---------------------------------------------------------------- transformers


@lru_cache(maxsize=8)
def _grammar_compiler(tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )
    return xgr.GrammarCompiler(info)


class SampledTokenLogprobs:
    """A ``transformers`` logits processor that records, on the device, the log-prob
    of each sampled token: ``log_softmax(scores / temperature)[token]`` per step.

    Called with the scores of step ``t``, it keeps their log-softmax (``[B, V]``)
    until step ``t + 1`` reveals the token that was drawn (``input_ids[:, -1]``), then
    keeps only that ``[B]`` column; :meth:`finish` adds the last step's. So decoding
    holds one step of ``[B, V]`` log-probs, not the logits of every step
    (``output_logits``: ``B x steps x V``). Placed before any other custom processor,
    it sees the model's logits before grammar masks; scores are returned unchanged.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.columns: list = []
        self._last = None

    def __call__(self, input_ids, scores):
        import torch

        if self._last is not None:
            self.columns.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, new_tokens):
        """``[B, steps]`` float32 log-probs of ``new_tokens`` (the generated ids)."""
        import torch

        step = len(self.columns)
        if self._last is not None and step < new_tokens.shape[1]:
            self.columns.append(self._last.gather(-1, new_tokens[:, step:step + 1]).squeeze(-1))
            self._last = None
        if not self.columns:
            return torch.zeros(new_tokens.shape, dtype=torch.float32, device=new_tokens.device)
        return torch.stack(self.columns, dim=1)[:, :new_tokens.shape[1]]


class Closing:
    """``with backend:`` closes it on the way out: the one ``__enter__``/``__exit__`` of
    every backend that holds a server process or a connection pool (``close()``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def close_backend(holder: Any) -> None:
    """Close a backend (a server it started, an HTTP client), or the ``backend`` of a
    simulator, judge or annotator that holds one; nothing when neither has ``close``."""
    close = getattr(holder, "close", None) or getattr(getattr(holder, "backend", None), "close", None)
    if callable(close):
        close()


@contextmanager
def closing_backend(holder: Held) -> Iterator[Held]:
    """``with closing_backend(simulator) as simulator:``: :func:`close_backend` on the way out."""
    try:
        yield holder
    finally:
        close_backend(holder)


class TransformersBackend:
    """Local Hugging Face chat model: batched, left-padded ``generate``.

    ``model`` is a causal LM or a ``peft.PeftModel`` (the trainer hands its live
    LoRA model in; generation runs in eval mode under ``torch.inference_mode`` and
    the training mode is restored afterwards). Conversations are rendered with
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``.

    Sampling: ``temperature == 0`` is greedy; otherwise multinomial sampling at
    ``temperature`` with nucleus ``top_p`` and no top-k cut, so the sampling
    distribution is the policy's own. With a ``seed`` the call runs under a forked
    torch RNG seeded with it (same seed and inputs -> same outputs; the caller's
    RNG state is left untouched).

    Each :class:`Generation` carries ``prompt_ids`` (the exact context, without
    padding), ``completion_ids`` (without padding, ending with the end-of-turn
    token when ``finish_reason == "stop"``) and ``logprobs``: for each completion
    id, ``log_softmax(logits / T)`` of the unconstrained model at the sampling
    temperature ``T`` (``T = 1`` for greedy) — what a training forward pass over
    ``prompt_ids + completion_ids`` recomputes. They are recorded on the device
    while decoding (:class:`SampledTokenLogprobs`: one step's ``[B, V]`` at a time,
    never the logits of every step); ``return_logprobs=False`` skips them
    (``logprobs`` is then ``None``). With a ``json_schema`` the tokens
    are drawn from the grammar-masked distribution (xgrammar logits processor,
    compact JSON without free whitespace).
    """

    def __init__(self, model, tokenizer, *, device=None, return_logprobs: bool = True):
        import torch

        self.model = model
        self.tokenizer = tokenizer
        self.return_logprobs = return_logprobs
        if device is not None:
            model.to(device)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.eos_ids = self._end_of_turn_ids()
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.policy_step = 0

    def _end_of_turn_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            ids.update([value] if isinstance(value, int) else value or [])
        if not ids:
            raise ValueError("the tokenizer and generation config define no end-of-sequence token")
        return tuple(sorted(ids))

    def prompt_ids(self, conversation: Conversation) -> list[int]:
        """Token ids of ``conversation`` with the chat template and generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            list(conversation), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def _json_processor(self, json_schema: dict[str, Any]):
        import xgrammar as xgr
        from transformers import LogitsProcessorList

        compiler = _grammar_compiler(
            self.tokenizer, int(self.model.config.vocab_size), self.eos_ids
        )
        grammar = compiler.compile_json_schema(json.dumps(json_schema), any_whitespace=False)
        return LogitsProcessorList([xgr.contrib.hf.LogitsProcessor(grammar)])

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """Generate one completion per conversation in a single batched call.

        Raises :class:`ValueError` on an empty conversation.
        """
        import torch
        from transformers import LogitsProcessorList

        if not conversations:
            return []
        if any(not conv for conv in conversations):
            raise ValueError("every conversation needs at least one message")
        prompts = [self.prompt_ids(conv) for conv in conversations]
        input_ids, attention_mask = self._left_padded(prompts)
        width = input_ids.shape[1]
        greedy = sampling.temperature == 0
        kwargs: dict[str, Any] = dict(
            max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
            pad_token_id=self.pad_id, eos_token_id=list(self.eos_ids),
            return_dict_in_generate=True, repetition_penalty=sampling.repetition_penalty,
        )
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          min_p=sampling.min_p or None)
        processors = LogitsProcessorList()
        recorder = None
        if self.return_logprobs:  # first, so it sees the logits before any grammar mask
            recorder = SampledTokenLogprobs(1.0 if greedy else sampling.temperature)
            processors.append(recorder)
        if json_schema is not None:
            processors.extend(self._json_processor(json_schema))
        if processors:
            kwargs["logits_processor"] = processors

        was_training = self.model.training
        self.model.eval()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.inference_mode(), torch.random.fork_rng(devices=devices):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                out = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device), **kwargs,
                )
        finally:
            self.model.train(was_training)
        new_tokens = out.sequences[:, width:]
        logprobs = recorder.finish(new_tokens).cpu().tolist() if recorder is not None else None
        new_tokens = new_tokens.cpu()
        return [
            self._generation(prompts[row], new_tokens[row].tolist(), None if logprobs is None else logprobs[row])
            for row in range(len(prompts))
        ]

    def _left_padded(self, prompts: list[list[int]]):
        """``(input_ids, attention_mask)``, both ``[B, width]`` long tensors, padded on the left."""
        import torch

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention_mask[row, width - len(ids):] = 1
        return input_ids, attention_mask

    def prompt_tokens(self, conversations: Sequence[Conversation]) -> list[int]:
        """Prompt length in tokens per conversation (chat template and generation prompt)."""
        return [len(self.prompt_ids(conv)) for conv in conversations]

    def next_token_logprobs(self, conversations: Sequence[Conversation], top_n: int = 20) -> list[dict[str, float]]:
        """Per conversation, the ``top_n`` most likely first answer tokens (decoded text ->
        ``log_softmax`` of the last position's logits, temperature 1): one batched forward
        pass over the prompts, no sampling. Tokens that decode to the same text are merged
        (their probabilities add)."""
        import torch

        if not conversations:
            return []
        input_ids, attention_mask = self._left_padded([self.prompt_ids(conv) for conv in conversations])
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                logits = self.model(input_ids=input_ids.to(self.device),
                                    attention_mask=attention_mask.to(self.device)).logits[:, -1, :]
        finally:
            self.model.train(was_training)
        top = torch.log_softmax(logits.float(), dim=-1).topk(top_n, dim=-1)
        out = []
        for values, ids in zip(top.values.cpu().tolist(), top.indices.cpu().tolist()):
            probs: dict[str, float] = {}
            for value, token_id in zip(values, ids):
                text = self.tokenizer.decode([token_id])
                probs[text] = float(np.logaddexp(probs[text], value)) if text in probs else value
            out.append(probs)
        return out

    def _generation(self, prompt: list[int], new: list[int], logprobs: list[float] | None) -> Generation:
        end = next((i for i, tok in enumerate(new) if tok in self.eos_ids), None)
        cut = len(new) if end is None else end + 1
        completion = new[:cut]
        return Generation(
            text=self.tokenizer.decode(completion, skip_special_tokens=True),
            prompt_ids=prompt, completion_ids=completion, logprobs=None if logprobs is None else logprobs[:cut],
            finish_reason="length" if end is None else "stop",
            meta={"policy_step": self.policy_step},
        )

    def sync_policy(self, model, step: int) -> None:
        """Record the trainer's step; the live model is shared, so nothing is copied.

        Raises :class:`ValueError` when ``model`` is not the model this backend
        generates with (a wrapper's ``.module`` counts as the same model).
        """
        if getattr(model, "module", model) is not getattr(self.model, "module", self.model):
            raise ValueError("TransformersBackend generates with the live model it was built "
                             "with; sync_policy must be given that same model")
        self.policy_step = step
