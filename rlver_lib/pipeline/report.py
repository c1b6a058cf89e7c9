"""The report, the one home of its prose (docs/ARCHITECTURE.md "Code map"): the
header of a run's report (:func:`report_header`: the headline, the run's limits and,
once, its judge) and of an ablation's (:func:`ablation_header`), the statements the
notebooks display (the training, the judge and protocol, the benchmark's errors, the
paired comparison, the length-controlled gain, the annotator's reliability, capability
retention), and :func:`render_report`, which joins executed notebooks into one HTML file
(cells tagged ``report-skip`` left out). An algorithm is named by its object's
:attr:`~rlver_lib.algorithm_objects.Algorithm.label`, never from its config string.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from rlver_lib.appraisal import appraisal_mode
from rlver_lib.config import EvaluationConfig, RunConfig, TrainingConfig
from rlver_lib.evaluation.benchmark import BenchmarkSummary
from rlver_lib.evaluation.capability import RetentionComparison
from rlver_lib.evaluation.judge import Judge
from rlver_lib.evaluation.paired import PairedComparison
from rlver_lib.files import RunFolder, atomic_write_text
from rlver_lib.params import load_run_config
from rlver_lib.stats import MIN_N, format_p

if TYPE_CHECKING:
    import nbformat

# nbformat / nbconvert (2-3 s to import: jsonschema's format checkers build a grammar) and
# the algorithm objects (torch) are imported where they are used, so a notebook kernel that
# only displays statements, as every stage's does, starts without them

# --------------------------------------------------------------------------- the HTML

REPORT_SKIP_TAG = "report-skip"
"""Cells with this tag are left out of ``report.html`` (set-up cells, long listings)."""


def label_title(nb: nbformat.NotebookNode) -> None:
    """Put an executed notebook's papermill parameter ``label`` into its title, the
    first ``# `` heading of its first markdown cell: ``# 04 · Evaluation: the Sentient
    benchmark`` run with ``label='trained'`` becomes ``# 04 · Evaluation (trained): the
    Sentient benchmark``, so the template's two runs in one report read apart."""
    label = nb.metadata.get("papermill", {}).get("parameters", {}).get("label")
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if not label or cell is None:
        return
    lines = cell.source.split("\n")
    for i, line in enumerate(lines):
        if line.startswith("# "):
            title, colon, rest = line.partition(":")
            lines[i] = f"{title} ({label}){colon}{rest}"
            cell.source = "\n".join(lines)
            return


