"""A Tinker-compatible service: the official `tinker` SDK (0.38) drives distflow's models unchanged.

    wire.py        the SDK's protobuf / JSON shapes          losses.py    its named losses (distflow's own)
    state.py       what a server holds                       primitives.py  create_model, forward_backward, optim_step
    checkpoints.py save_state / load_state / sampler weights sampling.py  sampling sessions, sample
    futures.py     the one worker thread, request futures    server.py    HTTP, auth, size limits, error shapes
    command.py     `distflow serve tinker CONFIG`

docs/features/tinker.md is the user's page.
"""
