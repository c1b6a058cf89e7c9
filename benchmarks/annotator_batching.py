"""The strategy annotator's wall time by how its server decodes: slots and speculation.

Every label is one call of the annotator (the benchmark judge's model unless
``analysis.annotator`` names another) whose system message, the taxonomy with its
definitions and examples, is the same for every reply (about 740 tokens) and whose user
message is the reply (``annotation_conversation``); the answer is a JSON object of about
130 tokens whose keys and layout repeat from label to label.

Each path starts its own server (no cache carried from one path to the next; its
start-up not timed), labels the first ``--items`` replies of the shipped labelled set
greedily with :func:`~rlver_lib.analysis.strategies.annotate_strategies` as the analysis
stage calls it (one batch of up to 16), and is timed:

- ``8 slots``: ``concurrency: 8``, the judge's, the annotator's setting before: every
  request starts in its own slot, and each slot reads the whole system message;
- ``1 slot``: ``concurrency: 1``: the requests queue for one slot, which re-reads only
  the part after the system message it holds;
- ``1 slot + ngram``: the same with ``speculative: ngram`` (``servers.NGRAM_SPECULATION``),
  the annotator's default.

Prints seconds and labels/min of each path, its ratio to the first, and on how many
replies its primary label equals the first path's (greedy decoding: they differ only by
the server's batched numerics). Figures: docs/MEASURED.md "The annotator's calls". Usage::

    python benchmarks/annotator_batching.py --params params/quickstart.yaml --items 8
"""

from __future__ import annotations

import argparse
import time

from rlver_lib.analysis.strategies import annotate_strategies, annotator_config, load_labelled_set, open_annotator
from rlver_lib.params import load_config

#: each path: the annotator settings it overrides
PATHS = {"8 slots": {"concurrency": 8, "speculative": "none"},
         "1 slot": {"concurrency": 1, "speculative": "none"},
         "1 slot + ngram": {"concurrency": 1, "speculative": "ngram"}}


def timed_labels(annotator_cfg, replies: list[str], users: list[str], seed: int) -> tuple[float, list[str]]:
    """(seconds, primary labels) of ``replies`` labelled by a server started for this call
    with ``annotator_cfg`` (its start-up not timed)."""
    with open_annotator(annotator_cfg, seed) as annotator:
        start = time.perf_counter()
        out = annotate_strategies(annotator, replies, user_messages=users, seed=seed)
        return time.perf_counter() - start, list(out["primary"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/quickstart.yaml")
    ap.add_argument("--items", type=int, default=8, help="labelled-set replies to label per path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    annotator_cfg = annotator_config(load_config(args.params))
    labelled = load_labelled_set().head(args.items)
    replies, users = list(labelled["reply"]), list(labelled["user"])
    results = {name: timed_labels(annotator_cfg.model_copy(update=settings), replies, users, args.seed)
               for name, settings in PATHS.items()}
    first, first_labels = next(iter(results.values()))
    for name, (seconds, labels) in results.items():
        same = sum(a == b for a, b in zip(first_labels, labels))
        rate = 60 * len(replies) / seconds
        print(f"{name:14s}: {seconds:7.1f} s for {len(replies)} labels ({rate:5.1f} labels/min), {seconds / first:.2f} "
              f"x the first; primary label as the first's on {same} of {len(replies)}", flush=True)


if __name__ == "__main__":
    main()
