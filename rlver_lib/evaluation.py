"""The Sentient benchmark, SAGE transcript scoring and capability retention (DESIGN §1, §3).

Benchmark (the paper's "Sentient benchmark", RLVER §4.1 / SAGE): held-out scenarios,
the simulated user starts at emotion 40, at most 10 policy turns, every policy reply
appraised (the last one too).  Figures, all over dialogues:

- **Sentient score** = mean final emotion, in emotion points [0, 100];
- **success rate** = share of dialogues whose final emotion is >= 100, in [0, 1];
- **failure rate** = share whose final emotion is < 10, in [0, 1];
- **mean turns** = mean number of policy turns, in [0, max_turns].

Each comes with a percentile bootstrap confidence interval (:func:`bootstrap_ci`).

Emotion trajectories: turn 0 is the initial emotion, turn k the emotion after the
k-th policy reply was appraised.  A dialogue that ended before turn k contributes
its final emotion to ``mean_emotion`` at turn k (carried forward), so the last turn
of ``mean_emotion`` equals the Sentient score; ``mean_emotion_alive`` averages only
the dialogues still running at turn k, and ``n_alive`` counts them.

Record formats read here (detected per record):

- our dialogue records (``Trajectory.to_record()`` plus the scenario's
  ``hidden_intention``, ``personality`` and ``language``, added by
  :func:`run_benchmark`): ``final_emotion``, ``initial_emotion`` and the transcript
  ``turns`` (``assistant`` entries are policy turns; each ``user`` entry after one
  carries ``change`` and the ``emotion`` after that appraisal);
- SAGE result records (``../shared/data/README.md``): ``emo_point`` (final
  emotion), ``history`` of ``user`` messages with ``emotion-point`` and
  ``assistant`` messages, ``task`` (hidden intention) and ``character``
  (personality type, Chinese) — mapped to our intention and personality keys.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from rlver_lib.backends import ChatBackend, SamplingParams
from rlver_lib.io import atomic_write_json, atomic_write_text, iter_jsonl, write_jsonl

SUCCESS_EMOTION = 100
FAILURE_EMOTION = 10
BREAKDOWN_FACTORS = ("hidden_intention", "personality", "language")
UNKNOWN = "unknown"


class RecordError(ValueError):
    """A dialogue record that is neither one of ours nor a SAGE result record."""


# --------------------------------------------------------------------------- bootstrap


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its percentile bootstrap interval ``[low, high]``."""

    value: float
    low: float
    high: float
    confidence: float


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimate:
    """Mean of ``values`` with a percentile bootstrap confidence interval.

    Draws ``n_boot`` resamples of size n with replacement as one index matrix
    ``numpy.random.default_rng(seed).integers(0, n, size=(n_boot, n))``, takes each
    resample's mean, and returns the ``(1-confidence)/2`` and ``(1+confidence)/2``
    percentiles of those means (numpy's default linear interpolation).  Same
    inputs and seed give the same interval.

    Raises ``ValueError`` on an empty input, non-finite values, ``n_boot < 1`` or a
    confidence outside (0, 1).
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("bootstrap_ci needs a non-empty 1-D sequence of values")
    if not np.all(np.isfinite(x)):
        raise ValueError("bootstrap_ci: values must be finite")
    if n_boot < 1:
        raise ValueError(f"bootstrap_ci: n_boot must be >= 1, got {n_boot}")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap_ci: confidence must be in (0, 1), got {confidence}")
    idx = np.random.default_rng(seed).integers(0, x.size, size=(n_boot, x.size))
    means = x[idx].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.percentile(means, [100 * alpha, 100 * (1 - alpha)])
    return Estimate(float(x.mean()), float(low), float(high), confidence)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class DialogueView:
    """The benchmark-relevant view of one dialogue record, whatever its format.

    ``emotions``: [initial, after turn 1, ..., after turn k] in emotion points.
    """

    final_emotion: float
    n_turns: int
    emotions: tuple[float, ...]
    hidden_intention: str
    personality: str
    language: str


def _our_view(record: dict[str, Any]) -> DialogueView:
    turns = record.get("turns") or []
    final = float(record["final_emotion"])
    start = record.get("initial_emotion")
    path = [float(start)] if isinstance(start, (int, float)) else []
    path += [float(t["emotion"]) for t in turns
             if t.get("role") == "user" and isinstance(t.get("emotion"), (int, float))]
    if not path or path[-1] != final:
        path.append(final)
    return DialogueView(
        final_emotion=final,
        n_turns=sum(t.get("role") == "assistant" for t in turns),
        emotions=tuple(path),
        hidden_intention=str(record.get("hidden_intention") or UNKNOWN),
        personality=str(record.get("personality") or UNKNOWN),
        language=str(record.get("language") or UNKNOWN),
    )


def _sage_view(record: dict[str, Any]) -> DialogueView:
    from rlver_lib.scenarios import HIDDEN_INTENTIONS, PERSONALITY_TYPES

    history = record.get("history") or []
    final = float(record["emo_point"])
    path = [float(m["emotion-point"]) for m in history
            if m.get("role") == "user" and isinstance(m.get("emotion-point"), (int, float))]
    if not path or path[-1] != final:
        path.append(final)
    task = str(record.get("task") or UNKNOWN)
    intention = {h.zh: h.key for h in HIDDEN_INTENTIONS.values()}.get(task, task)
    character = str(record.get("character") or UNKNOWN)
    personality = {p.zh: p.key for p in PERSONALITY_TYPES.values()}.get(character, character)
    return DialogueView(
        final_emotion=final,
        n_turns=sum(m.get("role") == "assistant" for m in history),
        emotions=tuple(path),
        hidden_intention=intention,
        personality=personality,
        language="zh" if re.search(r"[\u4e00-\u9fff]", task) else "en",
    )


def dialogue_view(record: dict[str, Any]) -> DialogueView:
    """Read one record of either format (detected by ``final_emotion`` / ``emo_point``).

    Raises :class:`RecordError` when the record has neither field or it is not a number.
    """
    if isinstance(record.get("final_emotion"), (int, float)):
        return _our_view(record)
    if isinstance(record.get("emo_point"), (int, float)):
        return _sage_view(record)
    raise RecordError("record has neither a numeric 'final_emotion' (ours) nor 'emo_point' (SAGE)")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON Lines dialogue file (ours or SAGE), validated.

    Raises :class:`rlver_lib.io.JsonlError` on a bad line and :class:`RecordError`
    naming file and line for a record of neither format.
    """
    records = []
    for line, record in iter_jsonl(path):
        try:
            dialogue_view(record if isinstance(record, dict) else {})
        except RecordError as err:
            raise RecordError(f"{path}:{line}: {err}") from None
        records.append(record)
    return records


