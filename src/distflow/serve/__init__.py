"""Serving distflow's models over other frameworks' APIs: `distflow serve tinker CONFIG`.

    tinker/  a Tinker-compatible service (Thinking Machines' `tinker` SDK talks to it unchanged):
             wire.py (the SDK's protobuf and JSON shapes), losses.py (its named losses, through
             distflow's own loss functions), primitives.py (each request as a function of the
             served state), sampling.py, server.py (HTTP, auth, futures), command.py (the CLI's)

The package sits on the top floor (beside the CLI): it builds models the way `distflow train` does
and serves them from one process.
"""
