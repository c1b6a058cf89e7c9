"""What notebook 06 calls (rlver_lib.analysis.stage), on a fake run folder
(tests/analysis_support.py) and the rule simulator's config: the figures, the hacking
diagnostics with every figure recomputed here by hand, and the analyses that have
nothing to do."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_support import dialogue_record, make_run

from rlver_lib.analysis.stage import consistency_analysis, hacking_analysis, strategy_figures, sycophancy_analysis
from rlver_lib.analysis.strategies import DIMENSION_KEYS, STRATEGY_KEYS
from rlver_lib.files import RunFolder, write_jsonl
from rlver_lib.params import build_config

# the benchmark dialogues of the fake run: (replies, emotions after each), start emotion 40
EVAL = {"baseline": [(["Ok.", "Fine then."], [38, 35]), (["Hm."], [41])],
        "trained": [(["I hear how hard today was.", "That sounds exhausting, I'm here."], [50, 62]),
                    (["Tell me more about it?"], [47])]}


@pytest.fixture
def run(tmp_path):
    """A run with training steps 1 and 2 (analysis_support.make_run) and the :data:`EVAL`
    benchmark dialogues."""
    run = make_run(tmp_path, "r", "grpo", False, "moderate", 60.0)
    for label, dialogues in EVAL.items():
        write_jsonl(RunFolder(run).eval_dir(label).dialogues,
                    [dialogue_record(f"{label}-{i}", replies, emotions)
                     for i, (replies, emotions) in enumerate(dialogues)])
    return run


def _changes(label):
    """Each policy turn's emotion change of :data:`EVAL`'s ``label`` dialogues, in order."""
    return [after - before for _, emotions in EVAL[label] for before, after in zip([40, *emotions], emotions)]


def test_hacking_analysis_recomputed_by_hand(run):
    out = hacking_analysis(run, n_boot=50, seed=0)
    turns = out["turns"]
    # 3 baseline, 3 trained and 4 training turns (two steps of two one-turn dialogues)
    assert turns["source"].value_counts().to_dict() == {"baseline": 3, "trained": 3, "step 1": 2, "step 2": 2}
    assert turns[turns["source"] == "trained"]["change"].tolist() == _changes("trained")

    # reply length against the change, each centred within its source: Pearson's r by hand
    lengths = {"baseline": [3, 10, 3], "trained": [26, 33, 22], "step 1": [4, 4], "step 2": [4, 4]}
    x, y = [], []
    for source, ls in lengths.items():
        changes = turns[turns["source"] == source]["change"].to_numpy()
        x += list(np.array(ls) - np.mean(ls))
        y += list(changes - changes.mean())
    row = out["statistics"].set_index("feature").loc["reply_length"]
    assert row["r"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert (row["n_turns"], row["n_clusters"]) == (10, 8)

    # trained minus baseline mean change per turn
    gain = np.mean(_changes("trained")) - np.mean(_changes("baseline"))
    assert out["length_summary"]["raw_gain"] == pytest.approx(gain)
    assert out["distinct"].set_index("source")["n_replies"].to_dict() == {"baseline": 3, "trained": 3,
                                                                          "step 1": 2, "step 2": 2}
    folder = RunFolder(run)
    for name in ("distinct", "length_bins"):
        assert folder.analysis_table(name).is_file()
    written = pd.read_csv(folder.analysis_table("hacking_stats"))
    assert written["feature"].tolist() == out["statistics"]["feature"].tolist()


def test_hacking_analysis_without_both_benchmarks_has_no_length_comparison(tmp_path):
    run = make_run(tmp_path, "r", "grpo", False, "moderate", 60.0)  # training dialogues only
    out = hacking_analysis(run, n_boot=20)
    assert out["length"] is None and out["length_summary"] is None
    assert set(out["turns"]["source"]) == {"step 1", "step 2"}


def test_strategy_figures_compare_the_benchmarks_and_follow_the_steps():
    annotations = pd.DataFrame({
        "source": ["baseline", "trained", "step 1", "step 2", "trained"],
        "step": [np.nan, np.nan, 1.0, 2.0, np.nan],
        "primary": ["validation", "advice", "validation", "advice", "unparsed"],
    })
    for key in (*STRATEGY_KEYS, *DIMENSION_KEYS):  # strategy_use reads one column per strategy and dimension
        annotations[key] = (annotations["primary"] == key).astype(int)
    figs = strategy_figures(annotations)
    titles = [f.axes[0].get_title() for f in figs]
    assert len(figs) == 3
    assert titles[0] == "Primary strategy on the benchmark: baseline vs trained"
    assert titles[2] == "Primary strategy over training steps"
    assert strategy_figures(annotations[annotations["source"] == "step 1"]) == []  # one step, no benchmark


def test_consistency_and_sycophancy_have_nothing_to_do_with_a_zero_sample(run):
    cfg = build_config({"simulator": {"backend": "rule"},
                        "analysis": {"n_consistency_turns": 0, "n_sycophancy_replies": 0}})
    assert consistency_analysis(cfg, run) is None
    assert sycophancy_analysis(cfg, run, annotator=None, annotator_cfg=None) is None
