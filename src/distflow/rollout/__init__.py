"""Rollout engines: how a rank samples completions for its prompts (`rollout.engine`).

Each engine is a component (config/components.py) in a file of its own: `compact`, `compiled`,
`generate` and `vllm` (a package: the component, its engine, weight loader, queues and logs) are
built in; a user's own is `rollout.engine: 'package.module:Class'`. Around them: keyed sampling
(sampling), the compact decoder (decoding), what is common to every engine (generation), the
multi-turn loop (multiturn) and the held-out evaluation (evaluation).
"""
