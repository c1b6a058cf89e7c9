"""Do the simulator model's deep hidden states read a reply better than its length?
The first-turn test of the learned appraiser (docs/MEASURED.md, "The learned appraiser
against SAGE's judge") with last-layer features instead of layer-0 embeddings.

    python benchmarks/appraiser_hidden_states.py [--data DIR] [--boot 1000] [--json OUT]

Every first reply of SAGE's stored runs (a profile's replies share the opening line and
emotion 40, so only the reply differs) is read by the embedded simulator GGUF in
``llama-server --embeddings --pooling none`` as ``回复者：<reply>`` plus a question
about the listener's mood; the features are the last layer's state at the last token
(``last``) and its mean over all tokens (``mean``), 1,536 numbers each.  A head
(PCA to ``k`` components plus the reply-blind covariates, a multinomial logistic model
over SAGE's changes as in rlver_lib/appraiser.py) is fitted on one half of the persona
cards and scores the other (one head for all models' replies to a profile, which the
within-profile test needs).  Each head is compared with its twin on the covariates
alone (on the first turn: the reply's length) by the paired within-profile Spearman,
resampled by profile.  Features are cached under outputs/ (never in git).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from appraiser_fit import folds, held_out  # noqa: E402

from rlver_lib.appraiser import SIMULATOR_FILENAME, covariates, predicted_change, sage_classes  # noqa: E402
from rlver_lib.evaluation.agreement import load_replay  # noqa: E402
from rlver_lib.evaluation.reply_blind import first_turn_spearman  # noqa: E402
from rlver_lib.files import atomic_write_json, cache_dir  # noqa: E402
from rlver_lib.stats import cluster_bootstrap  # noqa: E402

#: The text each reply is read in (the reply's last 900 characters).
PROMPT = "回复者：{reply}\n倾诉者读完这条回复后，情绪变好还是变坏？答："
POOLS = ("last", "mean")
COMPONENTS = (1, 2, 4, 8, 16)


def hidden_states(texts: list[str]) -> dict[str, np.ndarray]:
    """Last-layer states of ``texts`` from llama-server's ``/embedding`` (pooling none):
    ``last`` and ``mean`` (n, d), the token counts and the seconds."""
    import requests

    from rlver_lib.servers import LlamaServerBackend

    server = LlamaServerBackend(cache_dir() / SIMULATOR_FILENAME, n_ctx=2048, parallel=1, threads=2,
                                extra_args=["--embeddings", "--pooling", "none",
                                            "--ubatch-size", "1024", "--batch-size", "1024"])
    out: dict[str, list] = {"last": [], "mean": [], "tokens": []}
    start = time.perf_counter()
    with server:
        for i, text in enumerate(texts):
            answer = requests.post(f"http://127.0.0.1:{server.port}/embedding", json={"content": text}, timeout=600)
            states = np.asarray(answer.json()[0]["embedding"], dtype=np.float32)
            out["last"].append(states[-1])
            out["mean"].append(states.mean(axis=0))
            out["tokens"].append(len(states))
            if i % 50 == 0:
                print(f"features: {i}/{len(texts)} replies, {time.perf_counter() - start:.0f} s", flush=True)
    return {**{k: np.array(v) for k, v in out.items()}, "seconds": np.array(time.perf_counter() - start)}


def head(features: np.ndarray | None, cov: np.ndarray, y: np.ndarray, k: int):
    """(fit, predict) for :func:`appraiser_fit.held_out` on row indices: PCA(k) of
    ``features`` (none when ``k`` is 0) beside ``cov``, standardised, then a logistic
    model over SAGE's classes; the change is
    :func:`rlver_lib.appraiser.predicted_change`."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    labels = sage_classes(y)

    def inputs(pca, idx):
        return np.hstack([pca.transform(features[idx]), cov[idx]]) if pca else cov[idx]

    def fit(tx, _ty):
        idx = tx[:, 0].astype(int)
        pca = PCA(n_components=k, random_state=0).fit(features[idx]) if k else None
        z = inputs(pca, idx)
        mean, sd = z.mean(axis=0), z.std(axis=0) + 1e-9
        return pca, mean, sd, LogisticRegression(C=0.1, max_iter=5000).fit((z - mean) / sd, labels[idx])

    def predict(model, tx):
        pca, mean, sd, logistic = model
        p = logistic.predict_proba((inputs(pca, tx[:, 0].astype(int)) - mean) / sd)
        return predicted_change(p, logistic.classes_)

    return fit, predict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="../shared/data/sage_results", help="folder of SAGE *_result.jsonl")
    ap.add_argument("--json", default="outputs/appraiser_hidden_states.json")
    ap.add_argument("--boot", type=int, default=1000)
    args = ap.parse_args()
    paths = sorted(Path(args.data).glob("*_result.jsonl"))
    every, scenarios = load_replay(paths)
    turns = [t for t in every if t.turn == 0]
    y = np.array([t.recorded_change for t in turns], dtype=float)
    texts = [PROMPT.format(reply=t.history[-1]["content"][-900:]) for t in turns]
    key = hashlib.sha256(("\n".join(texts) + SIMULATOR_FILENAME).encode()).hexdigest()[:12]
    cache = Path("outputs") / f"appraiser-hidden-first-{key}.npz"
    if not cache.is_file():
        cache.parent.mkdir(exist_ok=True)
        np.savez(cache, **hidden_states(texts))
    saved = np.load(cache)
    per_reply = float(saved["seconds"]) / len(turns)
    print(f"{len(turns)} first replies, {int(saved['tokens'].sum())} tokens, {per_reply:.2f} s a reply")

    cov = covariates(turns, every)
    cov[:, 3] = np.log1p(cov[:, 3])
    files, halves = folds(turns, scenarios)
    rows = np.arange(len(turns))[:, None]
    profiles = [t.record_id for t in turns]

    def scored(features, k):
        return held_out(rows, y, files, halves, *head(features, cov, y, k), by_model=False)

    def within(pred):
        return lambda i: first_turn_spearman(pred[i], y[i], [profiles[j] for j in i])

    twin = scored(None, 0)
    boot = dict(n_boot=args.boot, seed=0)
    est = cluster_bootstrap(within(twin), len(y), profiles, **boot)
    result = {"n_replies": len(turns), "seconds_per_reply": per_reply,
              "twin": {"value": est.value, "ci": [est.low, est.high]}, "heads": []}
    print(f"twin (reply length): within-profile Spearman {est.value:.3f} [{est.low:.3f}, {est.high:.3f}]")
    for pool in POOLS:
        for k in COMPONENTS:
            pred = scored(saved[pool], k)
            alone = cluster_bootstrap(within(pred), len(y), profiles, **boot)
            gain = cluster_bootstrap(lambda i, p=pred: within(p)(i) - within(twin)(i), len(y), profiles, **boot)
            result["heads"].append({"pool": pool, "k": k, "value": alone.value, "ci": [alone.low, alone.high],
                                    "minus_twin": gain.value, "minus_twin_ci": [gain.low, gain.high]})
            print(f"{pool:4s} k={k:2d}: {alone.value:.3f} [{alone.low:.3f}, {alone.high:.3f}], minus the twin "
                  f"{gain.value:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}]", flush=True)
    Path(args.json).parent.mkdir(exist_ok=True)
    atomic_write_json(Path(args.json), result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
