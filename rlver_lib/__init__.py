"""rlver: a research workbench for RLVER (reinforcement learning with verifiable emotion rewards)."""

__version__ = "0.1.0"
