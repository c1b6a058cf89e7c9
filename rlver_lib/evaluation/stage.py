"""The evaluation stage (what notebook 04 and ``rlver eval`` call): :func:`evaluate`
runs the benchmark of one policy under the judge, its capability retention and, after
training, the paired comparison; the tables notebook 04 shows (its prose is
:mod:`rlver_lib.pipeline.report`'s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pandas as pd

from rlver_lib.backends import ChatBackend
from rlver_lib.config import RunConfig
from rlver_lib.evaluation.benchmark import BenchmarkResult, BenchmarkSummary, run_benchmark
from rlver_lib.evaluation.capability import run_lm_eval, run_retention
from rlver_lib.evaluation.judge import Judge
from rlver_lib.evaluation.paired import PairedComparison, write_paired
from rlver_lib.files import EvalFolder, RunFolder, process_rank
from rlver_lib.models import load_policy, make_policy_backend
from rlver_lib.plots import plot_breakdown, plot_emotion_trajectories, save_figure
from rlver_lib.scenarios import load_scenarios
from rlver_lib.stats import MIN_N, format_p


def headline_table(summary: BenchmarkSummary) -> Any:
    """The four headline figures with their intervals (index ``metric``, columns ``value,
    low, high``; the Sentient score and mean turns to one decimal, the rates to two) as a
    pandas ``Styler``, its data at ``.data``. Over fewer than
    :data:`rlver_lib.stats.MIN_N` scenarios the figures are greyed and the caption says
    the interval says little, as in :func:`styled_breakdown` and the run's headline."""
    estimates = {name: getattr(summary, name) for name in ("sentient_score", "success_rate", "failure_rate",
                                                           "mean_turns")}
    table = pd.DataFrame({"value": [e.value for e in estimates.values()], "low": [e.low for e in estimates.values()],
                          "high": [e.high for e in estimates.values()]},
                         index=pd.Index(list(estimates), name="metric"))
    styled = (table.style.format("{:.1f}", subset=pd.IndexSlice[["sentient_score", "mean_turns"], :])
              .format("{:.2f}", subset=pd.IndexSlice[["success_rate", "failure_rate"], :]))
    if summary.n_scenarios < MIN_N:
        styled = styled.set_properties(color="#999").set_caption(
            f"grey: n = {summary.n_scenarios} scenarios < {MIN_N}, the interval says little")
    return styled


def styled_breakdown(breakdown: pd.DataFrame) -> Any:
    """The breakdown table as a pandas ``Styler``: rows of groups with fewer than
    :data:`rlver_lib.stats.MIN_N` scenarios greyed, numbers to one decimal (rates two)."""
    def grey(row: pd.Series) -> list[str]:
        return ["color: #999" if row["n_scenarios"] < MIN_N else ""] * len(row)

    formats = {c: "{:.1f}" for c in ("sentient_score", "sentient_low", "sentient_high", "mean_turns")}
    formats |= {c: "{:.2f}" for c in ("success_rate", "failure_rate")}
    return (breakdown.style.apply(grey, axis=1).format(formats).hide(axis="index")
            .set_caption(f"grey: fewer than {MIN_N} scenarios, the interval says little"))


# --------------------------------------------------------------------------- the benchmark stage


def capability_retention(cfg: RunConfig, policy: ChatBackend, bench: EvalFolder) -> dict[str, Any] | None:
    """The capability checks ``cfg.capability`` asks for, on ``policy``, written into
    ``bench``: the offline ones (:func:`run_retention`) unless both their counts are 0,
    then ``lm_eval``'s tasks, if any (the harness path: GPU, model hub), under
    ``"lm_eval"``. ``None`` when nothing is asked (docs/ARCHITECTURE.md "Config
    conventions": a part is off at a count of 0)."""
    cap = cfg.capability
    offline = cap.n_humaneval_problems or cap.n_math_items
    if not offline and not cap.lm_eval.tasks:
        return None
    out = run_retention(policy, cap, bench.root, seed=cfg.seed, n_boot=cfg.evaluation.n_boot,
                        confidence=cfg.evaluation.confidence) if offline else {}
    if cap.lm_eval.tasks:
        out["lm_eval"] = run_lm_eval(cfg.policy.model, cfg.policy.adapter, cap.lm_eval, bench.lm_eval,
                                     dtype=cfg.policy.compute_dtype(), seed=cfg.seed)
    return out


@dataclass
class Evaluation:
    """One evaluated policy: the benchmark result, the judge that scored it (closed; its
    description and name stay), the capability-retention figures (``capability.json``
    content, :func:`rlver_lib.evaluation.capability.run_retention`, with ``lm_eval``'s
    results when it ran; ``None`` when every capability count is 0 and ``lm_eval`` has no
    task) and, for a non-baseline label in a run with a
    baseline, the paired comparison."""

    benchmark: BenchmarkResult
    judge: Judge
    capability: dict[str, Any] | None
    paired: PairedComparison | None = None


