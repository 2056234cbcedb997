"""Scoring completions: plain Python reward functions, weighted and contained (reward), and reward
models (reward_models)."""
