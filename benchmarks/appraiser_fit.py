"""Fit the learned appraiser (rlver_lib/appraiser.py) on SAGE's stored judgements and
score it on held-out folds, beside a character-n-gram ridge and the reply-blind
baselines; writes the appraiser file and a JSON of the figures (docs/MEASURED.md).

    python benchmarks/appraiser_fit.py --out rlver_lib/appraiser.json [--data DIR]

Folds: 3 files (policy models) x 2 halves of the persona cards; a fold's turns are
scored by a head fitted on the *other* files' turns of the *other* persona half, so
test turns come from an unseen model and unseen personas.  Features are cached under
outputs/ (never in git).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import numpy as np

from rlver_lib.appraiser import RECIPE, Embedder, fit_head, save_appraiser, stamp, turn_features
from rlver_lib.evaluation.agreement import load_replay
from rlver_lib.evaluation.agreement_stats import agreement_metrics, first_turn_block, partial_block
from rlver_lib.evaluation.reply_blind import crossfit_reply_blind, file_of, reply_blind_predictors
from rlver_lib.files import atomic_write_json


def folds(turns, scenarios):
    """(fold id per turn, persona half per turn): fold = file x persona half."""
    personas = sorted({scenarios[t.dialogue].persona for t in turns})
    order = np.random.default_rng(0).permutation(len(personas))
    half = {personas[i]: int(rank % 2) for rank, i in enumerate(order)}
    halves = np.array([half[scenarios[t.dialogue].persona] for t in turns])
    files = np.array([file_of(t) for t in turns])
    return files, halves


def held_out(x, y, files, halves, fit, predict):
    out = np.full(y.size, np.nan)
    for f in np.unique(files):
        for h in (0, 1):
            test = (files == f) & (halves == h)
            train = (files != f) & (halves != h)
            out[test] = predict(fit(x[train], y[train]), x[test])
    return out


def ngram_predictions(turns, y, files, halves):
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import RidgeCV

    texts = np.array([t.history[-1]["content"] for t in turns], dtype=object)

    def fit(tx, ty):
        vec = TfidfVectorizer(analyzer="char", ngram_range=(1, 2), min_df=2, sublinear_tf=True)
        return vec, RidgeCV(alphas=np.logspace(-1, 3, 9)).fit(vec.fit_transform(tx), ty)

    return held_out(texts, y, files, halves, fit, lambda m, tx: np.clip(m[1].predict(m[0].transform(tx)), -10, 10))


def row(name, pred, y, turns, boosted, clusters, boot):
    m = agreement_metrics(y, pred, clusters, **boot)
    before = np.array([t.emotion_before for t in turns], dtype=float)
    first = first_turn_block(pred, y, turns, **boot)
    return {"name": name, **{k: m[k] for k in ("spearman", "spearman_ci", "sign_agreement", "sign_agreement_ci",
                                                 "mae", "mae_ci")},
            "partial_given_emotion": partial_block(pred, y, before, clusters, **boot),
            "partial_given_boosted": partial_block(pred, y, boosted, clusters, **boot),
            "first_turn": first, "share_negative": m["share_negative"]["judge"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/sage_results", help="folder of SAGE *_result.jsonl")
    ap.add_argument("--out", default="rlver_lib/appraiser.json")
    ap.add_argument("--json", default="outputs/appraiser_fit.json")
    ap.add_argument("--boot", type=int, default=1000)
    args = ap.parse_args()
    paths = sorted(Path(args.data).glob("*_result.jsonl"))
    turns, scenarios = load_replay(paths)
    y = np.array([t.recorded_change for t in turns], dtype=float)
    shas = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    data_key = hashlib.sha256(str(sorted(shas.items())).encode()).hexdigest()[:12]
    cache = Path("outputs") / f"appraiser-features-{stamp()[:12]}-{data_key}.npz"
    if cache.is_file():
        saved = np.load(cache)
        x, cuts, seconds = saved["x"], int(saved["cuts"]), float(saved["seconds"])
    else:
        start = time.perf_counter()
        embedder = Embedder()
        loaded = time.perf_counter()
        x, cuts = turn_features(embedder, turns, scenarios)
        seconds = (time.perf_counter() - loaded) / len(turns)
        print(f"features: {len(turns)} turns, load {loaded - start:.0f} s, {seconds:.4f} s per reply, {cuts} cut")
        cache.parent.mkdir(exist_ok=True)
        np.savez(cache, x=x, cuts=cuts, seconds=seconds)
    files, halves = folds(turns, scenarios)
    learned = held_out(x, y, files, halves, fit_head, lambda h, tx: h.predict(tx))
    ngram = ngram_predictions(turns, y, files, halves)
    boosted = crossfit_reply_blind(turns, turns)
    clusters = [t.dialogue for t in turns]
    boot = dict(n_boot=args.boot, seed=0)
    fixed = reply_blind_predictors(turns)
    rows = [row("learned appraiser", learned, y, turns, boosted, clusters, boot),
            row("char-n-gram ridge (baseline)", ngram, y, turns, boosted, clusters, boot),
            row("reply-blind: gradient-boosted", boosted, y, turns, boosted, clusters, boot),
            row("reply-blind: +-5 threshold rule", fixed["threshold_rule"], y, turns, boosted, clusters, boot)]
    fold_scores = {}
    for f in np.unique(files):
        for h in (0, 1):
            idx = np.flatnonzero((files == f) & (halves == h))
            from scipy.stats import spearmanr
            fold_scores[f"{f}|personas-{h}"] = {"n_turns": int(idx.size),
                                                "spearman": float(spearmanr(learned[idx], y[idx]).statistic),
                                                "mae": float(np.mean(np.abs(learned[idx] - y[idx])))}
    head = fit_head(x, y)
    save_appraiser(Path(args.out), head, {"data_sha256": shas, "n_turns": len(turns), "fold_scores": fold_scores})
    result = {"recipe": RECIPE, "n_turns": len(turns), "n_dialogues": len(set(clusters)), "texts_cut": cuts,
              "seconds_per_reply_features": seconds, "rows": rows, "fold_scores": fold_scores}
    Path(args.json).parent.mkdir(exist_ok=True)
    atomic_write_json(Path(args.json), result)
    for r in rows:
        ft = r["first_turn"]
        print(f"{r['name']:34s} rho {r['spearman']:.2f} {r['spearman_ci']}, sign {r['sign_agreement']:.2f}, "
              f"MAE {r['mae']:.2f}, partial|emotion {r['partial_given_emotion']}, partial|boosted "
              f"{r['partial_given_boosted']}, first-turn {ft and ft['judge']} (length {ft and ft['reply_length']}),"
              f" negative {r['share_negative']:.2f}")
    print(f"written: {args.out}, {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