def render_report(notebooks: list[Path], html_path: Path, header_markdown: str) -> Path:
    """Assemble executed notebooks into one ``report.html`` (nbconvert, code hidden).

    Each notebook becomes a section, its title carrying its ``label`` parameter
    (:func:`label_title`: baseline and trained evaluation); cells tagged
    ``report-skip``, the parameter cells and stderr output (warnings, progress bars)
    are dropped; errors and figures stay, figures embedded as data URIs.
    Written atomically; returns ``html_path``.
    """
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor

    report = nbformat.v4.new_notebook()
    report.cells.append(nbformat.v4.new_markdown_cell(header_markdown))
    for number, path in enumerate(notebooks):
        if not path.exists():
            continue
        nb = nbformat.read(path, as_version=4)
        label_title(nb)
        report.cells.append(nbformat.v4.new_markdown_cell(f"---\n*Section from `{path.name}`*"))
        for cell in nb.cells:  # the same template may appear twice: keep cell ids unique
            cell["id"] = f"s{number}-{cell.get('id', len(report.cells))}"
            if cell.cell_type == "code":  # warnings and progress bars are not for readers
                cell.outputs = [o for o in cell.outputs
                                if not (o.output_type == "stream" and o.get("name") == "stderr")]
            report.cells.append(cell)
        report.metadata.setdefault("kernelspec", nb.metadata.get("kernelspec", {}))
        report.metadata.setdefault("language_info", nb.metadata.get("language_info", {}))
    exporter = HTMLExporter(exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.register_preprocessor(
        TagRemovePreprocessor(remove_cell_tags={REPORT_SKIP_TAG, "injected-parameters",
                                                "parameters"}, enabled=True),
        enabled=True,
    )
    title = f"RLVER run report: {html_path.parent.name}"  # the page title; nbconvert's default is "Notebook"
    html, _ = exporter.from_notebook_node(report, resources={"metadata": {"name": title}})
    atomic_write_text(html_path, html)
    return html_path


# --------------------------------------------------------------------------- a run's header


def _algorithm_label(training: TrainingConfig) -> str:
    """The report label of ``training``'s algorithm object
    (:attr:`rlver_lib.algorithm_objects.Algorithm.label`)."""
    from rlver_lib.algorithm_objects import algorithm_for

    return algorithm_for(training).label


def limits_statement(cfg: RunConfig, *, per_cell: bool = False) -> str:
    """Markdown naming the models that ran and, for the small embedded models or the
    rule simulator, what such a run can and cannot show.  ``per_cell``: for an ablation
    report, leave out the settings a grid varies (algorithm, steps, think mode,
    simulator difficulty), which :func:`ablation_header` lists per cell."""
    sim = cfg.simulator
    difficulty = "" if per_cell else f" ({sim.difficulty} difficulty)"
    sim_desc = ("the deterministic rule simulator (no language model)" if sim.backend == "rule"
                else f"`{sim.model}` through `{sim.backend}`{difficulty}")
    training = (f" Training: {_algorithm_label(cfg.training)}, {cfg.training.steps} step(s) of "
                f"{cfg.training.scenarios_per_step} scenario(s)." if "train" in cfg.stages and not per_cell else "")
    think = "" if per_cell else f", think mode {'on' if cfg.policy.think else 'off'}"
    lines = [f"**Models that ran{' (every cell)' if per_cell else ''}.** Policy: `{cfg.policy.model}` "
             f"({cfg.policy.backend}{think}, LoRA r={cfg.policy.lora.r}). "
             f"Simulated user: {sim_desc}.{training}"]
    limits = []
    if cfg.policy.model.startswith("embedded:"):
        limits.append("a 135M-parameter policy writes short, often generic replies (the paper "
                      "trained a 7B policy)")
    if sim.backend != "rule" and sim.model.startswith("embedded:"):
        limits.append("a small (1.5B, 4-bit) simulator gives only a coarse, noisy emotion signal "
                      "(the paper used a DeepSeek-V3-class simulator)")
    if sim.backend == "rule":
        limits.append("the rule simulator scores replies with a fixed function of the text: it "
                      "verifies plumbing and that the learner can follow a reward, nothing about "
                      "empathy")
    if limits:
        lines.append(
            "**What this run can and cannot show.** It checks that the whole loop works end to "
            "end — scenarios, multi-turn rollouts against a simulated user, emotion rewards, "
            "LoRA updates, benchmark, analysis — and its numbers are real measurements of these "
            "models. It cannot reproduce the paper's findings: " + "; ".join(limits) + "; and a "
            "few training steps on a handful of scenarios move the Sentient score by less than "
            "its confidence interval. Differences between baseline and trained policy here are "
            "not evidence about RLVER; for that, run the paper recipes on GPUs "
            "(`params/paper-*.yaml`, docs/GPU.md)."
        )
    return "\n\n".join(lines)


def run_wall_s(manifest: dict[str, Any]) -> float | None:
    """The run's wall time in seconds: the sum of its stages' recorded ``wall_s``."""
    walls = [s.get("wall_s") for s in manifest.get("stages", {}).values() if isinstance(s.get("wall_s"), (int, float))]
    return float(sum(walls)) if walls else None


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


def dropped_text(counts: dict[str, Any]) -> str:
    """The dropped pairs of a paired comparison in words, from ``counts`` (``paired.json``
    or its keys ``n_dropped``, ``n_dropped_error``, ``n_dropped_missing``)."""
    n_error = counts.get("n_dropped_error")
    n_missing = counts.get("n_dropped_missing")
    if n_error is None or n_missing is None:  # a paired.json written before the split
        return f"{counts.get('n_dropped', 0)} dropped (errored or missing)"
    return f"{n_error} dropped as errored on either side, {n_missing} as missing on one side"


def describe_character(counts: dict[str, int]) -> str:
    """One line for a report: the :func:`rlver_lib.character.summarize` counts in words."""
    return (f"{counts['wish_leaks']} hidden-wish leak(s), {counts['assistant_voice']} line(s) in the assistant's "
            f"voice, {counts['verbatim_repeats']} verbatim repeat(s), {counts['midrange_goodbyes']} mid-range "
            f"goodbye(s) in {counts['user_messages']} user message(s) of {counts['dialogues']} dialogue(s)")


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
                     + "; ".join(f"`{label}` {describe_character(c)}" for label, c in kept.items()) + ".")
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


