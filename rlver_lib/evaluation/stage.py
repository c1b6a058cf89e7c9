"""The evaluation stage (what notebook 04 and ``rlver eval`` call): :func:`evaluate`
runs the benchmark of one policy under the judge, its capability retention and, after
training, the paired comparison; the headline Markdown and tables of a run's report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from rlver_lib import character
from rlver_lib.appraisal import appraisal_mode
from rlver_lib.evaluation.benchmark import BenchmarkResult, BenchmarkSummary, run_benchmark
from rlver_lib.evaluation.capability import run_lm_eval, run_retention
from rlver_lib.evaluation.judge import Judge
from rlver_lib.evaluation.paired import PairedComparison, dropped_text, write_paired
from rlver_lib.files import RunFolder, process_rank
from rlver_lib.models import load_policy, make_policy_backend
from rlver_lib.params import load_run_config
from rlver_lib.plots import plot_breakdown, plot_emotion_trajectories, save_figure
from rlver_lib.scenarios import load_scenarios
from rlver_lib.stats import MIN_N, format_p


def _grey(text: str) -> str:
    return f'<span style="color:#888">{text}</span>'


def _judge_is_the_reward(folder: RunFolder, judge: dict[str, Any]) -> str:
    """``"the same model and appraisal"`` (or ``"the same model"``) when the run trained
    against a simulated user served by the judge's backend, model and URL (read from the
    run's ``config.yaml``); ``""`` otherwise or when there is no readable config."""
    try:
        cfg = load_run_config(folder.config)
    except (OSError, ValueError):
        return ""
    sim = cfg.simulator
    if "train" not in cfg.stages or sim.backend == "rule" or (sim.backend, sim.model, sim.base_url) != (
            judge.get("backend"), judge.get("model"), judge.get("base_url")):
        return ""
    return "the same model and appraisal" if appraisal_mode(sim.appraisal).describes(judge) else "the same model"


