"""The `compiled` engine: `compact` over the model's forward compiled by `torch.compile`.

Shapes are dynamic (the batch shrinks as rows finish and the cache grows); the compiled module is
made once per model and shares its parameters, so weight updates and syncs reach it. Under fsdp2
the model it decodes is the gathered model's view (`training.parallelize.unsharded_view`): one view
per model, its parameters taken afresh at each rollout, which the compiled forward reads as inputs,
so a new gather compiles nothing again. The first rollout pays the compile (tens of seconds on a
CPU, minutes on a GPU)."""

from __future__ import annotations

import weakref

from distflow.rollout.compact import _decode
from distflow.rollout.engine import Request, RolloutEngine


class CompiledEngine(RolloutEngine):
    name = "compiled"
    continues = True

    def __init__(self) -> None:
        self._compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def responses(self, model, request: Request):
        return _decode(self.compiled(model), request)

    def compiled(self, model):
        """`model` with its forward compiled, made once per model."""
        if model not in self._compiled:
            import torch
            import torch._inductor.config as inductor_config

            # Compile in this thread: a pool of compile workers would outlive the run (non-daemon threads).
            inductor_config.compile_threads = 1
            self._compiled[model] = torch.compile(model, dynamic=True)
        return self._compiled[model]