def evaluate(cfg: RunConfig, *, label: str | None = None) -> Evaluation | None:
    """The benchmark (and maths retention) of ``cfg.policy`` (with ``cfg.policy.adapter``
    when set) on ``cfg.scenarios.test``, written to ``<run_dir>/eval/<label>/``.

    The judge is ``cfg.evaluation.judge`` (:meth:`rlver_lib.evaluation.judge.Judge.from_config`), never
    ``cfg.simulator``; its description and the protocol go into ``summary.json``.
    ``label`` defaults to ``trained`` with an adapter, else ``baseline``.  Writes the
    files of :func:`run_benchmark`, the capability-retention files (:func:`capability_retention`),
    ``<run_dir>/figures/eval_<label>_{trajectory,breakdown}.png``, and, for a label other
    than ``baseline`` when ``eval/baseline`` exists, ``<run_dir>/eval/paired.json``
    (:func:`write_paired`).

    Under a multi-process launch only rank 0 runs it (one judge, one writer of
    ``eval/<label>/``); another rank loads nothing, calls no judge and returns ``None``.
    """
    label = label or ("trained" if cfg.policy.adapter else "baseline")
    folder = RunFolder(cfg.run_dir)
    bench = folder.eval_dir(label)
    rank = process_rank()
    if rank > 0:
        print(f"rank {rank}: the benchmark runs on rank 0 only, which writes {bench.root}")
        return None
    model, tokenizer = load_policy(cfg.policy)
    policy = make_policy_backend(cfg.policy, model, tokenizer)
    scenarios = load_scenarios(cfg.scenarios.test)[: cfg.scenarios.n_test_scenarios]
    sampling = cfg.policy.sampling(cfg.seed)
    with Judge.from_config(cfg.evaluation, cfg.seed) as judge:
        simulator = judge.simulator  # built first: the description then records what its server serves
        result = run_benchmark(
            policy, simulator, scenarios, cfg.evaluation, sampling=sampling, think=cfg.policy.think, seed=cfg.seed,
            out_dir=bench.root, label=label, max_context_tokens=cfg.policy.max_context_tokens,
            format_violation=cfg.policy.format_violation, judge=judge.description)
    traj = result.summary.trajectory.assign(label=label)
    save_figure(plot_emotion_trajectories(traj), folder.eval_figure(label, "trajectory"))
    save_figure(plot_breakdown(result.summary.breakdown), folder.eval_figure(label, "breakdown"))
    capability = capability_retention(cfg, policy, bench)
    paired = None
    if label != "baseline":
        paired = write_paired(cfg.run_dir, trained=label, n_boot=cfg.evaluation.n_boot,
                              confidence=cfg.evaluation.confidence, seed=cfg.seed)
    return Evaluation(result, judge, capability, paired)


def eval_command(cfg: RunConfig, *, label: str | None = None) -> int:
    """``rlver eval PARAMS.yaml``: run :func:`evaluate`, print the headline figures and the
    judge that scored them, return 0."""
    ev = evaluate(cfg, label=label)
    if ev is None:  # a non-main rank of a multi-process launch
        return 0
    s = ev.benchmark.summary
    print(f"{ev.benchmark.label}: Sentient score {s.sentient_score.value:.1f} "
          f"[{s.sentient_score.low:.1f}, {s.sentient_score.high:.1f}] over {s.n_scenarios} scenario(s), "
          f"success {s.n_success}/{s.n}, failure {s.n_failure}/{s.n}, "
          f"errors {s.n_error} ({100 * s.error_rate:.0f}%; with them put back, the score lies in "
          f"[{s.score_errors_as_zero:.1f}, {s.score_errors_as_100:.1f}]: errored dialogues at 0, then at 100), "
          f"context-budget stops {s.n_context_limit}, "
          f"mean turns {s.mean_turns.value:.2f}, protocol {cfg.evaluation.protocol} -> {ev.benchmark.out_dir}")
    print("judge: " + ev.judge.name)
    if ev.capability is not None:
        print("capability retention: " + json.dumps({k: v for k, v in ev.capability.items() if k != "lm_eval"}))
    if ev.paired is not None:
        d = ev.paired.difference
        print(f"paired vs baseline: {d.mean_diff:+.1f} [{d.ci_low:+.1f}, {d.ci_high:+.1f}], "
              f"{format_p(d.p_value, d.p_method)}, "
              f"n = {d.n_scenarios} scenarios")
    return 0
