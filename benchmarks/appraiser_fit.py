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
from scipy.stats import spearmanr

from rlver_lib.appraiser import (
    BLIND_INPUTS,
    FEATURE_RECIPE,
    RECIPE,
    Embedder,
    fit_head,
    save_appraiser,
    stamp,
    turn_features,
)
from rlver_lib.evaluation.agreement import load_replay
from rlver_lib.evaluation.agreement_stats import agreement_metrics, first_turn_block, partial_block
from rlver_lib.evaluation.reply_blind import crossfit_reply_blind, file_of, reply_blind_predictors
from rlver_lib.files import atomic_write_json
from rlver_lib.stats import cluster_bootstrap


def folds(turns, scenarios):
    """(fold id per turn, persona half per turn): fold = file x persona half."""
    personas = sorted({scenarios[t.dialogue].persona for t in turns})
    order = np.random.default_rng(0).permutation(len(personas))
    half = {personas[i]: int(rank % 2) for rank, i in enumerate(order)}
    halves = np.array([half[scenarios[t.dialogue].persona] for t in turns])
    files = np.array([file_of(t) for t in turns])
    return files, halves


def held_out(x, y, files, halves, fit, predict, *, by_model=True):
    """Each turn predicted by a head fitted on the other persona half and (``by_model``)
    the other files only.  Without ``by_model`` one head scores every model's reply to a
    profile, which the first-turn test needs: with model-disjoint folds its within-profile
    ranks would compare three heads' offsets, not replies."""
    out = np.full(y.size, np.nan)
    for f in np.unique(files) if by_model else [None]:
        for h in (0, 1):
            test = (halves == h) & ((files == f) if by_model else True)
            train = (halves != h) & ((files != f) if by_model else True)
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


def row(name, pred, y, turns, boosted, clusters, boot, *, twin=None, persona_folds=None):
    """One table row; ``twin``: the reply-blind twin's predictions (partial given them);
    ``persona_folds``: predictions from persona-only folds (the first-turn test on them)."""
    m = agreement_metrics(y, pred, clusters, **boot)
    before = np.array([t.emotion_before for t in turns], dtype=float)
    first = first_turn_block(pred, y, turns, **boot)
    return {"name": name, **{k: m[k] for k in ("spearman", "spearman_ci", "sign_agreement", "sign_agreement_ci",
                                                 "mae", "mae_ci")},
            "partial_given_emotion": partial_block(pred, y, before, clusters, **boot),
            "partial_given_boosted": partial_block(pred, y, boosted, clusters, **boot),
            "partial_given_twin": None if twin is None else partial_block(pred, y, twin, clusters, **boot),
            "first_turn": first, "share_negative": m["share_negative"]["judge"],
            "first_turn_persona_folds": None if persona_folds is None else first_turn_block(
                persona_folds, y, turns, **boot)}


def over_twin(learned, twin, y, clusters, boot):
    """What reading the texts adds: learned minus its reply-blind twin, in Spearman (up
    is better) and MAE (down is better), each with a bootstrap interval over dialogues."""
    def rho(pred):
        return lambda i: spearmanr(pred[i], y[i]).statistic

    out = {}
    for name, stat in (("spearman", lambda i: rho(learned)(i) - rho(twin)(i)),
                       ("mae", lambda i: np.mean(np.abs(learned[i] - y[i])) - np.mean(np.abs(twin[i] - y[i])))):
        est = cluster_bootstrap(stat, y.size, clusters, **boot)
        out[name] = {"value": est.value, "ci": [est.low, est.high]}
    return out


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
    cache = Path("outputs") / f"appraiser-features-{stamp(FEATURE_RECIPE)[:12]}-{data_key}.npz"
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
    def blind(tx, ty):
        return fit_head(tx, ty, BLIND_INPUTS)

    def predict(h, tx):
        return h.predict(tx)

    learned = held_out(x, y, files, halves, fit_head, predict)
    twin = held_out(x, y, files, halves, blind, predict)
    learned_p = held_out(x, y, files, halves, fit_head, predict, by_model=False)
    twin_p = held_out(x, y, files, halves, blind, predict, by_model=False)
    ngram = ngram_predictions(turns, y, files, halves)
    boosted = crossfit_reply_blind(turns, turns)
    clusters = [t.dialogue for t in turns]
    boot = dict(n_boot=args.boot, seed=0)
    fixed = reply_blind_predictors(turns)
    rows = [row("learned appraiser", learned, y, turns, boosted, clusters, boot, twin=twin, persona_folds=learned_p),
            row("reply-blind twin (same head, covariates only)", twin, y, turns, boosted, clusters, boot,
                persona_folds=twin_p),
            row("char-n-gram ridge (baseline)", ngram, y, turns, boosted, clusters, boot),
            row("reply-blind: gradient-boosted", boosted, y, turns, boosted, clusters, boot),
            row("reply-blind: +-5 threshold rule", fixed["threshold_rule"], y, turns, boosted, clusters, boot)]
    gain = over_twin(learned, twin, y, clusters, boot)
    fold_scores = {}
    for f in np.unique(files):
        for h in (0, 1):
            idx = np.flatnonzero((files == f) & (halves == h))
            fold_scores[f"{f}|personas-{h}"] = {"n_turns": int(idx.size),
                                                "spearman": float(spearmanr(learned[idx], y[idx]).statistic),
                                                "mae": float(np.mean(np.abs(learned[idx] - y[idx])))}
    head = fit_head(x, y)
    save_appraiser(Path(args.out), head, {"data_sha256": shas, "n_turns": len(turns), "fold_scores": fold_scores})
    result = {"recipe": RECIPE, "n_turns": len(turns), "n_dialogues": len(set(clusters)), "texts_cut": cuts,
              "seconds_per_reply_features": seconds, "rows": rows,
              "learned_minus_twin": gain, "fold_scores": fold_scores}
    Path(args.json).parent.mkdir(exist_ok=True)
    atomic_write_json(Path(args.json), result)
    for r in rows:
        ft, fp = r["first_turn"], r["first_turn_persona_folds"]
        print(f"{r['name']:34s} rho {r['spearman']:.2f} {r['spearman_ci']}, sign {r['sign_agreement']:.3f} "
              f"{r['sign_agreement_ci']}, MAE {r['mae']:.2f} {r['mae_ci']}, partial|emotion "
              f"{r['partial_given_emotion']}, partial|boosted {r['partial_given_boosted']}, partial|twin "
              f"{r['partial_given_twin']}, first-turn {ft and ft['judge']} (length {ft and ft['reply_length']}),"
              f" first-turn persona folds {fp and fp['judge']}, negative {r['share_negative']:.2f}")
    print(f"learned minus its reply-blind twin: {gain}")
    print(f"written: {args.out}, {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
