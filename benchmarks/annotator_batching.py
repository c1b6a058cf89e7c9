"""The strategy annotator's wall time: one batch fanned out over the server's slots vs
one call at a time.

Every label is one call of the annotator (the benchmark judge's model unless
``analysis.annotator`` names another) whose system message, the taxonomy with its
definitions and examples, is the same for every reply (about 740 tokens) and whose user
message is the reply (``annotation_conversation``). The analysis stage sends a run's
replies in one batch; llama-server then starts every request in its own slot, and each
slot processes the whole shared system message. Called one at a time, the requests land
in the same slot, which re-reads only the part after the prefix it holds.

Each path starts its own server (no cache carried from one path to the next), labels
the first ``--items`` replies of the shipped labelled set greedily, and is timed:

- ``batched``: :func:`~rlver_lib.analysis.strategies.annotate_strategies` as the stage
  calls it (one batch of up to 16);
- ``serial``: the same with ``batch_size=1``;
- ``primed``: the first reply alone, then the rest in one batch (does llama-server's
  host-memory prompt cache, ``--cache-ram``, hand the first slot's prefix to the others?).

Prints seconds and labels/min of each path, its ratio to ``batched``, and how many
primary labels it shares with ``batched`` (greedy decoding: they differ only by the
server's batched numerics). Figures: docs/MEASURED.md "The annotator's calls". Usage::

    python benchmarks/annotator_batching.py --params params/quickstart.yaml --items 8
"""

from __future__ import annotations

import argparse
import time

from rlver_lib.analysis.strategies import annotate_strategies, annotator_config, load_labelled_set, open_annotator
from rlver_lib.params import load_config

#: each path: its batch size and how many replies go first, alone (0: none)
PATHS = {"batched": (16, 0), "serial": (1, 0), "primed": (16, 1)}


def timed_labels(annotator_cfg, replies: list[str], users: list[str], path: str,
                 seed: int) -> tuple[float, list[str]]:
    """(seconds, primary labels) of ``replies`` sent as ``path`` says (:data:`PATHS`) to a
    server started for this call (its start-up not timed)."""
    batch_size, first = PATHS[path]
    with open_annotator(annotator_cfg, seed) as annotator:
        start = time.perf_counter()
        labels = []
        for part in (slice(0, first), slice(first, None)):
            if replies[part]:
                out = annotate_strategies(annotator, replies[part], user_messages=users[part], seed=seed,
                                          batch_size=batch_size)
                labels += list(out["primary"])
        return time.perf_counter() - start, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params/quickstart.yaml")
    ap.add_argument("--items", type=int, default=8, help="labelled-set replies to label per path")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    annotator_cfg = annotator_config(load_config(args.params))
    labelled = load_labelled_set().head(args.items)
    replies, users = list(labelled["reply"]), list(labelled["user"])
    results = {name: timed_labels(annotator_cfg, replies, users, name, args.seed) for name in PATHS}
    fan, fan_labels = results["batched"]
    for name, (seconds, labels) in results.items():
        same = sum(a == b for a, b in zip(fan_labels, labels))
        print(f"{name:8s}: {seconds:7.1f} s for {len(replies)} labels ({60 * len(replies) / seconds:5.1f} labels/min), "
              f"{seconds / fan:.2f} x batched; primary label as batched's on {same} of {len(replies)}")


if __name__ == "__main__":
    main()
