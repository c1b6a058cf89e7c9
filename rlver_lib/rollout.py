"""Batched multi-turn rollouts between the policy and a simulated user
(the RLVER paper's dialogue rollouts; docs/ARCHITECTURE.md "Code map").

:func:`run_rollouts` plays many dialogues at once: the user speaks first (the
scenario's opening line, or a generated one), then each policy turn is ONE batched
``policy.generate`` over the live dialogues and ONE batched ``simulator.step``. Each
dialogue keeps its own state under a stable id ``<scenario_id>#<k>`` from first turn to
reward, so a reward is never given to a neighbour when dialogues end at different turns.

Think mode (the paper's "think-then-say"): only the text after the last ``</think>``
reaches the simulator and the history; each policy turn is its own training sample
(:class:`TurnSample`) of exactly the ids the policy saw and sampled. Every reply that
reaches the user is appraised (on the last allowed turn only appraised, unless
``final_reply``). Terminations: ``error``, ``success`` (e >= 100), ``failure`` (e < 10),
``goodbye``, ``max_turns``, ``context_limit``, ``format_violation``; reward = e / 100.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol, Sequence

from tqdm.auto import tqdm

from rlver_lib.appraisal import FAILURE_EMOTION, SUCCESS_EMOTION
from rlver_lib.backends import ChatBackend, Conversation, derive_seed
from rlver_lib.config import SamplingParams
from rlver_lib.simulator import SimulatorTurn
from rlver_lib.user_prompts import SimulatorRequest, prompt_text, scenario_language

Termination = Literal["success", "failure", "goodbye", "max_turns", "context_limit", "error",
                      "format_violation"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK_TAG = re.compile(r"</?think>")


class Simulator(Protocol):
    """What the rollout needs from a simulated user (``UserSimulator`` or ``RuleSimulator``)."""

    def opening_lines(self, scenarios: Sequence[Any]) -> list[str | None]: ...

    def step(self, requests: Sequence[SimulatorRequest]) -> list[SimulatorTurn]: ...


# ---------------------------------------------------------------------------
# think-then-say


@dataclass(frozen=True)
class ThinkParse:
    """A policy output split into private ``thought`` and visible ``reply``.

    ``ok`` is False for a format violation; ``problem`` then names it:
    ``no_think_block``, ``missing_close_tag``, ``missing_open_tag``,
    ``duplicate_tags``, ``text_before_think`` or ``empty_reply``. ``reply`` never
    contains a think tag or thought content.
    """

    thought: str
    reply: str
    ok: bool
    problem: str | None = None


def parse_think(text: str) -> ThinkParse:
    """Split ``<think>thought</think>reply`` (the paper's think-then-say format).

    The reply is the text after the last ``</think>``. Without any ``</think>``
    everything from the first ``<think>`` on is thought. Tags are stripped from
    both parts. Malformed blocks give ``ok=False`` with the problem named.
    """
    n_open, n_close = text.count(THINK_OPEN), text.count(THINK_CLOSE)
    if n_open == 0 and n_close == 0:
        return ThinkParse("", text.strip(), False, "no_think_block")
    if n_close == 0:
        start = text.index(THINK_OPEN)
        thought = _THINK_TAG.sub(" ", text[start:]).strip()
        return ThinkParse(thought, text[:start].strip(), False, "missing_close_tag")
    end = text.rindex(THINK_CLOSE)
    thought = _THINK_TAG.sub(" ", text[:end]).strip()
    reply = text[end + len(THINK_CLOSE):].strip()
    problem = None
    if n_open == 0:
        problem = "missing_open_tag"
    elif n_open > 1 or n_close > 1:
        problem = "duplicate_tags"
    elif text[: text.index(THINK_OPEN)].strip():
        problem = "text_before_think"
    elif not reply:
        problem = "empty_reply"
    return ThinkParse(thought, reply, problem is None, problem)


def policy_messages(scenario: Any, history: Sequence[dict[str, str]], think: bool) -> Conversation:
    """The policy's conversation: system prompt (scenario language, think or not) + visible history.

    ``history`` holds only visible messages (``role`` user/assistant,
    ``content``): never thoughts, never simulator fields.
    """
    language = scenario_language(scenario)
    system = prompt_text(f"policy_{'think' if think else 'nothink'}_{language}.txt").strip()
    return [{"role": "system", "content": system}] + [
        {"role": m["role"], "content": m["content"]} for m in history
    ]


# ---------------------------------------------------------------------------
# records


@dataclass
class TurnSample:
    """One policy turn as a training sample.

    ``context_ids`` (length C): the exact prompt ids the policy saw;
    ``completion_ids`` (length T): the sampled ids, end-of-turn token included
    when emitted; ``old_logprobs`` (length T): log-probabilities of those ids
    under the sampling policy (nats).
    """

    dialogue_id: str
    turn: int
    context_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]

    @property
    def input_ids(self) -> list[int]:
        """Context then completion, length C + T."""
        return self.context_ids + self.completion_ids

    @property
    def loss_mask(self) -> list[int]:
        """0 on the C context ids, 1 on the T policy-generated ids."""
        return [0] * len(self.context_ids) + [1] * len(self.completion_ids)


@dataclass
class Trajectory:
    """One finished dialogue: transcript, reward and per-turn samples.

    ``transcript``: every entry of the dialogue in order, user and assistant alike
    (see :meth:`to_record`); ``final_emotion`` in
    [0, 100]; ``reward`` = final_emotion / 100; ``samples``: one
    :class:`TurnSample` per policy turn (empty for backends without token ids);
    ``format_violations``: number of malformed think blocks (think mode).
    A trajectory with ``termination == "error"`` holds the last genuine emotion;
    learners should leave it out rather than train on it.
    """

    dialogue_id: str
    scenario_id: str
    group_id: str
    transcript: list[dict[str, Any]]
    final_emotion: float
    reward: float
    termination: Termination
    samples: list[TurnSample] = field(default_factory=list)
    format_violations: int = 0
    initial_emotion: float = 0

    def to_record(self) -> dict[str, Any]:
        """The JSON record of docs/ARCHITECTURE.md "Run folder".

        ``transcript`` entries: ``{"role": "user", "content"}`` for the opening;
        policy turns ``{"role": "assistant", "content", "thought", "format_ok",
        "format_problem", "raw", "cut"}`` (``cut``: the reply hit ``max_new_tokens``);
        user turns ``{"role": "user", "content",
        "change", "raw_change", "emotion_before", "emotion", "mood" (the mood letter;
        ``label`` in older run folders),
        "appraisal", "goodbye", "attempts", "raw_outputs", "failures", "error",
        "history_dropped"}`` (``history_dropped``: messages left out of the simulator's
        prompt to fit its context).
        ``policy_turns`` counts the assistant entries.
        """
        return {
            "dialogue_id": self.dialogue_id,
            "scenario_id": self.scenario_id,
            "group_id": self.group_id,
            "initial_emotion": self.initial_emotion,
            "transcript": self.transcript,
            "final_emotion": self.final_emotion,
            "reward": self.reward,
            "termination": self.termination,
            "format_violations": self.format_violations,
            "policy_turns": sum(t["role"] == "assistant" for t in self.transcript),
        }


@dataclass
class _Dialogue:
    """Mutable state of one dialogue during a rollout, keyed by ``dialogue_id``."""

    dialogue_id: str
    scenario: Any
    emotion: float
    initial_emotion: int
    history: list[dict[str, str]] = field(default_factory=list)
    transcript: list[dict[str, Any]] = field(default_factory=list)
    samples: list[TurnSample] = field(default_factory=list)
    format_violations: int = 0
    termination: Termination | None = None

    def trajectory(self) -> Trajectory:
        return Trajectory(
            dialogue_id=self.dialogue_id,
            scenario_id=self.scenario.id,
            group_id=self.scenario.id,
            transcript=self.transcript,
            final_emotion=self.emotion,
            reward=self.emotion / 100.0,
            termination=self.termination or "max_turns",
            samples=self.samples,
            format_violations=self.format_violations,
            initial_emotion=self.initial_emotion,
        )


# ---------------------------------------------------------------------------
# the engine


def _record_policy_turn(
    dialogue: _Dialogue, turn: int, generation: Any, think: bool, format_violation: str
) -> bool:
    """Store one policy output; returns True when its reply goes to the user."""
    parsed = parse_think(generation.text) if think else ThinkParse("", generation.text.strip(), True)
    dialogue.transcript.append(
        {
            "role": "assistant",
            "content": parsed.reply,
            "thought": parsed.thought,
            "format_ok": parsed.ok,
            "format_problem": parsed.problem,
            "raw": generation.text,
            "cut": generation.finish_reason == "length",
        }
    )
    if generation.prompt_ids is not None and generation.completion_ids is not None:
        dialogue.samples.append(
            TurnSample(
                dialogue.dialogue_id, turn, list(generation.prompt_ids), list(generation.completion_ids),
                list(generation.logprobs or []),
            )
        )
    if not parsed.ok:
        dialogue.format_violations += 1
        if format_violation == "end_dialogue":
            dialogue.termination = "format_violation"
            return False
    dialogue.history.append({"role": "assistant", "content": parsed.reply})
    return True


def _record_user_turn(dialogue: _Dialogue, result: SimulatorTurn) -> None:
    dialogue.transcript.append(
        {
            "role": "user",
            "content": result.reply,
            "change": result.change,
            "raw_change": result.raw_change,
            "emotion_before": result.emotion_before,
            "emotion": result.emotion,
            "mood": result.mood,
            "appraisal": result.appraisal,
            "goodbye": result.goodbye,
            "attempts": result.attempts,
            "raw_outputs": result.raw_outputs,
            "failures": result.failures,
            "error": result.error,
            "history_dropped": result.history_dropped,
        }
    )
    dialogue.emotion = result.emotion
    if result.error is not None:
        dialogue.termination = "error"
    elif result.emotion >= SUCCESS_EMOTION:
        dialogue.termination = "success"
    elif result.emotion < FAILURE_EMOTION:
        dialogue.termination = "failure"
    elif result.goodbye:
        dialogue.termination = "goodbye"
    else:
        dialogue.history.append({"role": "user", "content": result.reply})


def _start_dialogues(
    simulator: Simulator, scenarios: Sequence[Any], n_per_scenario: int, initial_emotion: int
) -> list[_Dialogue]:
    ids = [s.id for s in scenarios]
    if len(set(ids)) != len(ids):
        raise ValueError("scenario ids must be unique within one rollout")
    openings = simulator.opening_lines(scenarios)
    dialogues = []
    for scenario, opening in zip(scenarios, openings):
        for k in range(n_per_scenario):
            d = _Dialogue(f"{scenario.id}#{k}", scenario, initial_emotion, initial_emotion)
            if opening is None:
                d.transcript.append({"role": "user", "content": None, "error": "opening line could not be generated"})
                d.termination = "error"
            else:
                d.transcript.append({"role": "user", "content": opening})
                d.history.append({"role": "user", "content": opening})
            dialogues.append(d)
    return dialogues


def run_rollouts(
    policy: ChatBackend,
    simulator: Simulator,
    scenarios: Sequence[Any],
    *,
    n_per_scenario: int = 1,
    max_turns: int,
    initial_emotion: int,
    think: bool,
    sampling: SamplingParams,
    seed: int,
    progress: bool = True,
    max_context_tokens: int | None = None,
    format_violation: Literal["keep_reply", "end_dialogue"] = "keep_reply",
    final_reply: bool = False,
) -> list[Trajectory]:
    """Play ``len(scenarios) * n_per_scenario`` dialogues in lockstep (docs/ARCHITECTURE.md "Code map").

    ``max_turns``: cap on policy turns; ``initial_emotion``: starting score
    (0-100); ``sampling``: policy sampling (its seed is replaced per turn by one
    derived from ``seed`` and the turn); ``max_context_tokens``: when set, a
    dialogue whose next policy context plus ``sampling.max_new_tokens`` would
    exceed it ends before that turn, with ``context_limit`` (its last reply was
    already appraised); needs a policy backend with ``prompt_ids(conversation)``.
    ``format_violation``: ``keep_reply`` (the reply with all think tags and
    thought removed goes on) or ``end_dialogue``. ``final_reply``: on turn
    ``max_turns`` the simulator also writes the user's next message (one more call per
    dialogue that nothing reads); by default that turn is appraised only (the
    simulator's ``appraise`` where it has one: the user entry then has ``content``
    ``None`` and no goodbye, the emotion and appraisal as usual).
    Returns trajectories in order (scenario order, then replica ``k``); each has
    ``group_id`` = scenario id (GRPO groups). Raises ``ValueError`` on bad arguments
    or when the simulator answers for the wrong dialogues.
    """
    if max_turns < 1 or n_per_scenario < 1:
        raise ValueError("max_turns and n_per_scenario must be >= 1")
    if not 0 <= initial_emotion <= 100:
        raise ValueError(f"initial_emotion must be in [0, 100], got {initial_emotion}")
    if format_violation not in ("keep_reply", "end_dialogue"):
        raise ValueError(f"unknown format_violation {format_violation!r}")
    dialogues = _start_dialogues(simulator, scenarios, n_per_scenario, initial_emotion)
    with tqdm(total=max_turns, desc="rollout turns", unit="turn", disable=not progress) as bar:
        for turn in range(max_turns):
            live = [d for d in dialogues if d.termination is None]
            if not live:
                break
            if max_context_tokens is not None:
                live = _within_context(policy, live, think, sampling.max_new_tokens, max_context_tokens)
                if not live:
                    break
            bar.set_postfix(live=len(live))
            turn_sampling = replace(sampling, seed=derive_seed(seed, "policy", turn))
            generations = policy.generate([policy_messages(d.scenario, d.history, think) for d in live], turn_sampling)
            if len(generations) != len(live):
                raise ValueError(f"policy returned {len(generations)} generations for {len(live)} dialogues")
            to_user = [d for d, g in zip(live, generations) if _record_policy_turn(d, turn, g, think, format_violation)]
            if to_user:
                _simulate(simulator, to_user, turn, reply=final_reply or turn < max_turns - 1)
            bar.update(1)
    return [d.trajectory() for d in dialogues]


def _simulate(simulator: Simulator, dialogues: list[_Dialogue], turn: int, *, reply: bool = True) -> None:
    """One batched simulator step over ``dialogues`` (appraisal only when not ``reply``
    and the simulator has ``appraise``); results are matched by dialogue id."""
    requests = [SimulatorRequest(d.dialogue_id, d.scenario, list(d.history), d.emotion, turn) for d in dialogues]
    step = simulator.step if reply else getattr(simulator, "appraise", simulator.step)
    results = step(requests)
    by_id = {r.dialogue_id: r for r in results}
    if len(results) != len(requests) or set(by_id) != {d.dialogue_id for d in dialogues}:
        raise ValueError("simulator results do not match the requested dialogue ids")
    for d in dialogues:
        _record_user_turn(d, by_id[d.dialogue_id])


def _within_context(
    policy: ChatBackend, live: list[_Dialogue], think: bool, max_new_tokens: int, max_context_tokens: int
) -> list[_Dialogue]:
    """Dialogues whose next context leaves room for ``max_new_tokens``; the others end (``context_limit``).

    Needs a backend that can count prompt tokens (``prompt_ids(conversation)``, as
    ``TransformersBackend`` has); with any other backend the budget is not checked.
    """
    count = getattr(policy, "prompt_ids", None)
    if count is None:
        warnings.warn("max_context_tokens ignored: the policy backend has no prompt_ids()", stacklevel=3)
        return live
    kept = []
    for d in live:
        if len(count(policy_messages(d.scenario, d.history, think))) + max_new_tokens > max_context_tokens:
            d.termination = "context_limit"
        else:
            kept.append(d)
    return kept