def report_header(cfg: RunConfig, manifest: dict[str, Any]) -> str:
    """The report's Markdown header: the title, the headline
    (:func:`headline_markdown`, the one place the report names
    the judge: as it recorded itself in the benchmark's ``summary.json``), the seed,
    commit and stages, and what the run can and cannot show."""
    git = manifest.get("git", {})
    parts = [f"# RLVER run report: `{cfg.run_name}`"]
    headline = headline_markdown(cfg.run_dir.resolve(), run_wall_s(manifest))
    if headline:
        parts.append(headline)
    return "\n\n".join(parts + [
        f"Seed {cfg.seed}; git commit `{git.get('commit') or 'unknown'}`"
        f"{' (uncommitted changes)' if git.get('dirty') else ''}; "
        f"stages: {', '.join(cfg.stages)}.",
        limits_statement(cfg),
    ])


# --------------------------------------------------------------------------- an ablation's header


def ablation_header(name: str, axes: list[str],
                    cells: Sequence[tuple[str, Mapping[str, Any], RunConfig]]) -> str:
    """Markdown header of an ablation report: the axes, one table row per cell with what
    varies (each axis value, then algorithm and steps, think mode and simulator difficulty
    as that cell ran them), and the shared models and limits
    (:func:`limits_statement` with ``per_cell``). ``cells``: each cell's folder name, axis
    values and config, as :class:`rlver_lib.pipeline.ablate.AblationCell` holds them."""
    rows = ["| cell | " + " | ".join(axes) + " | training | think | simulator |",
            "|" + "---|" * (len(axes) + 4)]
    for cell_name, values, c in cells:
        training = (f"{_algorithm_label(c.training)}, {c.training.steps} step(s)"
                    if "train" in c.stages else "none")
        rows.append(f"| `{cell_name}` | " + " | ".join(str(values[a]) for a in axes)
                    + f" | {training} | {'on' if c.policy.think else 'off'} | {c.simulator.difficulty} |")
    return "\n\n".join([f"# RLVER ablation report: `{name}`", f"Axes: {', '.join(axes)}; {len(cells)} runs.",
                         "\n".join(rows), limits_statement(cells[0][2], per_cell=True)])


# --------------------------------------------------------------------------- what the notebooks display (03, 04, 06)


def training_statement(cfg: RunConfig, n_scenarios: int) -> str:
    """Markdown opening notebook 03: the algorithm (its report label,
    :func:`rlver_lib.algorithm_objects.algorithm_for`), the steps, the scenarios per step
    and the rollouts of each (``training.group_size``) over the ``n_scenarios`` training
    scenarios, the policy, the simulator's backend and the think mode."""
    t = cfg.training
    return (f"**{_algorithm_label(t)}**, {t.steps} steps × {t.scenarios_per_step} scenarios × "
            f"{t.group_size} rollouts on {n_scenarios} training scenarios; policy `{cfg.policy.model}`, "
            f"simulator `{cfg.simulator.backend}`, think mode {'on' if cfg.policy.think else 'off'}")


