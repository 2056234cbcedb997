"""Rollout engines: how a rank samples completions for its prompts (`rollout.engine`).

Each engine is a component (config/components.py) in a file of its own: `compact`, `compiled`,
`generate` and `vllm` are built in; a user's own is `rollout.engine: 'package.module:Class'`.
"""
