"""The `compiled` engine: `compact` over the model's forward compiled by `torch.compile`.

Shapes are dynamic (the batch shrinks as rows finish and the cache grows); the compiled module is
made once per model and shares its parameters, so weight updates and syncs reach it. The first
rollout pays the compile (tens of seconds on a CPU, minutes on a GPU). Not with fsdp2, which
gathers the rollout model from shards for every rollout (`check`)."""

from __future__ import annotations

import weakref

from distflow.config.errors import check
from distflow.rollout.compact import _decode
from distflow.rollout.engine import Request, RolloutEngine


class CompiledEngine(RolloutEngine):
    name = "compiled"

    def __init__(self) -> None:
        self._compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def check(cls, config) -> None:
        check(
            config.parallel.strategy == "ddp",
            "rollout.engine=compiled compiles the rollout model's forward, which fsdp2 gathers from shards "
            "for every rollout; use rollout.engine=compact with parallel.strategy=fsdp2",
        )

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