def policy_statement(cfg: RunConfig, run_dir: Path, label: str) -> str:
    """Markdown naming the policy notebook 04 benchmarks: the model, the LoRA adapter
    (``policy.adapter``; relative to the run folder when it lies inside it, so a report
    names no machine's folders) and the label of ``eval/<label>/``."""
    adapter, run = cfg.policy.adapter, run_dir.resolve()
    if not adapter:
        named = ""
    elif Path(adapter).resolve().is_relative_to(run):
        named = f" + LoRA adapter `{Path(adapter).resolve().relative_to(run)}` (this run's)"
    else:
        named = f" + LoRA adapter `{adapter}`"
    return f"**Policy** `{cfg.policy.model}`{named} · label `{label}`"


#: The per-step counts of what was cut to fit (``train/metrics.jsonl``), with their words.
CUT_METRICS = {
    "reply_cut_rate": "policy replies that hit `policy.max_new_tokens`",
    "context_limit_rate": "dialogues ended by the policy's context budget",
    "user_history_shortened_rate": "simulator turns whose prompt was shortened to fit its context",
}


def cut_statement(metrics: Any) -> str:
    """Markdown under notebook 03's metrics: for each of :data:`CUT_METRICS` present in
    ``metrics`` (the ``train/metrics.jsonl`` DataFrame, one row per step), its lowest and
    highest share over the steps, in per cent; ``""`` when none is (runs from before
    these counts)."""
    parts = []
    for column, words in CUT_METRICS.items():
        if column in metrics and metrics[column].notna().any():
            low, high = 100 * metrics[column].min(), 100 * metrics[column].max()
            share = f"{low:.0f} %" if round(low) == round(high) else f"{low:.0f}-{high:.0f} %"
            parts.append(f"{words}: {share} a step")
    text = "; ".join(parts)
    return f"**What was cut to fit.** {text[0].upper()}{text[1:]}." if parts else ""


def judge_statement(judge: Judge, ev: EvaluationConfig) -> str:
    """Markdown naming the benchmark's ``judge`` (:attr:`Judge.name`) and the protocol of
    ``ev`` (an ``evaluation`` section), as notebook 04 states them after its benchmark."""
    name = judge.name
    rule = ("every policy reply appraised" if ev.protocol == "full"
            else f"{ev.max_turns} policy replies, the first {ev.max_turns - 1} appraised (SAGE's turn rule)")
    return (f"**Benchmark judge.** {name[0].upper() + name[1:]}, the same for baseline and trained policy "
            f"and independent of the training simulator. Protocol `{ev.protocol}`: start emotion "
            f"{ev.initial_emotion}, {rule}, {ev.repeats} dialogue(s) per scenario.")


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


def describe_paired(paired: PairedComparison) -> str:
    """One sentence on a paired comparison (emotion points): the difference with its
    interval and p-values (the sign-flip one named exact or Monte Carlo as computed),
    the pairs used and dropped, and, when pairs errored, the difference with the
    errored pairs at both bounds (:data:`rlver_lib.evaluation.paired.ERROR_BOUND_RULE`).  The interval and
    p-value are flagged as not evidence below :data:`rlver_lib.stats.MIN_N` scenarios."""
    d = paired.difference
    method = f" ({d.p_method})" if getattr(d, "p_method", "") else ""
    counts = {"n_dropped": paired.n_dropped, "n_dropped_error": paired.n_dropped_error,
              "n_dropped_missing": paired.n_dropped_missing}
    text = (f"trained minus baseline: {d.mean_diff:+.1f} emotion points over {d.n_scenarios} scenario(s) "
            f"({paired.n_pairs} pairs; {dropped_text(counts)}), {100 * d.confidence:.0f}% CI "
            f"[{d.ci_low:+.1f}, {d.ci_high:+.1f}], sign-flip p = {d.p_value:.3g}{method}, "
            f"sign test p = {d.sign_test_p:.3g}; {d.n_positive} scenario(s) up, {d.n_negative} down, {d.n_zero} equal")
    if d.n_scenarios < MIN_N:
        text += f" (n = {d.n_scenarios} < {MIN_N}: not evidence either way)"
    if paired.errors_low is not None and paired.errors_high is not None:
        lo, hi = paired.errors_low, paired.errors_high
        text += (f"; with the {paired.n_dropped_error} errored pair(s) at the bounds (errored trained dialogues at 0 "
                 f"and baseline ones at 100, then the reverse) it lies between {lo.mean_diff:+.1f} "
                 f"[{lo.ci_low:+.1f}, {lo.ci_high:+.1f}] (p = {lo.p_value:.3g}) and {hi.mean_diff:+.1f} "
                 f"[{hi.ci_low:+.1f}, {hi.ci_high:+.1f}] (p = {hi.p_value:.3g})")
    return text


