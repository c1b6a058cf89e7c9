"""Does the learned appraiser (rlver_lib/appraiser.py, fitted on SAGE's Chinese turns)
order English replies? The cases of benchmarks/simulator_discrimination.py (6 personas x
6 reply types, emotion 50, first turn), appraised by ``LearnedAppraisal``; the order
wanted: warm (empathic) > advice > dismissive, and off-topic below warm.

    python benchmarks/appraiser_discrimination.py [--json OUT]

Prints the mean change per reply type, each ordering with its margin (emotion points;
negative = the order fails by that much) and the seconds per reply.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator_discrimination import requests, table  # noqa: E402

from rlver_lib.appraiser import LearnedAppraisal  # noqa: E402
from rlver_lib.files import atomic_write_json  # noqa: E402

#: (higher, lower): the orderings the cases must keep.
ORDER = (("warm", "advice"), ("advice", "dismissive"), ("warm", "off_topic"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = requests()
    appraiser = LearnedAppraisal()
    appraiser([cases[0][1]])  # loads the embeddings
    start = time.perf_counter()
    changes = [a["change"] for a in appraiser([r for _, r in cases])]
    seconds = (time.perf_counter() - start) / len(cases)
    means = table([k for k, _ in cases], changes)
    margins = {f"{a} > {b}": means[a] - means[b] for a, b in ORDER}
    for kind, value in means.items():
        print(f"{kind:12s} {value:+.2f}")
    for name, margin in margins.items():
        print(f"{name}: margin {margin:+.2f} ({'holds' if margin > 0 else 'fails'})")
    print(f"{seconds:.4f} s per reply (after loading), {appraiser.texts_cut} texts cut")
    result = {"means": means, "margins": margins, "seconds_per_reply": seconds, "texts_cut": appraiser.texts_cut}
    if args.json:
        atomic_write_json(Path(args.json), result)
    return result


if __name__ == "__main__":
    main()
