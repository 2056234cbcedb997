"""Agents that speak OpenAI: an endpoint over the rollout engine, and agent code as a rollout.

    agent code ─ openai client ─► server.AgentServer (aiohttp, 127.0.0.1, bearer token, one session per episode)
                                   │ requests: check + render (requests) ─► batch (batcher) ─► Backend.sample
                                   │ every sampled completion recorded on its session (session.Call)
    runner.run_episodes ◄──────────┘ episode ends: session closed ─► trajectory.assemble ─► samples
    rollout.AgentRollout: the three together, for a rollout stage

The packages it needs (`openai`, `aiohttp`) are the `agents` extra: pip install 'distflow[agents]'.
Nothing here imports them, or torch, until a server starts or an episode runs.
"""
