"""The affective simulated user (the RLVER paper's SAGE-style "sentient agent"; docs/ARCHITECTURE.md "Code map").

The user holds an emotion score ``e`` in [0, 100] and a mood letter (:func:`~rlver_lib.appraisal.mood_for`).
After each policy reply it *appraises* the reply, the update rule runs in code
(:func:`~rlver_lib.appraisal.apply_change`: ``e = clamp(e + clamp(change, -10, 10), 0, 100)``, over real
numbers), and it *replies* (the next user message, given the appraisal and the new
mood, with an ``end_conversation`` flag). How it appraises is its appraisal mode
(``simulator.appraisal``), one :class:`~rlver_lib.appraisal.AppraisalMode` object chosen by name
(:func:`~rlver_lib.appraisal.appraisal_mode`); the simulator asks it and never reads the name:

- ``first_person`` (default, :class:`~rlver_lib.appraisal.FirstPersonMode`): a sampled
  first-person JSON appraisal, an integer in [-10, 10];
- ``sage`` (:class:`~rlver_lib.appraisal.SageMode`): a sampled JSON appraisal by a
  third-person analyser that looks first for what does not fit the hidden intention, on
  SAGE's scale (-10, -5, 0, +5, +10);
- ``expected`` (:class:`~rlver_lib.appraisal.ExpectedMode`): a checklist of yes/no questions
  tied to the scenario's hidden intention (:func:`~rlver_lib.user_prompts.checklist`), each
  answered by reading P(yes) from the model's next-token distribution (one prefill, no
  sampling), combined into a real-valued change (:func:`~rlver_lib.appraisal.expected_change`);
- ``learned`` (:class:`~rlver_lib.appraisal.LearnedMode`): no model call, a logistic head on the
  simulator model's embeddings (:mod:`rlver_lib.appraiser`).

A mode appraises through the two ways this simulator asks its backend
(:meth:`UserSimulator.sampled_appraisals`, :meth:`UserSimulator.checklist_appraisals`), or
on its own. Each sampled call is retried at most ``sim_cfg.max_retries`` times on unusable output
(:func:`~rlver_lib.backends.structured_batch`); every raw output is recorded, and a turn
that still fails carries ``error`` and no invented score. A prompt that would not fit the
model's context is shortened by a stated rule (:func:`fit_history`) and the turn records
how many messages were left out. Only ``reply`` is meant for the policy. Every batched
call is seeded from (simulator seed, stage, turn, attempt), whichever dialogues share it.
The emotion rules, scales, schemas, parsers and modes are in :mod:`rlver_lib.appraisal`; the
requests and the prompts they are rendered into, in :mod:`rlver_lib.user_prompts`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlver_lib.appraisal import (
    OPENING_SCHEMA,
    Appraised,
    ExpectedMode,
    Mood,
    SampledMode,
    apply_change,
    appraisal_mode,
    mood_for,
    parse_opening,
    parse_reply,
    reply_schema,
)
from rlver_lib.backends import (
    BackendDied,
    BackendError,
    ChatBackend,
    Closing,
    Conversation,
    StructuredResult,
    UnusableOutput,
    close_backend,
    derive_seed,
    structured_batch,
)
from rlver_lib.config import SimulatorConfig, UserModelConfig
from rlver_lib.user_prompts import (
    SimulatorRequest,
    appraise_messages,
    checklist,
    checklist_messages,
    opening_messages,
    reply_messages,
    scenario_language,
    shorten_history,
)

# ---------------------------------------------------------------------------
# requests and results


@dataclass
class SimulatorTurn:
    """The simulated user's reaction to one policy reply.

    ``raw_change``: the change the model (or rule) gave; ``change``: after the
    clamp; ``emotion_before``/``emotion``: score before/after (0-100);
    ``appraisal``: private fields (never shown to the policy); ``reply``: the
    user's next message (``None`` when the turn failed); ``goodbye``: the user
    ended the conversation (structured flag); ``raw_outputs``: every raw model
    output of this turn, in call order; ``attempts``: number of model calls;
    ``failures``: why each failed attempt was unusable; ``error``: set when the
    turn could not be completed within the retry budget; ``history_dropped``: messages
    left out of the simulator's prompt to fit its context (:func:`fit_history`).
    Changes and emotions are real numbers with the expected-value appraisal, integers
    with the sampled ones.
    """

    dialogue_id: str
    change: float | None
    raw_change: float | None
    emotion_before: float
    emotion: float
    mood: Mood
    appraisal: dict[str, Any]
    reply: str | None
    goodbye: bool
    raw_outputs: list[str] = field(default_factory=list)
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    error: str | None = None
    history_dropped: int = 0



def _turn_index(requests: Sequence[SimulatorRequest]) -> int:
    """The turn used for seeding: requests of one batched call share their turn."""
    return max((r.turn for r in requests), default=0)


# ---------------------------------------------------------------------------
# the LLM simulator


class UserSimulator(Closing):
    """The LLM-played user of the RLVER paper (appraise, then reply) over any :class:`ChatBackend`.

    ``sim_cfg`` gives the appraisal mode (see the module notes), difficulty, the
    sampling settings (all sent: :meth:`rlver_lib.config.EndpointConfig.sampling`),
    ``max_new_tokens``, ``max_retries`` and ``n_ctx``; ``seed`` seeds every sampled call.
    ``mode`` is the appraisal mode's object, readied for ``backend`` at construction
    (:meth:`~rlver_lib.appraisal.AppraisalMode.prepare`): the ``expected`` mode needs a
    backend with ``next_token_logprobs`` (:class:`~rlver_lib.backends.NextTokenScorer`),
    ``TypeError`` otherwise; the ``learned`` mode reads its appraiser file.

    When the backend's process dies (:class:`~rlver_lib.backends.BackendDied`), the
    turns in flight fail at once without retries and ``fatal_error`` holds the
    reason; callers (trainer, benchmark) check it after a rollout and stop.
    ``with simulator:`` (or :meth:`close`) stops the backend's server.
    """

    #: top log-probs read per checklist question (the ``expected`` mode's)
    TOP_N = ExpectedMode.top_logprobs

    def __init__(self, backend: ChatBackend, sim_cfg: UserModelConfig | None = None, *, seed: int = 0):
        self.backend = backend
        self.cfg = sim_cfg or SimulatorConfig()
        self.seed = seed
        self.fatal_error: str | None = None
        self.mode = appraisal_mode(self.cfg.appraisal)
        self.mode.prepare(backend)

    def close(self) -> None:
        """Close the backend (stops a server it started; see :func:`~rlver_lib.backends.close_backend`)."""
        close_backend(self.backend)

    def _structured(
        self,
        conversations: list[Conversation],
        schema: dict[str, Any],
        parse: Callable[[str], Any],
        stage: str,
        turn: int,
    ) -> tuple[list[Any], list[StructuredResult]]:
        """Batched structured calls with bounded retries of the unusable ones
        (:func:`~rlver_lib.backends.structured_batch`, seeds from (seed, stage, turn, attempt)).

        Returns one parsed value (``None`` if every attempt failed) and one log per conversation.
        """
        results, self.fatal_error = structured_batch(
            self.backend, conversations, schema, lambda text, _: parse(text), self.cfg.sampling(),
            max_retries=self.cfg.max_retries, attempt_seed=lambda attempt: derive_seed(self.seed, stage, turn, attempt),
            name=stage, tolerate_errors=True, died=self.fatal_error)
        return [r.value for r in results], results

    def opening_lines(self, scenarios: Sequence[Any]) -> list[str | None]:
        """The first user message per scenario: its ``opening_line``, else generated.

        Generated lines use one batched structured call (bounded retries);
        ``None`` marks a scenario whose opening could not be generated.
        """
        missing = [i for i, s in enumerate(scenarios) if not getattr(s, "opening_line", None)]
        lines: list[str | None] = [getattr(s, "opening_line", None) for s in scenarios]
        if missing:
            convs = [opening_messages(scenarios[i]) for i in missing]
            generated, _ = self._structured(convs, OPENING_SCHEMA, parse_opening, "opening", -1)
            for i, line in zip(missing, generated):
                lines[i] = line
        return lines

    def _fitted(self, requests: Sequence[SimulatorRequest], render: Callable[[SimulatorRequest], Conversation],
                new_tokens: int) -> tuple[list[SimulatorRequest], list[int], list[str | None]]:
        """The requests with their histories shortened to fit ``n_ctx`` (:func:`fit_history`),
        the messages dropped from each, and the reason a request cannot fit (else ``None``)."""
        fitted, dropped, problems = list(requests), [0] * len(requests), [None] * len(requests)
        counter = getattr(self.backend, "prompt_tokens", None)
        if counter is None:
            return fitted, dropped, problems
        budget = self.cfg.n_ctx - new_tokens
        for i, request in enumerate(requests):
            try:
                fitted[i], dropped[i] = fit_history(request, render, counter, budget)
            except ContextOverflow as err:
                problems[i] = str(err)
        return fitted, dropped, problems

    def _appraise(self, requests: Sequence[SimulatorRequest]):
        for request in requests:
            if not request.history or request.history[-1]["role"] != "assistant":
                raise ValueError(f"{request.dialogue_id}: history must end with the policy reply")
        fitted, dropped, appraisals, logs = self.mode.appraise(self, requests)
        updated = [
            apply_change(r.emotion, a["change"]) if a is not None else (None, r.emotion)
            for r, a in zip(requests, appraisals)
        ]
        return fitted, dropped, appraisals, updated, logs

    def _fitted_appraisals(
        self,
        requests: Sequence[SimulatorRequest],
        render: Callable[[SimulatorRequest], Conversation],
        new_tokens: int,
        ask: Callable[[list[SimulatorRequest]], tuple[list[Any], list[StructuredResult]]],
    ) -> Appraised:
        """``ask`` for the appraisals of the requests whose prompt (``render``, with room for
        ``new_tokens``) fits the context after shortening (:meth:`_fitted`); a request that
        does not fit fails with the reason logged."""
        fitted, dropped, problems = self._fitted(requests, render, new_tokens)
        fits = [i for i, p in enumerate(problems) if p is None]
        appraisals: list[Any] = [None] * len(requests)
        logs = [StructuredResult(failures=[f"appraise: {p}"]) if p else StructuredResult() for p in problems]
        if fits:
            got, got_logs = ask([fitted[i] for i in fits])
            for i, value, log in zip(fits, got, got_logs):
                appraisals[i], logs[i] = value, log
        return fitted, dropped, appraisals, logs

    def sampled_appraisals(self, requests: Sequence[SimulatorRequest], mode: SampledMode) -> Appraised:
        """A sampled mode's appraisal of each request: its appraise prompt
        (:func:`~rlver_lib.user_prompts.appraise_messages`, the files it names) fitted to
        ``max_new_tokens``, one batched structured call on its schema, parsed by it, with
        bounded retries (seeds from (seed, ``"appraise"``, turn, attempt))."""
        render = lambda r: appraise_messages(r, self.cfg.difficulty, mode)  # noqa: E731
        return self._fitted_appraisals(requests, render, self.cfg.max_new_tokens, lambda batch: self._structured(
            [render(r) for r in batch], mode.appraise_schema(self.cfg), mode.parse, "appraise",
            _turn_index(requests)))

    def checklist_appraisals(self, requests: Sequence[SimulatorRequest], mode: ExpectedMode) -> Appraised:
        """A checklist mode's appraisal of each request: the prompt of its guard question
        fitted to ``mode.new_tokens``, then :meth:`_checklist_rounds`."""
        render = lambda r: checklist_messages(r, checklist(r.scenario)[-1])  # noqa: E731
        return self._fitted_appraisals(requests, render, mode.new_tokens,
                                       lambda batch: self._checklist_rounds(batch, mode))

    def _checklist_rounds(self, requests: Sequence[SimulatorRequest],
                          mode: ExpectedMode) -> tuple[list[Any], list[StructuredResult]]:
        """The checklist appraisal of each request, read out by ``mode``.

        One round per (question, answer order): each round sends that question about
        every request in one batched ``next_token_logprobs`` call, so a server that keeps
        one dialogue per slot re-reads only the question (the transcript before it is the
        slot's cached prefix). A failed request is asked again at most ``max_retries``
        times within its round; a request with a question still unanswered fails."""
        questions = [checklist(r.scenario, mode.question_keys(self.cfg)) for r in requests]
        orders = mode.answer_orders(self.cfg)
        logs = [StructuredResult() for _ in requests]
        answers: list[dict[tuple[str, str], dict[str, float]]] = [{} for _ in requests]
        for j in range(max(len(qs) for qs in questions)):
            for order in orders:
                asked = [i for i, qs in enumerate(questions) if j < len(qs)]
                convs = {i: checklist_messages(requests[i], questions[i][j], order) for i in asked}
                for i, top in self._score_round(convs, logs, f"{order}:{j}", mode.top_logprobs).items():
                    answers[i][(questions[i][j].key, order)] = top
        results: list[Any] = [None] * len(requests)
        for i in range(len(requests)):
            for (key, order), top in answers[i].items():
                logs[i].raw_outputs.append(json.dumps({"question": key, "order": order, "top_logprobs": top},
                                                      ensure_ascii=False))
            if len(answers[i]) < len(questions[i]) * len(orders):
                continue
            try:
                results[i] = mode.read_out(questions[i], orders, answers[i], self.cfg)
            except UnusableOutput as err:
                logs[i].failures.append(f"appraise: {err}")
        return results, logs

    def _score_round(self, convs: dict[int, Conversation], logs: list[StructuredResult],
                     name: str, top_n: int) -> dict[int, dict[str, float]]:
        """``next_token_logprobs`` (the ``top_n`` most likely tokens) of each conversation
        (keyed by request index), with bounded retries of the failed ones; failures are
        logged per request."""
        got: dict[int, dict[str, float]] = {}
        pending = list(convs)
        for attempt in range(self.cfg.max_retries + 1):
            if not pending or self.fatal_error:
                break
            try:
                tops = self.backend.next_token_logprobs([convs[i] for i in pending], top_n)
                errors: list[str | None] = [None] * len(pending)
            except BackendError as err:
                if isinstance(err, BackendDied):
                    self.fatal_error = str(err)
                complete = err.results is not None and len(err.results) == len(pending)
                tops = err.results if complete else [None] * len(pending)
                errors = err.errors if complete and err.errors else [str(err)] * len(pending)
            still = []
            for i, top, error in zip(pending, tops, errors):
                logs[i].attempts += 1
                if top is None:
                    logs[i].failures.append(f"appraise {name} attempt {attempt + 1}: {error}")
                    still.append(i)
                else:
                    got[i] = top
            pending = still
        return got

    def appraise(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """The appraise call and the update rule only (``reply=None``, ``goodbye`` False).

        Same seeding as :meth:`step`, so its changes equal the ones ``step`` gives.
        Raises ``ValueError`` if a history does not end with an assistant message.
        """
        _, dropped, appraisals, updated, logs = self._appraise(requests)
        return [
            self._turn(r, a, u, None, log, StructuredResult(), need_reply=False, dropped=d)
            for r, a, u, log, d in zip(requests, appraisals, updated, logs, dropped)
        ]

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """React to the latest policy reply of each request: appraise, update, reply.

        One batched appraise call (plus retries), the update rule in code, one
        batched reply call (plus retries). Returns one :class:`SimulatorTurn` per
        request, in order. Raises ``ValueError`` if a history does not end with
        an assistant message.
        """
        fitted, dropped, appraisals, updated, appraise_logs = self._appraise(requests)
        ok = [i for i, a in enumerate(appraisals) if a is not None]
        replies: list[Any] = [None] * len(requests)
        reply_logs = [StructuredResult() for _ in requests]
        if ok:
            reasoning = self.mode.reasoning
            got, logs = self._structured(
                [reply_messages(fitted[i], appraisals[i], updated[i][1], reasoning=reasoning) for i in ok],
                reply_schema(self.cfg.appraisal_chars, self.cfg.message_chars, reasoning=reasoning),
                lambda text: parse_reply(text, reasoning=reasoning), "reply", _turn_index(requests),
            )
            for i, reply, log in zip(ok, got, logs):
                replies[i], reply_logs[i] = reply, log
        return [
            self._turn(r, a, u, rep, alog, rlog, dropped=d)
            for r, a, u, rep, alog, rlog, d in zip(requests, appraisals, updated, replies, appraise_logs,
                                                   reply_logs, dropped)
        ]

    @staticmethod
    def _turn(request, appraisal, updated, reply, appraise_log, reply_log, *, need_reply=True,
              dropped: int = 0) -> SimulatorTurn:
        change, emotion = updated
        error = None
        if appraisal is None:
            error = "appraisal unusable after retries: " + "; ".join(appraise_log.failures)
        elif reply is None and need_reply:
            error = "reply unusable after retries: " + "; ".join(reply_log.failures)
        private = dict(appraisal or {})
        if reply is not None and "reasoning" in reply:
            private["reply_reasoning"] = reply["reasoning"]
        return SimulatorTurn(
            dialogue_id=request.dialogue_id,
            change=change,
            raw_change=appraisal["change"] if appraisal else None,
            emotion_before=request.emotion,
            emotion=emotion,
            mood=mood_for(emotion),
            appraisal=private,
            reply=reply["message"] if reply else None,
            goodbye=bool(reply and reply["end_conversation"]),
            raw_outputs=appraise_log.raw_outputs + reply_log.raw_outputs,
            attempts=appraise_log.attempts + reply_log.attempts,
            failures=appraise_log.failures + reply_log.failures,
            error=error,
            history_dropped=dropped,
        )


class ContextOverflow(UnusableOutput):
    """A simulator prompt that does not fit the model's context even when shortened."""


def fit_history(request: SimulatorRequest, render: Callable[[SimulatorRequest], Conversation],
                count: Callable[[list[Conversation]], list[int] | None], budget: int) -> tuple[SimulatorRequest, int]:
    """The request with its history shortened until ``render(request)`` is at most ``budget``
    tokens (``count``: the backend's ``prompt_tokens``), and how many messages were left out.

    The rule (:func:`~rlver_lib.user_prompts.shorten_history`): keep the first message (the user's opening) and
    the reply being appraised; leave out the oldest messages after the opening, two at a
    time (one exchange), until the prompt fits. Unchanged when ``count`` returns ``None``
    (the server cannot count). Raises :class:`ContextOverflow` when even the opening and
    the reply being appraised do not fit.
    """
    language = scenario_language(request.scenario)
    history = request.history
    # a byte-level tokenizer never makes more tokens than UTF-8 bytes: short prompts need no count
    if sum(len(m["content"].encode("utf-8")) + 16 for m in render(request)) <= budget:
        return request, 0
    dropped = 0
    while True:
        candidate = request if dropped == 0 else SimulatorRequest(
            request.dialogue_id, request.scenario, shorten_history(history, dropped, language),
            request.emotion, request.turn)
        counted = count([render(candidate)])
        if counted is None or counted[0] <= budget:
            return candidate, dropped
        if dropped + 2 > len(history) - 2:
            raise ContextOverflow(f"context overflow: the prompt needs {counted[0]} tokens with "
                                  f"{dropped} message(s) left out; the budget is {budget} (raise n_ctx)")
        dropped += 2


# ---------------------------------------------------------------------------
# the deterministic rule simulator

DEFAULT_OPENING = {"en": "Hi. I have something on my mind and I need to talk.",
                   "zh": "你好，我心里有点事，想找人聊聊。"}
RULE_REPLIES = {
    "en": {"S": "Thank you, I feel much better. Goodbye!", "F": "Forget it. Goodbye.", "other": "Okay. Tell me more."},
    "zh": {"S": "谢谢你，我好多了。再见！", "F": "算了，再见。", "other": "嗯，然后呢？"},
}


def default_change_fn(policy_reply: str) -> int:
    """The rule simulator's default change: +10 if the reply ends with a question mark, else -5."""
    return 10 if policy_reply.rstrip().endswith(("?", "？")) else -5


class RuleSimulator(Closing):
    """A deterministic stand-in with the simulator interface (tests, learning checks).

    ``change_fn(policy_reply) -> int`` gives the raw change (clamped by the update
    rule). ``reply_fn(request, emotion) -> (message, goodbye)`` optionally scripts
    the user's message and goodbye flag; by default the message depends on the
    mood and the user never says goodbye (success/failure still end a dialogue).
    """

    def __init__(
        self,
        change_fn: Callable[[str], int] = default_change_fn,
        reply_fn: Callable[[SimulatorRequest, int], tuple[str, bool]] | None = None,
    ):
        self.change_fn = change_fn
        self.reply_fn = reply_fn

    def close(self) -> None:
        """Nothing to stop (no model, no server)."""

    def opening_lines(self, scenarios: Sequence[Any]) -> list[str | None]:
        """The scenario's opening line, else a fixed greeting in its language."""
        return [getattr(s, "opening_line", None) or DEFAULT_OPENING[scenario_language(s)] for s in scenarios]

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]:
        """Apply ``change_fn`` to each latest policy reply, then the update rule."""
        turns = []
        for request in requests:
            raw = self.change_fn(request.history[-1]["content"])
            change, emotion = apply_change(request.emotion, raw)
            mood = mood_for(emotion)
            if self.reply_fn is not None:
                message, goodbye = self.reply_fn(request, emotion)
            else:
                replies = RULE_REPLIES[scenario_language(request.scenario)]
                message, goodbye = replies.get(mood, replies["other"]), False
            turns.append(
                SimulatorTurn(
                    dialogue_id=request.dialogue_id, change=change, raw_change=raw,
                    emotion_before=request.emotion, emotion=emotion, mood=mood,
                    appraisal={"rule": getattr(self.change_fn, "__name__", "change_fn")},
                    reply=message, goodbye=goodbye,
                )
            )
        return turns