def headline_markdown(run_dir: str | Path, wall_s: float | None = None) -> str:
    """The report's opening block: the answer first.

    Reads ``<run_dir>/eval/paired.json`` and ``eval/*/summary.json``: the paired
    trained-minus-baseline difference (emotion points) with its interval and p-value
    (named exact or Monte Carlo, as computed), the pairs used and dropped, the
    difference with errored pairs at both bounds, the baseline and trained scores
    weighted like the difference (they subtract to it), each benchmark's score with
    its error bounds (errored dialogues at 0 and at 100), the judge (and, when it is
    the training reward's model, what a gain then shows), the protocol and
    ``wall_s`` (the run's wall time, seconds).  An interval or p-value over fewer
    than :data:`rlver_lib.stats.MIN_N` scenarios is greyed with the reason.
    Returns ``""`` when the run has no benchmark summary with figures.
    """
    folder = RunFolder(run_dir)
    summaries = {}
    for path in folder.summaries():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data.get("sentient_score"), dict):
            summaries[path.parent.name] = data
    if not summaries:
        return ""
    lines = ["## Headline"]
    paired_path = folder.paired
    paired = json.loads(paired_path.read_text(encoding="utf-8")) if paired_path.is_file() else None
    if paired:
        n = paired["n_scenarios"]
        diff = f"**{paired['mean_diff']:+.1f} emotion points** (trained minus baseline, paired over {n} scenario(s)"
        diff += f", {paired['n_pairs']} dialogue pair(s); {dropped_text(paired)})"
        method = f" ({paired['p_method']})" if paired.get("p_method") else ""
        stats = (f"{100 * paired['confidence']:.0f}% CI [{paired['ci_low']:+.1f}, {paired['ci_high']:+.1f}], "
                 f"sign-flip permutation {format_p(paired['p_value'], paired.get('p_method', ''))}{method}")
        if n < MIN_N:
            stats = _grey(f"{stats} — not evidence: n = {n} scenarios < {MIN_N}")
        lines.append(f"- Sentient score change: {diff}; {stats}.")
        low, high = paired.get("errors_low"), paired.get("errors_high")
        if low and high:
            n_b = high["n_scenarios"]
            bound_stats = (f"low: CI [{low['ci_low']:+.1f}, {low['ci_high']:+.1f}], "
                           f"{format_p(low['p_value'], low.get('p_method', ''))}; "
                           f"high: CI [{high['ci_low']:+.1f}, {high['ci_high']:+.1f}], "
                           f"{format_p(high['p_value'], high.get('p_method', ''))}")
            if n_b < MIN_N:
                bound_stats = _grey(f"{bound_stats} — n = {n_b} scenarios < {MIN_N}")
            lines.append(f"- With the {paired.get('n_dropped_error', 0)} errored pair(s) put back at the bounds "
                         "(errored trained dialogues at 0 and baseline ones at 100, then the reverse): change "
                         f"between {low['mean_diff']:+.1f} and {high['mean_diff']:+.1f} over {n_b} scenario(s) "
                         f"({bound_stats}).")
        lines.append(f"- Baseline {paired['baseline_score']:.2f} → trained {paired['trained_score']:.2f}: means over "
                     f"the {n} paired scenario(s) of each scenario's mean over its pairs, weighted like the change "
                     f"(trained minus baseline = {paired['trained_score'] - paired['baseline_score']:+.2f}).")
    for label, s in summaries.items():
        score = s["sentient_score"]
        n_sc = s.get("n_scenarios", s.get("n", 0))
        ci = f"({100 * score.get('confidence', 0.95):.0f}% CI [{score['low']:.1f}, {score['high']:.1f}])"
        if n_sc < MIN_N:
            ci = _grey(f"{ci} — n = {n_sc} scenarios < {MIN_N}")
        errors = ""
        if s.get("n_error"):
            errors = (f"; errors {s['n_error']} ({100 * s.get('error_rate', 0):.0f}%), left out: with them the score "
                      f"over all {s.get('n', 0) + s['n_error']} dialogues lies in "
                      f"[{s.get('score_errors_as_zero', float('nan')):.1f}, "
                      f"{s.get('score_errors_as_100', float('nan')):.1f}] (errored ones at 0 / at 100)")
        ctx = f"; {s['n_context_limit']} stopped by the context budget" if s.get("n_context_limit") else ""
        lines.append(f"- `{label}`: Sentient score {score['value']:.1f} over {s.get('n')} dialogue(s) of {n_sc} "
                     f"scenario(s) {ci}; success {s.get('n_success')}, failure {s.get('n_failure')}{errors}{ctx}.")
    kept = {label: s["character"] for label, s in summaries.items() if s.get("character")}
    if kept:
        lines.append("- Simulated user in character (lexical detectors, lower bounds): "
                     + "; ".join(f"`{label}` {character.describe(c)}" for label, c in kept.items()) + ".")
    first = next(iter(summaries.values()))
    judge = first.get("judge")
    protocol = first.get("protocol") or {}
    if judge:
        lines.append(f"- Judge: {Judge.name_of(judge)}.")
        same = _judge_is_the_reward(folder, judge)
        if same:
            lines.append(f"- The judge is {same} as the training reward: a gain shows that the learner optimises "
                         "its reward, not that the replies became more empathetic to people.")
    if protocol:
        rule = ("every policy reply appraised" if protocol.get("name") == "full"
                else f"{protocol.get('max_policy_turns')} policy replies, the first "
                     f"{protocol.get('appraised_turns')} appraised (SAGE's turn rule)")
        parity = ""
        if protocol.get("name") == "sage" and first.get("n_scenarios", 0) != 100:
            parity = (f" Leaderboard parity also needs SAGE's 100 test profiles as `scenarios.test` "
                      f"(this run: {first.get('n_scenarios')} scenarios).")
        lines.append(f"- Protocol: `{protocol.get('name')}` — start emotion {protocol.get('initial_emotion')}, "
                     f"{rule}, {protocol.get('repeats', 1)} dialogue(s) per scenario.{parity}")
    if wall_s is not None:
        lines.append(f"- Wall time: {wall_s / 60:.1f} min ({wall_s:.0f} s).")
    return "\n".join(lines)


