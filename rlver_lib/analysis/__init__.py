"""Analysis of runs (RLVER §5): tables, strategies, reward hacking, ablation cells."""