# --------------------------------------------------------------------------- summary


@dataclass
class BenchmarkSummary:
    """Benchmark figures over ``n`` dialogues (see the module docstring for units).

    ``n_error``: dialogues that ended with termination ``error`` (the simulator gave
    no usable appraisal); they carry no verified final emotion, so they are left out
    of every figure and only counted here.
    ``breakdown``: one row per (factor, level) with columns ``factor, level, n,
    sentient_score, success_rate, failure_rate, mean_turns``; within each factor
    the ``n`` sum to the total.  ``trajectory``: one row per turn with ``turn,
    mean_emotion`` (carried forward), ``mean_emotion_alive``, ``n_alive``.
    """

    n: int
    n_success: int
    n_failure: int
    sentient_score: Estimate
    success_rate: Estimate
    failure_rate: Estimate
    mean_turns: Estimate
    breakdown: pd.DataFrame = field(repr=False)
    trajectory: pd.DataFrame = field(repr=False)
    n_error: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The headline figures as plain JSON-able data (what ``summary.json`` holds)."""
        out: dict[str, Any] = {"n": self.n, "n_success": self.n_success, "n_failure": self.n_failure,
                               "n_error": self.n_error}
        for name in ("sentient_score", "success_rate", "failure_rate", "mean_turns"):
            out[name] = asdict(getattr(self, name))
        return out


def _group_figures(views: list[DialogueView]) -> dict[str, float]:
    final = np.array([v.final_emotion for v in views])
    return {
        "n": len(views),
        "sentient_score": float(final.mean()),
        "success_rate": float((final >= SUCCESS_EMOTION).mean()),
        "failure_rate": float((final < FAILURE_EMOTION).mean()),
        "mean_turns": float(np.mean([v.n_turns for v in views])),
    }


def breakdown_table(views: list[DialogueView]) -> pd.DataFrame:
    """Per-level figures for each factor of :data:`BREAKDOWN_FACTORS` (levels sorted)."""
    rows = []
    for factor in BREAKDOWN_FACTORS:
        levels = sorted({getattr(v, factor) for v in views})
        for level in levels:
            group = [v for v in views if getattr(v, factor) == level]
            rows.append({"factor": factor, "level": level, **_group_figures(group)})
    return pd.DataFrame(rows, columns=["factor", "level", "n", "sentient_score",
                                       "success_rate", "failure_rate", "mean_turns"])


def trajectory_table(views: list[DialogueView]) -> pd.DataFrame:
    """Mean emotion per turn; ended dialogues carry their final emotion forward."""
    horizon = max(len(v.emotions) for v in views)
    padded = np.array([list(v.emotions) + [v.emotions[-1]] * (horizon - len(v.emotions))
                       for v in views])
    alive = np.array([[t < len(v.emotions) for t in range(horizon)] for v in views])
    alive_sum = np.where(alive, padded, 0.0).sum(axis=0)
    n_alive = alive.sum(axis=0)
    return pd.DataFrame({
        "turn": np.arange(horizon),
        "mean_emotion": padded.mean(axis=0),
        "mean_emotion_alive": alive_sum / n_alive,
        "n_alive": n_alive,
    })


def summarize(
    records: Iterable[dict[str, Any]],
    *,
    n_boot: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> BenchmarkSummary:
    """Benchmark figures with bootstrap intervals, breakdowns and the mean trajectory.

    ``records`` are our dialogue records or SAGE result records (mixed is fine).
    Each figure's interval uses :func:`bootstrap_ci` with the same ``seed``.
    Dialogues that ended in ``error`` are excluded and counted in ``n_error``.
    Raises ``ValueError`` when no scored record remains, :class:`RecordError` on a bad one.
    """
    records = list(records)
    views = [dialogue_view(r) for r in records if r.get("termination") != "error"]
    if not views:
        raise ValueError(f"summarize needs at least one scored dialogue record (got {len(records)}, "
                         "all ended in error)" if records else "summarize needs at least one dialogue record")
    final = np.array([v.final_emotion for v in views])
    boot = dict(n_boot=n_boot, confidence=confidence, seed=seed)
    return BenchmarkSummary(
        n=len(views),
        n_success=int((final >= SUCCESS_EMOTION).sum()),
        n_failure=int((final < FAILURE_EMOTION).sum()),
        sentient_score=bootstrap_ci(final, **boot),
        success_rate=bootstrap_ci((final >= SUCCESS_EMOTION).astype(float), **boot),
        failure_rate=bootstrap_ci((final < FAILURE_EMOTION).astype(float), **boot),
        mean_turns=bootstrap_ci([v.n_turns for v in views], **boot),
        breakdown=breakdown_table(views),
        trajectory=trajectory_table(views),
        n_error=len(records) - len(views),
    )


# --------------------------------------------------------------------------- benchmark


@dataclass
class BenchmarkResult:
    """What :func:`run_benchmark` produced: records, summary and the folder written."""

    label: str
    records: list[dict[str, Any]]
    summary: BenchmarkSummary
    out_dir: Path


def _scenario_fields(scenario: Any) -> dict[str, Any]:
    return {
        "hidden_intention": scenario.hidden_intention,
        "personality": scenario.personality,
        "language": scenario.language,
    }


def write_summary(summary: BenchmarkSummary, out_dir: str | Path, label: str) -> None:
    """Write ``summary.json``, ``breakdown.csv`` and ``trajectory.csv`` atomically."""
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "summary.json", {"label": label, **summary.to_dict()})
    atomic_write_text(out_dir / "breakdown.csv", summary.breakdown.to_csv(index=False))
    atomic_write_text(out_dir / "trajectory.csv", summary.trajectory.to_csv(index=False))


def run_benchmark(
    policy_backend: ChatBackend,
    simulator: Any,
    scenarios: Sequence[Any],
    eval_cfg: Any,
    *,
    sampling: SamplingParams,
    think: bool,
    seed: int,
    out_dir: str | Path,
    label: str,
    max_context_tokens: int | None = None,
    format_violation: str = "keep_reply",
) -> BenchmarkResult:
    """Run the Sentient benchmark and write ``out_dir/{dialogues.jsonl, summary.json,
    breakdown.csv, trajectory.csv}`` atomically.

    One dialogue per scenario (the first ``eval_cfg.n_scenarios`` when set), started
    at ``eval_cfg.initial_emotion`` and capped at ``eval_cfg.max_turns`` policy
    turns, through :func:`rlver_lib.rollout.run_rollouts`.  Each record is the
    trajectory's ``to_record()`` plus ``label`` and the scenario's hidden intention,
    personality type and language.  ``max_context_tokens`` and ``format_violation``
    are passed to the rollout (``policy`` config settings of the same names).
    Raises ``ValueError`` when no scenarios are given.
    """
    from rlver_lib.rollout import run_rollouts

    scenarios = list(scenarios)[: eval_cfg.n_scenarios]
    if not scenarios:
        raise ValueError("run_benchmark needs at least one scenario")
    trajectories = run_rollouts(
        policy_backend, simulator, scenarios,
        n_per_scenario=1, max_turns=eval_cfg.max_turns,
        initial_emotion=eval_cfg.initial_emotion, think=think,
        sampling=sampling, seed=seed, max_context_tokens=max_context_tokens,
        format_violation=format_violation,
    )
    by_id = {s.id: s for s in scenarios}
    records = [{**t.to_record(), "label": label, **_scenario_fields(by_id[t.scenario_id])}
               for t in trajectories]
    summary = summarize(records, n_boot=eval_cfg.bootstrap_samples,
                        confidence=eval_cfg.confidence, seed=seed)
    out_dir = Path(out_dir)
    write_jsonl(out_dir / "dialogues.jsonl", records)
    write_summary(summary, out_dir, label)
    return BenchmarkResult(label, records, summary, out_dir)


# --------------------------------------------------------------------------- SAGE scoring


def sage_score(paths: Iterable[str | Path]) -> pd.DataFrame:
    """Score transcript files: SAGE result files or our ``dialogues.jsonl`` (detected).

    One row per file with ``file`` (name), ``model`` (name without ``_result`` /
    extension, or the parent folder for ``dialogues.jsonl``), ``n``,
    ``sentient_score`` (mean final emotion, 0-100), ``success`` (final >= 100) and
    ``failure`` (final < 10) counts.  Files are read as JSON Lines (``\\n``-separated).
    Raises ``FileNotFoundError``, :class:`rlver_lib.io.JsonlError` or
    :class:`RecordError` (file and line named).
    """
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        final = np.array([dialogue_view(r).final_emotion for r in load_records(path)])
        if final.size == 0:
            raise RecordError(f"{path}: no dialogue records")
        model = path.parent.name if path.name == "dialogues.jsonl" else re.sub(r"_result$", "", path.stem)
        rows.append({
            "file": path.name, "model": model, "n": int(final.size),
            "sentient_score": float(final.mean()),
            "success": int((final >= SUCCESS_EMOTION).sum()),
            "failure": int((final < FAILURE_EMOTION).sum()),
        })
    return pd.DataFrame(rows, columns=["file", "model", "n", "sentient_score", "success", "failure"])


def sage_score_command(paths: Sequence[str | Path], as_json: bool = False) -> int:
    """``rlver sage-score FILE ... [--json]``: print the :func:`sage_score` table.

    Returns 0, or 2 after printing the error to stderr when a file is missing or bad.
    """
    from rlver_lib.io import JsonlError

    try:
        table = sage_score(paths)
    except (FileNotFoundError, JsonlError, RecordError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(table.to_dict(orient="records"), ensure_ascii=False, indent=2))
    else:
        print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    return 0


# --------------------------------------------------------------------------- capability retention

MATH_PROMPT = (
    "Solve the following problem. Think briefly, then give only the final answer "
    "as \\boxed{{answer}} (an integer or a fraction a/b).\n\nProblem: {problem}"
)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+)?")


@dataclass(frozen=True)
class MathProblem:
    """One problem with its exact answer (an integer or a fraction ``a/b``)."""

    id: str
    problem: str
    answer: str


def load_math_problems(path: str | Path | None = None, limit: int | None = None) -> list[MathProblem]:
    """The shipped retention set (``rlver_lib/data/math_retention.jsonl``) or ``path``.

    Raises ``ValueError`` naming the line when a record lacks a field or its answer
    does not parse as an exact number.
    """
    source = Path(path) if path else Path(str(resources.files("rlver_lib") / "data" / "math_retention.jsonl"))
    problems = []
    for line, rec in iter_jsonl(source):
        try:
            problem = MathProblem(str(rec["id"]), str(rec["problem"]), str(rec["answer"]))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}:{line}: missing field {err}") from None
        if parse_number(problem.answer) is None:
            raise ValueError(f"{source}:{line}: answer {problem.answer!r} is not an exact number")
        problems.append(problem)
    return problems[:limit]


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def parse_number(text: str) -> Fraction | None:
    """An exact number from ``text``: ``12``, ``-3``, ``1,000``, ``0.75``, ``3/4``,
    ``\\frac{3}{4}`` / ``\\dfrac{3}{4}``; ``None`` when it is not exactly one number."""
    s = text.strip().strip("$ .").replace("\\!", "").replace(" ", "")
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num}/{den}"
    if not re.fullmatch(r"-?\d[\d,]*(\.\d+)?(/-?\d+)?", s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> Fraction | None:
    """The final answer of a model output: the last ``\\boxed{...}`` if any, else the
    last number in the text (integers, decimals, ``a/b``); ``None`` if neither."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