def headline_table(summary: BenchmarkSummary) -> pd.DataFrame:
    """The four headline figures with their intervals: index ``metric``, columns
    ``value, low, high``; intervals over fewer than :data:`rlver_lib.stats.MIN_N`
    scenarios are left out (NaN)."""
    rows = []
    for name in ("sentient_score", "success_rate", "failure_rate", "mean_turns"):
        est = getattr(summary, name)
        small = summary.n_scenarios < MIN_N
        rows.append({"metric": name, "value": est.value, "low": np.nan if small else est.low,
                     "high": np.nan if small else est.high})
    return pd.DataFrame(rows).set_index("metric")


def error_statement(summary: BenchmarkSummary) -> str:
    """One paragraph: dialogue and scenario counts, why intervals may be left out, the
    error rate with the bounds on the Sentient score (errored dialogues counted at 0
    and at 100, points), and the context-budget stops."""
    parts = [f"{summary.n} scored dialogue(s) over {summary.n_scenarios} scenario(s): {summary.n_success} reached "
             f"100, {summary.n_failure} ended below 10."]
    if summary.n_scenarios < MIN_N:
        parts.append(f"Intervals left out: n = {summary.n_scenarios} scenarios < {MIN_N}.")
    if summary.n_error:
        parts.append(f"{summary.n_error} dialogue(s) ({100 * summary.error_rate:.0f}%) ended in a judge error and are "
                     f"excluded; whatever they would have scored, the Sentient score over all "
                     f"{summary.n + summary.n_error} dialogues lies between {summary.score_errors_as_zero:.1f} "
                     f"(errored ones at 0) and {summary.score_errors_as_100:.1f} (at 100).")
    else:
        parts.append("No judge errors.")
    if summary.n_context_limit:
        parts.append(f"{summary.n_context_limit} dialogue(s) stopped because the policy's context budget ran out "
                     "(termination context_limit).")
    return " ".join(parts)


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


@dataclass
class Evaluation:
    """One evaluated policy: the benchmark result, the judge that scored it (closed; its
    description and name stay), the capability-retention figures (``capability.json``
    content, :func:`rlver_lib.evaluation.capability.run_retention`; ``None`` when
    ``capability.enabled`` is false) and, for a non-baseline label in a run with a
    baseline, the paired comparison."""

    benchmark: BenchmarkResult
    judge: Judge
    capability: dict[str, Any] | None
    paired: PairedComparison | None = None


def evaluate(cfg: Any, *, label: str | None = None) -> Evaluation | None:
    """The benchmark (and maths retention) of ``cfg.policy`` (with ``cfg.policy.adapter``
    when set) on ``cfg.scenarios.test``, written to ``<run_dir>/eval/<label>/``.

    The judge is ``cfg.evaluation.judge`` (:meth:`rlver_lib.evaluation.judge.Judge.from_config`), never
    ``cfg.simulator``; its description and the protocol go into ``summary.json``.
    ``label`` defaults to ``trained`` with an adapter, else ``baseline``.  Writes the
    files of :func:`run_benchmark`, the capability-retention files when ``cfg.capability.enabled``,
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
    scenarios = load_scenarios(cfg.scenarios.test)[: cfg.scenarios.limit_test]
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
    capability = None
    if cfg.capability.enabled:
        capability = run_retention(policy, cfg.capability, bench.root, seed=cfg.seed,
                             n_boot=cfg.evaluation.bootstrap_samples, confidence=cfg.evaluation.confidence)
        if cfg.capability.lm_eval.enabled:  # the harness path (GPU, model hub): rlver_lib.evaluation.capability
            capability["lm_eval"] = run_lm_eval(cfg.policy.model, cfg.policy.adapter, cfg.capability.lm_eval,
                                          bench.lm_eval, dtype=cfg.policy.compute_dtype(), seed=cfg.seed)
    paired = None
    if label != "baseline":
        paired = write_paired(cfg.run_dir, trained=label, n_boot=cfg.evaluation.bootstrap_samples,
                              confidence=cfg.evaluation.confidence, seed=cfg.seed)
    return Evaluation(result, judge, capability, paired)


def eval_command(cfg: Any, *, label: str | None = None) -> int:
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
