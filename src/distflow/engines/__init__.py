"""Deprecated import paths the docs once gave users; each module re-exports its new home and warns once.

`distflow.engines` was split along the kinds of parts it held: `distflow.training` (the trained models,
their passes and the trained-model registry), `distflow.rollout` (sampling, generation, evaluation, vLLM),
`distflow.scoring` (rewards, reward models) and `distflow.sync` (the disaggregated weight sync).
"""
