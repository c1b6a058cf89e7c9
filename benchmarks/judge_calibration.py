"""Calibrate the expected-value appraisal's ``expected_center`` and ``expected_scale`` on SAGE turns.

The checklist appraisal (``simulator.appraisal: expected``) turns a content score ``s``
(the mean P(yes) of its content questions, in [0, 1]) into a change
``scale * (s - center)``. Its two numbers are fitted here on stored SAGE dialogues, by
matching the distribution of SAGE's own changes on the same turns (moment matching):

- ``center``: the quantile of ``s`` at SAGE's share of negative changes, so the
  appraisal is negative as often as SAGE's judge was on these turns;
- ``scale``: SD(SAGE's changes) / SD(s), so its changes spread as SAGE's do.

Neither number changes the order of the changes (Spearman is unaffected); they set
the sign threshold and the size. Fit them on dialogues that the agreement figures do
not use (``--dialogues``/``--seed`` choose a sample of ``FILE ...``), then pass them as
``--set evaluation.judge.expected_center=... --set evaluation.judge.expected_scale=...``.

Prints the fitted numbers, the mean P(yes) per question and the Spearman correlation
of ``s`` with SAGE's change (raw, and partial given the emotion before); ``--json``
writes them with one row per turn. Usage::

    python benchmarks/judge_calibration.py ../shared/data/sage_results/claude3.7_result.jsonl \\
        --dialogues 12 --seed 0 --json outputs/calibration.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from tqdm.auto import tqdm

from rlver_lib.config import JudgeConfig
from rlver_lib.evaluation.agreement import lane_order, load_replay, sample_dialogues
from rlver_lib.files import atomic_write_json
from rlver_lib.models import build_simulator
from rlver_lib.stats import partial_spearman
from rlver_lib.user_prompts import SimulatorRequest


def fit_center_scale(scores: np.ndarray, recorded: np.ndarray) -> tuple[float, float]:
    """``(center, scale)`` by moment matching (see the module notes). ``scores`` and
    ``recorded`` have shape (n,); raises ``ValueError`` for n < 2 or constant scores."""
    if scores.size < 2 or np.std(scores) == 0:
        raise ValueError("need at least two turns with different content scores")
    center = float(np.quantile(scores, np.mean(recorded < 0)))
    return center, float(np.std(recorded) / np.std(scores))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--dialogues", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--answer-order", choices=["yes_no", "no_yes", "both"], default="yes_no")
    parser.add_argument("--questions", default="on_situation,understood,intention",
                        help="content questions asked (comma-separated); each one's P(yes) is reported, and "
                             "the fit is of their mean")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    turns, scenarios = load_replay(args.files)
    turns = sample_dialogues(turns, args.dialogues, args.seed)
    cfg = JudgeConfig(appraisal="expected", concurrency=args.concurrency, n_threads=args.threads, max_retries=1,
                      expected_answer_order=args.answer_order, expected_questions=args.questions.split(","))
    judge = build_simulator(cfg, args.seed)
    rows = []
    start = time.perf_counter()
    try:
        with tqdm(total=len(turns), desc="checklist appraisals", unit="turn") as bar:
            for batch in lane_order(turns, args.concurrency):
                requests = [SimulatorRequest(f"{turns[i].dialogue}@{turns[i].turn}", scenarios[turns[i].dialogue],
                                             [dict(m) for m in turns[i].history], turns[i].emotion_before,
                                             turns[i].turn) for i in batch]
                for i, result in zip(batch, judge.appraise(requests)):
                    t = turns[i]
                    row = {"dialogue": t.dialogue, "turn": t.turn, "emotion_before": t.emotion_before,
                           "recorded": t.recorded_change, "error": result.error,
                           "history_dropped": result.history_dropped}
                    if result.error is None:
                        row |= {"content_score": result.appraisal["content_score"],
                                "guard": result.appraisal["guard"],
                                **{f"p_{q['key']}": q["p_yes"] for q in result.appraisal["checklist"]}}
                    rows.append(row)
                bar.update(len(batch))
    finally:
        judge.backend.close()
    seconds = time.perf_counter() - start
    ok = [r for r in rows if r["error"] is None]
    s = np.array([r["content_score"] for r in ok])
    recorded = np.array([r["recorded"] for r in ok], dtype=float)
    before = np.array([r["emotion_before"] for r in ok], dtype=float)
    center, scale = fit_center_scale(s, recorded)
    keys = [k for k in ok[0] if k.startswith("p_")] if ok else []
    result = {
        "files": args.files, "dialogues": args.dialogues, "seed": args.seed, "answer_order": args.answer_order,
        "n_turns": len(rows), "n_failed": len(rows) - len(ok), "seconds": round(seconds, 1),
        "turns_per_min": round(len(rows) / seconds * 60, 2),
        "center": center, "scale": scale,
        "share_negative_recorded": float(np.mean(recorded < 0)),
        "spearman_score_vs_recorded": float(spearmanr(s, recorded).statistic),
        "partial_spearman_given_emotion_before": partial_spearman(s, recorded, before),
        "mean_p_yes": {k: float(np.mean([r[k] for r in ok])) for k in keys},
        "spearman_by_question": {k: float(spearmanr([r[k] for r in ok], recorded).statistic) for k in keys},
        "turns": rows,
    }
    print(f"{len(ok)} of {len(rows)} turns appraised in {seconds:.0f} s ({result['turns_per_min']} turns/min); "
          f"{result['n_failed']} failed")
    print(f"fitted: expected_center={center:.4f} expected_scale={scale:.2f}")
    print(f"Spearman(s, SAGE change) {result['spearman_score_vs_recorded']:+.3f}; partial given emotion before "
          f"{result['partial_spearman_given_emotion_before']:+.3f}")
    for k in keys:
        print(f"  {k:<16} mean P(yes) {result['mean_p_yes'][k]:.3f}  Spearman {result['spearman_by_question'][k]:+.3f}")
    if args.json:
        atomic_write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
