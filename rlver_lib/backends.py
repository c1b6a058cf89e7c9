"""Chat backends: one small protocol for every model the workbench talks to (DESIGN §3).

A backend takes a batch of chat conversations (each a list of
``{"role": ..., "content": ...}`` messages) and returns one :class:`Generation`
per conversation, in order.  Sampling settings and the seed come in a
:class:`SamplingParams`; ``json_schema`` optionally constrains the output to a JSON
object of that schema (structured output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

Message = dict[str, str]
Conversation = list[Message]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one batched call.

    ``temperature`` 0 means greedy decoding. ``seed`` makes a call reproducible
    (backends derive per-conversation seeds from it where they can).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int | None = None


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