def describe_length(summary: dict[str, float] | None) -> str:
    """Markdown reading of :func:`length_controlled_gain`'s summary."""
    if not summary:
        return "The length-controlled comparison needs appraised baseline and trained benchmark turns."
    raw, within = summary["raw_gain"], summary["within_bin_gain"]
    return (f"Trained minus baseline mean emotion change per turn: {raw:+.2f} points overall, {within:+.2f} "
            "within reply-length bins. A within-bin gain close to the overall one means the gain is not "
            "explained by longer replies; one near zero means it is.")


def describe_reliability(report: Any) -> str:
    """Markdown: how far the strategy annotator can be trusted, from its measured agreement
    in ``report``, a :class:`rlver_lib.analysis.stage.StrategyReport` (read by attribute:
    this layer imports no analysis module, which would add a floor; docs/ARCHITECTURE.md)."""
    lines = []
    if report.validation is not None:
        t = report.validation["table"].set_index(["reference", "field"])
        kappa = t.loc[("p1", "primary"), "kappa"]
        agree = t.loc[("p1", "primary"), "agreement"]
        kappa_b = t.loc[("b1", "primary"), "kappa"] if ("b1", "primary") in t.index else np.nan
        strength = ("no better than chance" if not np.isfinite(kappa) or kappa < 0.2 else
                    "weak" if kappa < 0.4 else "moderate" if kappa < 0.6 else "substantial")
        lines.append(f"**Annotator reliability.** The strategy annotator ({report.annotator}) gives the labelled set's "
                     f"primary label on {agree:.0%} of {report.validation['n']} real policy replies "
                     f"(Cohen's κ {kappa:.2f} against annotator A: {strength}; κ {kappa_b:.2f} against "
                     f"annotator B; {report.validation['n_unparsed']} unparsed). "
                     + ("Treat its strategy mix as indicative only; configure a stronger annotator "
                        "(`analysis.annotator`) for research use." if not np.isfinite(kappa) or kappa < 0.6 else ""))
    if report.self_agreement is not None:
        primary = report.self_agreement.set_index("field").loc["primary"]
        lines.append(f"Across {int(primary['pairs'])} seed pair(s) it repeats its own primary label on "
                     f"{primary['agreement']:.0%} of {int(primary['n'])} replies.")
    ls = report.labelled_set.set_index("field").loc["primary"]
    line = (f"The labelled set's two independent passes (two LLM annotators, not people; see "
            f"`strategy_labels_README.md`) agree with κ {ls['kappa']:.2f} on the primary label")
    if report.labelled_set_consistency is not None:
        own = report.labelled_set_consistency.set_index("field").loc["primary"]
        line += f" (annotator A against its own second pass, a consistency check: κ {own['kappa']:.2f})"
    lines.append(line + ".")
    return " ".join(lines)


def describe_comparison(cmp: RetentionComparison, what: str) -> str:
    """One Markdown sentence stating the paired result and what its sample can detect."""
    d = cmp.difference
    pct = lambda v: f"{100 * v:+.1f}"  # noqa: E731
    return (f"{what}: base {100 * cmp.base:.1f} %, trained {100 * cmp.trained:.1f} %, "
            f"paired difference {pct(d.mean_diff)} points [{pct(d.ci_low)}, {pct(d.ci_high)}] "
            f"({100 * d.confidence:.0f} % bootstrap CI over {cmp.n} items; trained better on "
            f"{d.n_positive}, worse on {d.n_negative}; exact McNemar p = {d.sign_test_p:.2f}). "
            f"With {cmp.n} items only a change of about {100 * cmp.detectable:.0f} points or more "
            "would be detected (80 % power, 5 % level); smaller losses or gains cannot be told from zero.")
