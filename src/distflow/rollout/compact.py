"""The `compact` engine: each prompt prefilled once for its n samples, finished rows dropped
(rollout/decoding.py); the same samples as `generate`, token for token.

With `slots` (`rollout.compact: {slots: S}`) it decodes through a fixed set of S rows instead
(rollout/slots.py): a row whose sample ends takes the next waiting sample, so the batch stays full
while samples remain; with `draft_tokens` as well, each row verifies draft tokens taken from its
group's siblings in the same forward. The samples are the same either way (keyed draws)."""

from __future__ import annotations

from dataclasses import dataclass

from distflow.config.errors import check
from distflow.rollout.engine import Request, RolloutEngine


@dataclass(kw_only=True)
class CompactOptions:
    slots: int = 0
    """Rows decoding at once (continuous batching inside a rollout): a row whose sample ends takes the next
    waiting sample of the rollout, prefilled with its prompt; 0: every sample starts at once and an ended
    row leaves the batch (no refill)."""
    draft_tokens: int | None = None
    """With `slots`: draft tokens each row verifies per forward, proposed by matching its last tokens
    against its group's other samples (grouped speculation); a draft token is kept only where it is the
    token the row's keyed draw yields there, so the samples are plain decoding's. 0: none. None (the
    default): `AUTO_DRAFT_TOKENS` with slots where the rollout samples at a temperature of at most
    `AUTO_DRAFT_TEMPERATURE` (greedy included), where it was measured to pay, and none elsewhere
    (docs/features/long-tail.md#where-speculation-pays)."""
    batch_invariant: bool = False
    """Decode with batch-invariant kernels (rollout/invariant.py): linear layers over fixed blocks of
    `invariant_rows` rows and attention reduced in fixed chunks, so a row's logits have the same bits
    whatever its batch-mates. With it, slots, speculation and any number of ranks draw `compact`'s
    samples to the bit on real models too; without it, only to the rounding of the kernels (a draw
    whose uniform lies within that rounding of a bin edge can flip). Costs the padding and the smaller
    products (about 2x at 16 rows on a CPU)."""
    invariant_rows: int = 64
    """With `batch_invariant`: the rows of every linear layer's product (a forward of fewer rows is
    zero-padded to it). Any fixed value gives invariance; smaller pads less in the tail, larger runs
    the prefill in fewer products."""

    def __post_init__(self) -> None:
        check(self.invariant_rows >= 1, f"rollout.compact.invariant_rows must be >= 1 (got {self.invariant_rows})")
        check(self.slots >= 0, f"rollout.compact.slots must be >= 0 (got {self.slots})")
        check(
            self.draft_tokens is None or self.draft_tokens >= 0,
            f"rollout.compact.draft_tokens must be >= 0 (got {self.draft_tokens})",
        )
        check(
            not self.draft_tokens or self.slots > 0,
            "rollout.compact.draft_tokens needs rollout.compact.slots > 0 (speculation runs in the slotted decoder)",
        )

    def drafts_at(self, temperature: float) -> int:
        """The draft tokens a row verifies in a rollout sampled at `temperature` (0: greedy).

        >>> [CompactOptions(slots=8).drafts_at(t) for t in (0.0, 0.5, 0.7, 1.0)]
        [4, 4, 0, 0]
        >>> CompactOptions(slots=8, draft_tokens=2).drafts_at(1.0), CompactOptions().drafts_at(0.2)
        (2, 0)
        """
        if self.draft_tokens is not None:
            return self.draft_tokens
        return AUTO_DRAFT_TOKENS if self.slots > 0 and temperature <= AUTO_DRAFT_TEMPERATURE else 0


AUTO_DRAFT_TOKENS = 4
AUTO_DRAFT_TEMPERATURE = 0.5
"""`draft_tokens`' default: on SmolLM2's chain_sum (CPU) 4 drafts took slots 1.23x past `compact` at T = 0.5 and
1.52x at 0.2, but 0.87x at T = 1, where a group's samples rarely repeat one another."""


class CompactEngine(RolloutEngine):
    name = "compact"
    continues = True
    keeps_cache = True  # with slots (config/rules.py refuses rollout.partial_cache=keep without them)
    records_routing = True  # without slots (config/rules.py refuses them together)
    Config = CompactOptions
    settings: CompactOptions = CompactOptions()
    """The defaults until `build` (or the constructor) sets this rank's: a subclass that overrides
    `__init__` without calling it still decodes as plain `compact`."""

    def __init__(self, options: CompactOptions | None = None) -> None:
        if options is not None:
            self.settings = options

    @classmethod
    def build(cls, config, options: CompactOptions | None) -> CompactEngine:
        engine = cls()  # the engine door's contract: a subclass is built without arguments
        if options is not None:
            engine.settings = options
        return engine

    @property
    def history(self):
        """Each prompt's latest completions (rollout/drafts.py): the drafts and the order of entry."""
        from distflow.rollout.drafts import DraftHistory

        history = self.__dict__.get("_history")
        if history is None:
            history = self.__dict__["_history"] = DraftHistory()
        return history

    def responses(self, model, request: Request):
        if not self.settings.batch_invariant:
            return self._responses(model, request)
        from distflow.rollout.invariant import BatchInvariant

        with BatchInvariant(self.settings.invariant_rows):
            return self._responses(model, request)

    def _responses(self, model, request: Request):
        if self.settings.slots > 0 and request.routing is not None:
            from distflow.config.errors import ConfigError

            raise ConfigError("rollout.routing_replay records routing without rollout.compact.slots: set slots=0")
        if request.caches is not None and self.settings.slots == 0:
            from distflow.config.errors import ConfigError

            raise ConfigError(
                "rollout.partial_cache=keep keeps caches in the slotted decoder: set rollout.compact.slots"
            )
        if self.settings.slots > 0:
            from distflow.rollout.slots import decode_in_slots

            out, stats = decode_in_slots(
                model,
                request,
                self.settings.slots,
                self.settings.drafts_at(0.0 if request.keys_B is None else request.temperature),
                self.history,
            )
            self.record_stats(stats)
            return out if request.logprobs else (out, None)
        from distflow.rollout.decoding import Tally

        tally = Tally()
        out = _decode(model, request, tally)
        self.record_stats(tally.stats())
        return out


def _decode(model, request: Request, tally=None):
    import contextlib

    from distflow.rollout.decoding import decode

    with request.routing.hooked() if request.routing is not None else contextlib.nullcontext():
        out = decode(
            model,
            request.prompt_ids_GP,
            request.prompt_mask_GP,
            samples_per_prompt=request.n,
            max_new_tokens=request.max_new_tokens,
            stop_ids=request.stop_ids,
            pad_id=request.pad_id,
            temperature=request.temperature,
            top_p=request.top_p,
            keys_B=request.keys_B,
            offsets_B=request.offsets_B,
            logprobs=request.logprobs,
            tally=tally,
            routing=request.routing,
        )
    return out if request.logprobs else (out, None)
