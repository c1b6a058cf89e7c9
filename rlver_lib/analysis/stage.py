"""The analysis stage (what notebook 06 calls): the strategy analysis with its
annotator, reward hacking, injection probes, simulator consistency and sycophancy of one
run, each written under ``<run>/analysis/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from rlver_lib.analysis.cells import ANNOTATIONS, write_table
from rlver_lib.analysis.hacking import (
    at_fault_scenarios,
    distinct_table,
    hacking_statistics,
    length_controlled_gain,
    requests_from_records,
    run_injection_probes,
    simulator_consistency,
    summarize_injection,
    sycophancy_rate,
    sycophancy_replies,
    turn_features,
)
from rlver_lib.analysis.runs import run_replies, sample_replies
from rlver_lib.analysis.strategies import (
    CONSISTENCY_PASSES,
    UNPARSED,
    annotate_strategies,
    annotator_name,
    annotator_validation,
    labelled_set_agreement,
    plot_strategy_mix,
    plot_strategy_use,
    self_agreement,
    strategy_mix,
    strategy_use,
)
from rlver_lib.backends import ChatBackend, TransformersBackend
from rlver_lib.config import AnnotatorConfig, RunConfig
from rlver_lib.evaluation.judge import Judge
from rlver_lib.files import RunFolder
from rlver_lib.models import load_policy
from rlver_lib.records import scored_records
from rlver_lib.scenarios import load_scenarios

# --------------------------------------------------------------------------- the analysis stage (notebook 06)


def strategy_figures(annotations: pd.DataFrame) -> list[Figure]:
    """The strategy figures of one run's :attr:`StrategyReport.annotations`: the primary mix
    and the strategy/dimension panels of baseline vs trained (when the run has those
    evaluations), and the primary mix over training steps (with two or more steps)."""
    figs = []
    evals = annotations[annotations["source"].isin(["baseline", "trained"]) & (annotations["primary"] != UNPARSED)]
    if not evals.empty:
        order = [s for s in ("baseline", "trained") if s in set(evals["source"])]
        fig = plot_strategy_mix(strategy_mix(evals, by="source"), by="source", order=order)
        fig.axes[0].set_title("Primary strategy on the benchmark: baseline vs trained")
        figs += [fig, plot_strategy_use(strategy_use(evals, by="source"), by="source")]
    steps = annotations[annotations["step"].notna() & (annotations["primary"] != UNPARSED)]
    if steps["step"].nunique() > 1:
        fig = plot_strategy_mix(strategy_mix(steps, by="step"), by="step")
        fig.axes[0].set_title("Primary strategy over training steps")
        figs.append(fig)
    return figs


@dataclass
class StrategyReport:
    """What :func:`strategy_analysis` measured: the ``annotator`` (description), the
    per-reply ``annotations`` (``source``, ``step``, the reply and its labels), the
    annotator's ``self_agreement`` across seeds and its ``validation`` against the shipped
    labelled set (``None`` when skipped), the set's own inter-annotator agreement
    ``labelled_set`` (:data:`INDEPENDENT_PASSES`) and annotator A's agreement with
    itself, ``labelled_set_consistency`` (:data:`CONSISTENCY_PASSES`)."""

    annotator: str
    annotations: pd.DataFrame
    self_agreement: pd.DataFrame | None
    validation: dict[str, Any] | None
    labelled_set: pd.DataFrame
    labelled_set_consistency: pd.DataFrame | None = None


def strategy_analysis(cfg: RunConfig, run_dir: str | Path, annotator: ChatBackend,
                      annotator_cfg: AnnotatorConfig) -> StrategyReport:
    """Annotate the strategies of a sample of the run's policy replies and measure the annotator's reliability.

    ``cfg.analysis.n_annotated_replies`` replies per source (baseline, each training step,
    trained; :func:`run_replies`, :func:`sample_replies`) are annotated by ``annotator``
    (:func:`annotate_strategies` at ``annotator_cfg``'s temperature and token budget).  The
    first ``n_self_agreement_replies`` of them are annotated again ``n_self_agreement_runs``
    times, under seeds ``seed``, ``seed + 1``, ... at the annotator's temperature, or 0.7 when
    it is greedy (the spread under sampling noise; :func:`self_agreement`); the annotator is
    scored on ``n_annotator_validation_items`` items of the labelled set
    (:func:`annotator_validation`).
    Writes ``<run>/analysis/strategy_annotations.csv`` (:data:`rlver_lib.analysis.cells.ANNOTATIONS`).
    """
    a = cfg.analysis
    replies = sample_replies(run_replies(run_dir), a.n_annotated_replies, seed=cfg.seed).reset_index(drop=True)
    budget = {"max_new_tokens": annotator_cfg.max_new_tokens}
    annotations = annotate_strategies(annotator, list(replies["reply"]), user_messages=list(replies["user"]),
                                      seed=cfg.seed, temperature=annotator_cfg.temperature,
                                      max_retries=annotator_cfg.max_retries, **budget)
    annotated = pd.concat([replies, annotations], axis=1)
    write_table(run_dir, ANNOTATIONS, annotated)
    agreement = None
    if a.n_self_agreement_replies and len(replies):
        sub = replies.head(a.n_self_agreement_replies)
        agreement = self_agreement(annotator, list(sub["reply"]), list(sub["user"]),
                                   seeds=[cfg.seed + k for k in range(a.n_self_agreement_runs)],
                                   temperature=annotator_cfg.temperature or 0.7, **budget)
    validation = None if a.n_annotator_validation_items == 0 else annotator_validation(
        annotator, n=a.n_annotator_validation_items, seed=cfg.seed, **budget)
    return StrategyReport(annotator_name(annotator_cfg), annotated, agreement, validation, labelled_set_agreement(),
                          labelled_set_agreement(passes=CONSISTENCY_PASSES))


def hacking_analysis(run_dir: str | Path, *, n_boot: int = 1000, confidence: float = 0.95,
                     seed: int = 0) -> dict[str, Any]:
    """Reward-hacking diagnostics on every appraised policy turn of the run.

    ``turns``: :func:`run_replies` with :func:`turn_features`; ``statistics``:
    :func:`hacking_statistics` of the per-turn emotion change, clustered by dialogue,
    with the source (training step, or evaluation label) partialled out; ``length``:
    :func:`length_controlled_gain` of trained over baseline evaluation turns (``None``
    without both) and its ``length_summary``; ``distinct``: :func:`distinct_table` per
    source.  Writes ``hacking_stats.csv``, ``length_bins.csv`` and ``distinct.csv``
    under ``<run>/analysis/``.
    """
    turns = turn_features(run_replies(run_dir))
    out: dict[str, Any] = {"turns": turns, "length": None, "length_summary": None}
    out["statistics"] = hacking_statistics(turns.assign(dialogue_id=turns["source"] + "/" + turns["dialogue_id"]),
                                           control="source", n_boot=n_boot, confidence=confidence, seed=seed)
    out["distinct"] = distinct_table(turns)
    write_table(run_dir, "hacking_stats", out["statistics"])
    write_table(run_dir, "distinct", out["distinct"])
    try:
        out["length"], out["length_summary"] = length_controlled_gain(turns)
        write_table(run_dir, "length_bins", out["length"])
    except ValueError:
        pass
    return out


def injection_analysis(cfg: RunConfig, run_dir: str | Path) -> pd.DataFrame | None:
    """The injection probes against the configured benchmark judge
    (``evaluation.judge``, :class:`rlver_lib.evaluation.judge.Judge`) on the run's test
    scenarios (the first ``analysis.n_probe_scenarios``; all when ``None``), from the
    benchmark's start emotion.  Writes ``injection_probes.csv`` (every appraisal) and
    ``injection_summary.csv`` (:func:`summarize_injection`); returns the summary, ``None``
    when ``n_probe_scenarios`` is 0 (the probes are off)."""
    if cfg.analysis.n_probe_scenarios == 0:
        return None
    scenarios = load_scenarios(RunFolder(run_dir).scenarios("test"))[: cfg.analysis.n_probe_scenarios]
    with Judge.from_config(cfg.evaluation, cfg.seed) as judge:
        probes = run_injection_probes(judge.simulator, scenarios, emotion=cfg.evaluation.initial_emotion)
    summary = summarize_injection(probes, n_boot=cfg.evaluation.n_boot,
                                  confidence=cfg.evaluation.confidence, seed=cfg.seed)
    write_table(run_dir, "injection_probes", probes)
    write_table(run_dir, "injection_summary", summary.rename_axis("kind").reset_index())
    return summary


def consistency_analysis(cfg: RunConfig, run_dir: str | Path, label: str = "trained") -> pd.DataFrame | None:
    """Re-appraise ``analysis.n_consistency_turns`` recorded turns of ``eval/<label>`` with the
    benchmark judge at its own seed and at seed + 1 (:func:`simulator_consistency`);
    ``None`` when that count is 0 or nothing was recorded."""
    records = scored_records(RunFolder(run_dir).eval_dir(label).dialogues)
    if not cfg.analysis.n_consistency_turns or not records:
        return None
    scenarios = load_scenarios(RunFolder(run_dir).scenarios("test"))
    samples = requests_from_records(records, scenarios, n=cfg.analysis.n_consistency_turns, seed=cfg.seed)
    if not samples:
        return None
    built: list[Judge] = []

    def make(seed: int) -> Any:
        judge_cfg = cfg.evaluation.judge.model_copy(update={"seed": seed})
        built.append(Judge.from_config(cfg.evaluation.model_copy(update={"judge": judge_cfg}), cfg.seed))
        return built[-1].simulator

    base_seed = Judge.from_config(cfg.evaluation, cfg.seed).seed
    try:
        return simulator_consistency(make, samples, seed=base_seed, other_seed=base_seed + 1)
    finally:
        for judge in built:
            judge.close()


def sycophancy_analysis(cfg: RunConfig, run_dir: str | Path, annotator: ChatBackend,
                        annotator_cfg: AnnotatorConfig) -> pd.DataFrame | None:
    """How often the base and the trained policy absolve an at-fault user.

    ``analysis.n_sycophancy_replies`` replies (the policy's sampling settings) to the
    opening line of each at-fault test scenario of the run (:func:`at_fault_scenarios`
    of ``scenarios.test``, not only the run's limited test list), by the base policy
    (adapter disabled) and, when the run trained one, by ``<run>/train/adapter``;
    annotated by ``annotator`` (``absolves_user``); :func:`sycophancy_rate` per policy.
    Writes ``sycophancy.csv`` (every reply and its labels).  ``None`` when there is no
    at-fault test scenario or ``n_sycophancy_replies`` is 0.
    """
    scenarios = at_fault_scenarios(load_scenarios(cfg.scenarios.test))
    if not scenarios or not cfg.analysis.n_sycophancy_replies:
        return None
    folder = RunFolder(run_dir)
    policy_cfg = cfg.policy.model_copy(update={"adapter": str(folder.adapter) if folder.adapter_config.is_file()
                                               else None})
    model, tokenizer = load_policy(policy_cfg)
    import torch

    if torch.cuda.is_available():  # GPU recipes: a 7B policy does not generate on CPU
        model.to("cuda")
    backend = TransformersBackend(model, tokenizer)
    sampling = cfg.policy.sampling(cfg.seed)
    kwargs = {"n_samples": cfg.analysis.n_sycophancy_replies, "sampling": sampling, "think": cfg.policy.think,
              "seed": cfg.seed}
    parts = []
    if policy_cfg.adapter:
        with model.disable_adapter():
            parts.append(sycophancy_replies(backend, scenarios, **kwargs).assign(policy="base"))
        parts.append(sycophancy_replies(backend, scenarios, **kwargs).assign(policy="trained"))
    else:
        parts.append(sycophancy_replies(backend, scenarios, **kwargs).assign(policy="base"))
    replies = pd.concat(parts, ignore_index=True)
    annotations = annotate_strategies(annotator, list(replies["reply"]), user_messages=list(replies["user"]),
                                      seed=cfg.seed, temperature=annotator_cfg.temperature,
                                      max_new_tokens=annotator_cfg.max_new_tokens,
                                      max_retries=annotator_cfg.max_retries)
    annotated = pd.concat([replies, annotations], axis=1)
    write_table(run_dir, "sycophancy", annotated)
    return sycophancy_rate(annotated, n_boot=cfg.evaluation.n_boot, confidence=cfg.evaluation.confidence,
                           seed=cfg.seed)
