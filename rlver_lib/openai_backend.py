"""Any OpenAI-compatible chat server over HTTP: timeouts, bounded retries, concurrent
requests, structured output, next-token log-probs (docs/ARCHITECTURE.md "Code map")."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Literal, Sequence

import numpy as np

from rlver_lib.backends import BackendError, Closing, Conversation, Generation, conversation_seed
from rlver_lib.config import SamplingParams

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- OpenAI-compatible HTTP

_RETRY_STATUS = frozenset({408, 409, 429}) | frozenset(range(500, 600))


class _FormatRejected(BackendError):
    """The server refused the ``response_format`` form it was sent (not retried)."""


class OpenAIBackend(Closing):
    """Any OpenAI-compatible ``/v1/chat/completions`` server over HTTP (httpx).

    ``base_url`` is the server root or its ``/v1`` root. Conversations of a call are
    sent concurrently (a thread pool of ``concurrency`` workers); results keep the
    input order. Each request has a ``timeout_s`` (seconds) timeout and is retried
    at most ``max_retries`` times on connection errors, timeouts, HTTP 408/409/429
    and 5xx, with exponential backoff ``backoff_s * 2**attempt`` (capped at 30 s);
    other HTTP errors fail at once. A request that still fails makes the call raise
    :class:`BackendError` (after the other requests have finished; their
    generations are in ``err.results``).

    Structured output: ``response_format`` ``"json_schema"`` sends the OpenAI form
    ``{"type": "json_schema", "json_schema": {...}}`` (vLLM, SGLang, hosted APIs);
    ``"json_object"`` sends ``{"type": "json_object", "schema": ...}`` (llama.cpp's
    Python server); ``"auto"`` (default) starts with the first and switches to the
    second for good when the server rejects it (an error that names
    ``response_format``; llama-cpp-python answers HTTP 500).
    Each conversation is sent with :func:`conversation_seed`. ``meta`` holds
    ``attempts``, the server's ``usage`` and, from llama-server, its ``timings``
    (milliseconds and tokens per phase; ``draft_n`` / ``draft_n_accepted`` with speculation).

    Sampling: every field of :class:`SamplingParams` is sent, so no server default
    decides (``sampling_fields="all"``: ``top_k``, ``min_p``, ``repetition_penalty`` and
    llama.cpp's name for it, ``repeat_penalty``, beside the OpenAI fields; vLLM, SGLang
    and llama.cpp read them). ``sampling_fields="openai"`` sends only the fields of
    OpenAI's own API (temperature, top_p, the presence / frequency penalties, seed), for
    hosted APIs that refuse unknown fields; a non-default ``top_k``, ``min_p`` or
    ``repetition_penalty`` then raises ``ValueError`` instead of being dropped.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 timeout_s: float = 120.0, max_retries: int = 2, concurrency: int = 8,
                 backoff_s: float = 0.5,
                 response_format: Literal["auto", "json_schema", "json_object"] = "auto",
                 sampling_fields: Literal["all", "openai"] = "all"):
        import httpx

        if max_retries < 0 or concurrency < 1 or timeout_s <= 0:
            raise ValueError("need max_retries >= 0, concurrency >= 1 and timeout_s > 0")
        root = base_url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.url = f"{self.root}/v1/chat/completions"
        self.model = model
        self.sampling_fields = sampling_fields
        self.max_retries, self.concurrency, self.backoff_s = max_retries, concurrency, backoff_s
        self._format_mode = response_format
        self._schema_style = "json_schema" if response_format == "auto" else response_format
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=concurrency),
        )

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()


    def _response_format(self, json_schema: dict[str, Any]) -> dict[str, Any]:
        if self._schema_style == "json_object":
            return {"type": "json_object", "schema": json_schema}
        return {"type": "json_schema",
                "json_schema": {"name": "response", "schema": json_schema, "strict": True}}

    def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST with bounded retries; returns ``(response JSON, attempts)``."""
        import httpx

        cause = ""
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.post(self.url, json=body)
            except httpx.TransportError as err:
                cause = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    try:
                        return response.json(), attempt + 1
                    except ValueError as err:
                        raise BackendError(f"{self.url}: response is not JSON: {response.text[:300]}") from err
                cause = f"HTTP {response.status_code}: {response.text[:300]}"
                sent_format = body.get("response_format", {}).get("type")
                if (self._format_mode == "auto" and sent_format == "json_schema"
                        and "response_format" in response.text):
                    raise _FormatRejected(f"{self.url}: {cause}", status=response.status_code)
                if response.status_code not in _RETRY_STATUS:
                    raise BackendError(f"{self.url}: {cause}", status=response.status_code)
            if attempt < self.max_retries:
                delay = min(self.backoff_s * 2**attempt, 30.0)
                log.warning("%s: attempt %d failed (%s); retrying in %.1f s",
                            self.url, attempt + 1, cause, delay)
                time.sleep(delay)
        raise BackendError(f"{self.url}: failed after {self.max_retries + 1} attempts: {cause}")

    def sampling_body(self, sampling: SamplingParams) -> dict[str, Any]:
        """The sampling fields of a request body (see the class notes); ``ValueError`` when
        ``sampling_fields="openai"`` would have to drop a non-default setting."""
        body: dict[str, Any] = {
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "max_tokens": sampling.max_new_tokens,
        }
        extra = {"top_k": sampling.top_k, "min_p": sampling.min_p,
                 "repetition_penalty": sampling.repetition_penalty, "repeat_penalty": sampling.repetition_penalty}
        if self.sampling_fields == "all":
            return {**body, **extra}
        if (sampling.top_k, sampling.min_p, sampling.repetition_penalty) != (0, 0.0, 1.0):
            raise ValueError(f"{self.url}: sampling_fields='openai' cannot send top_k={sampling.top_k}, "
                             f"min_p={sampling.min_p}, repetition_penalty={sampling.repetition_penalty}")
        return body

    def _complete(self, conversation: Conversation, sampling: SamplingParams,
                  json_schema: dict[str, Any] | None, seed: int | None) -> Generation:
        body: dict[str, Any] = {"model": self.model, "messages": list(conversation), **self.sampling_body(sampling)}
        if seed is not None:
            body["seed"] = seed
        if json_schema is not None:
            body["response_format"] = self._response_format(json_schema)
        try:
            data, attempts = self._post(body)
        except _FormatRejected:
            self._schema_style = "json_object"  # for good: later requests skip the probe
            log.info("%s rejected response_format json_schema; using json_object", self.url)
            body["response_format"] = self._response_format(json_schema)
            data, attempts = self._post(body)
        try:
            choice = data["choices"][0]
            text = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError) as err:
            raise BackendError(f"{self.url}: malformed response {str(data)[:300]}") from err
        return Generation(text=text, finish_reason=choice.get("finish_reason") or "stop",
                          meta={"attempts": attempts, "usage": data.get("usage") or {},
                                "timings": data.get("timings") or {}})

    def generate(
        self,
        conversations: Sequence[Conversation],
        sampling: SamplingParams,
        json_schema: dict[str, Any] | None = None,
    ) -> list[Generation]:
        """Send the conversations concurrently; see the class notes."""
        self.sampling_body(sampling)  # a setting this server cannot be sent fails here, not per request
        return self._each(conversations, lambda conv: self._complete(
            conv, sampling, json_schema, conversation_seed(sampling.seed, conv)))

    def _each(self, conversations: Sequence[Conversation], call: Callable[[Conversation], Any]) -> list[Any]:
        """``call`` on every conversation, ``concurrency`` at a time, results in order. A
        request that fails fails alone: after all have finished, :class:`BackendError` is
        raised with the others' results and each failure's reason (``results``, ``errors``)."""
        if not conversations:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            futures = [pool.submit(call, conv) for conv in conversations]
        results = [None if f.exception() else f.result() for f in futures]
        errors = [None if f.exception() is None else str(f.exception()) for f in futures]
        failed = [f"conversation {i}: {e}" for i, e in enumerate(errors) if e is not None]
        if failed:
            raise BackendError(f"{len(failed)} of {len(futures)} requests failed; " + "; ".join(failed[:3]),
                               results=results, errors=errors)
        return results

    def next_token_logprobs(self, conversations: Sequence[Conversation], top_n: int = 20) -> list[dict[str, float]]:
        """Per conversation, the ``top_n`` most likely first answer tokens (token text ->
        log-prob): one request each with ``max_tokens`` 1, ``logprobs`` and ``top_logprobs``
        (OpenAI's fields; vLLM and llama-server report the model's own distribution, before
        any sampling cut). Greedy, no cuts, no penalties. Tokens with the same text are
        merged (probabilities add). Raises :class:`BackendError` (per-conversation
        ``errors``) when a request fails or its answer carries no log-probs."""
        greedy = SamplingParams(temperature=0.0, max_new_tokens=1)

        def score(conversation: Conversation) -> dict[str, float]:
            body = {"model": self.model, "messages": list(conversation), **self.sampling_body(greedy),
                    "logprobs": True, "top_logprobs": top_n}
            data, _ = self._post(body)
            try:
                entries = data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
            except (KeyError, IndexError, TypeError) as err:
                raise BackendError(f"{self.url}: no top_logprobs in {str(data)[:300]}") from err
            probs: dict[str, float] = {}
            for entry in entries:
                token, value = entry["token"], float(entry["logprob"])
                probs[token] = float(np.logaddexp(probs[token], value)) if token in probs else value
            return probs

        return self._each(conversations, score)

    def prompt_tokens(self, conversations: Sequence[Conversation]) -> list[int] | None:
        """Prompt length in tokens per conversation (chat template applied), from vLLM's
        ``POST /tokenize`` with ``messages``; ``None`` when the server has no such endpoint
        (hosted APIs), after which it is not asked again."""
        if getattr(self, "_no_tokenize", False):
            return None

        def count(conversation: Conversation) -> int:
            response = self.client.post(f"{self.root}/tokenize", json={
                "model": self.model, "messages": list(conversation), "add_generation_prompt": True})
            if response.status_code != 200:
                raise BackendError(f"{self.root}/tokenize: HTTP {response.status_code}", status=response.status_code)
            return int(response.json()["count"])

        try:
            return self._each(conversations, count)
        except BackendError as err:
            if err.errors and all(e is not None for e in err.errors):
                self._no_tokenize = True
                log.info("%s/tokenize is not available (%s): prompt lengths are not checked", self.root, err)
                return None
            raise