@dataclass
class MathResult:
    """Capability-retention outcome: per-problem table and accuracy (share correct, [0, 1])."""

    accuracy: Estimate
    table: pd.DataFrame = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (what ``eval/<label>/math.json`` holds)."""
        return {"accuracy": asdict(self.accuracy), "items": self.table.to_dict(orient="records")}


def math_retention(
    policy_backend: ChatBackend,
    problems: Sequence[MathProblem],
    *,
    max_new_tokens: int = 64,
    seed: int = 0,
    batch_size: int = 8,
    n_boot: int = 1000,
    confidence: float = 0.95,
) -> MathResult:
    """Greedy answers to ``problems``, scored by exact match of :func:`extract_answer`
    against the reference answer; accuracy with a bootstrap interval.

    Raises ``ValueError`` when ``problems`` is empty.
    """
    if not problems:
        raise ValueError("math_retention needs at least one problem")
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    outputs: list[str] = []
    for start in tqdm(range(0, len(problems), batch_size), desc="math retention"):
        batch = problems[start:start + batch_size]
        convs = [[{"role": "user", "content": MATH_PROMPT.format(problem=p.problem)}] for p in batch]
        outputs += [g.text for g in policy_backend.generate(convs, sampling)]
    predicted = [extract_answer(o) for o in outputs]
    correct = [pred is not None and pred == parse_number(p.answer) for p, pred in zip(problems, predicted)]
    table = pd.DataFrame({
        "id": [p.id for p in problems],
        "answer": [p.answer for p in problems],
        "predicted": [None if x is None else str(x) for x in predicted],
        "correct": correct,
        "output": outputs,
    })
    acc = bootstrap_ci(np.array(correct, dtype=float), n_boot=n_boot, confidence=confidence, seed=seed)
    return MathResult(acc, table)


def _math_accuracy(result: MathResult | str | Path) -> dict[str, Any]:
    if isinstance(result, MathResult):
        return asdict(result.accuracy) | {"n": len(result.table)}
    data = json.loads(Path(result).read_text(encoding="utf-8"))
    return data["accuracy"] | {"n": len(data["items"])}


def compare_math(base: MathResult | str | Path, trained: MathResult | str | Path) -> pd.DataFrame:
    """Base vs trained policy side by side (paper §5: skills are kept): rows ``base`` and ``trained`` with
    ``accuracy, low, high, n``, and the ``delta`` (trained minus base) column.
    Accepts results or paths to their ``math.json``."""
    rows = {name: _math_accuracy(r) for name, r in (("base", base), ("trained", trained))}
    table = pd.DataFrame(rows).T.rename(columns={"value": "accuracy"})[["accuracy", "low", "high", "n"]]
    table["delta"] = [0.0, float(table.loc["trained", "accuracy"] - table.loc["base", "accuracy"])]
    return table


# --------------------------------------------------------------------------- rlver eval


def build_simulator(sim_cfg: Any, seed: int) -> Any:
    """The simulated user a config asks for: ``simulator.RuleSimulator`` (default change
    function, no model) when ``sim_cfg.backend == "rule"``, else an LLM
    ``simulator.UserSimulator`` over ``models.make_simulator_backend``."""
    if sim_cfg.backend == "rule":
        from rlver_lib.simulator import RuleSimulator

        return RuleSimulator()
    from rlver_lib.models import make_simulator_backend
    from rlver_lib.simulator import UserSimulator

    return UserSimulator(make_simulator_backend(sim_cfg, seed), sim_cfg, seed=seed)


@dataclass
class Evaluation:
    """One evaluated policy: the benchmark result and the maths retention (or ``None``)."""

    benchmark: BenchmarkResult
    math: MathResult | None


def evaluate(cfg: Any, *, label: str | None = None) -> Evaluation:
    """The benchmark (and maths retention) of ``cfg.policy`` (with ``cfg.policy.adapter``
    when set) on ``cfg.scenarios.test``, written to ``<run_dir>/eval/<label>/``.

    ``label`` defaults to ``trained`` with an adapter, else ``baseline``.  Writes the
    files of :func:`run_benchmark`, ``math.json`` when ``cfg.evaluation.math_retention``,
    and ``<run_dir>/figures/eval_<label>_{trajectory,breakdown}.png``.
    """
    from rlver_lib import analysis
    from rlver_lib.models import load_policy, make_policy_backend
    from rlver_lib.scenarios import load_scenarios

    label = label or ("trained" if cfg.policy.adapter else "baseline")
    out_dir = cfg.run_dir / "eval" / label
    model, tokenizer = load_policy(cfg.policy)
    policy = make_policy_backend(cfg.policy, model, tokenizer)
    scenarios = load_scenarios(cfg.scenarios.test)[: cfg.scenarios.limit_test]
    sampling = SamplingParams(temperature=cfg.policy.temperature, top_p=cfg.policy.top_p,
                              max_new_tokens=cfg.policy.max_new_tokens, seed=cfg.seed)
    result = run_benchmark(policy, build_simulator(cfg.simulator, cfg.seed), scenarios,
                           cfg.evaluation, sampling=sampling, think=cfg.policy.think,
                           seed=cfg.seed, out_dir=out_dir, label=label,
                           max_context_tokens=cfg.policy.max_context_tokens,
                           format_violation=cfg.policy.format_violation)
    figures = cfg.run_dir / "figures"
    traj = result.summary.trajectory.assign(label=label)
    analysis.save_figure(analysis.plot_emotion_trajectories(traj), figures / f"eval_{label}_trajectory.png")
    analysis.save_figure(analysis.plot_breakdown(result.summary.breakdown),
                         figures / f"eval_{label}_breakdown.png")
    math = None
    if cfg.evaluation.math_retention:
        problems = load_math_problems(limit=cfg.evaluation.math_n)
        math = math_retention(policy, problems, max_new_tokens=cfg.evaluation.math_max_new_tokens,
                              seed=cfg.seed, n_boot=cfg.evaluation.bootstrap_samples,
                              confidence=cfg.evaluation.confidence)
        atomic_write_json(out_dir / "math.json", math.to_dict())
    return Evaluation(result, math)


def eval_command(cfg: Any, *, label: str | None = None) -> int:
    """``rlver eval PARAMS.yaml``: run :func:`evaluate`, print the headline figures, return 0."""
    ev = evaluate(cfg, label=label)
    s = ev.benchmark.summary
    print(f"{ev.benchmark.label}: Sentient score {s.sentient_score.value:.1f} "
          f"[{s.sentient_score.low:.1f}, {s.sentient_score.high:.1f}], "
          f"success {s.n_success}/{s.n}, failure {s.n_failure}/{s.n}, errors excluded {s.n_error}, "
          f"mean turns {s.mean_turns.value:.2f} -> {ev.benchmark.out_dir}")
    if ev.math is not None:
        a = ev.math.accuracy
        print(f"maths retention: accuracy {a.value:.3f} [{a.low:.3f}, {a.high:.3f}] on {len(ev.math.table)} problems")
    return 0
