"""The evaluation (RLVER §4.1): the Sentient benchmark and its judge, paired
comparisons, SAGE scoring, judge agreement and capability retention."""
