"""The `auto` engine, `rollout.engine`'s default: `graphed` where a CUDA graph pays, `compact` elsewhere.

    a rollout ──▶ on CUDA, a model without sliding-window layers (ddp or fsdp2) ──▶ graphed
              └─▶ otherwise (a CPU; sliding-window attention) ──────────────────▶ compact

On a GPU a small model's decode step is set by its ~2,300 kernel launches, not by their work, and
`graphed` replays the step as one CUDA graph; on one H200 at the SmolLM2 recipe's shape its
rollouts ran 3.5x `compact`'s tokens/s and its training made 4.1x TRL's completions/s
(docs/features/gpu.md). On a CPU there is no graph to replay and `compact` drops ended rows, so it
is the faster there. Both draw the same samples (each row's keyed draws), so the choice changes
speed, not the run's metrics beyond rounding. A model whose decode step cannot be captured (its
forward reads a device value on the host: data-dependent routing, for one) rolls out with
`compact` from then on, said in one line.
"""

from __future__ import annotations

import weakref

from distflow.console import say
from distflow.rollout.compact import CompactEngine
from distflow.rollout.engine import Request, RolloutEngine


class AutoEngine(RolloutEngine):
    name = "auto"
    continues = True
    records_routing = True  # a rollout that records its routing runs on `compact`

    def __init__(self) -> None:
        from distflow.rollout.graphed import GraphedEngine  # torch: built on a rank, not where configs load

        self.compact, self.graphed, self.graphs = CompactEngine(), GraphedEngine(), True
        self._sliding: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's, looked up once

    def engine_for(self, model) -> RolloutEngine:
        """The engine this model's rollouts take: `graphed` on CUDA, `compact` elsewhere."""
        from distflow.rollout.graphed import sliding

        if not self.graphs or next(model.parameters()).device.type != "cuda":
            return self.compact
        if model not in self._sliding:
            self._sliding[model] = sliding(model)
        return self.compact if self._sliding[model] else self.graphed

    def responses(self, model, request: Request):
        from distflow.rollout.graphed import CaptureFailed

        engine = self.engine_for(model) if request.routing is None else self.compact
        try:
            out = engine.responses(model, request)
        except CaptureFailed as failed:  # said once; the keyed draws make compact's samples the same ones
            self.graphs = False
            self.graphed.close()  # its decoder, whose capture failed, goes
            say(
                "distflow: rollout.engine=auto: this model's decode step could not be captured as a CUDA graph "
                f"({failed.reason}); rolling out with compact"
            )
            engine = self.compact
            out = engine.responses(model, request)
        stats = engine.last_stats()  # what the engine that rolled out counted, as this engine's own
        if stats is not None:
            self.record_stats(stats)
        return out

    def counts(self) -> dict[str, float]:
        """`graphed`'s (`compact` counts nothing)."""
        return self.graphed.counts()

    def close(self) -> None:
        self.graphed.close()
