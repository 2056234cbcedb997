"""distflow: fully distributed RL post-training of LLMs (multi-controller)."""

__version__ = "0.1.0"
