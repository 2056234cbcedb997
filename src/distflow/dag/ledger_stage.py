"""The mismatch ledger's two halves as stage code (rollout/mismatch_ledger.py has the chain and its terms).

    rollout rank   `rollout_ledger`, in the rollout stage with the weights that sampled: columns 0-3 of the
                   chosen samples ──▶ the batch's `mismatch_ledger` field, which travels with its sample
    train rank     `mismatch_ledger` stage, before the policy update, with the weights it trains: columns 4-5
    policy update  the tally adds the trainer's log-prob p and the recorded b: `mismatch/ledger_*`

Nothing here talks to another rank: the field moves with the batch like `rollout_logp`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distflow.data.fields import ATTENTION_MASK, INPUT_IDS, MISMATCH_LEDGER, RESPONSE_MASK, ROUTED_EXPERTS

if TYPE_CHECKING:
    from distflow.dag.context import StageContext
    from distflow.data.batch import Batch


def _rollout_replay(model):
    """A RoutingReplay that replaces, hooked once on the rollout model: the passes that route as the rollout did."""
    from distflow.training.routing_replay import RoutingReplay

    replay = getattr(model, "_distflow_ledger_replay", None)
    if replay is None:
        replay = RoutingReplay.of(model, replace=True)
        model._distflow_ledger_replay = replay
    return replay


def rollout_ledger(ctx: StageContext, out, uids: list[int], processed: bool):
    """Columns 0-3 of the ledger [B, R, 6] for the rollout `out` (`generate`'s) of samples `uids`, inside the
    rollout's `gathered`; `processed`: the engine's recorded log-probs are renormalised over the nucleus."""
    from distflow.rollout.mismatch_ledger import RowPasses, chosen_rows, rollout_anchors

    model, rollout = ctx.engines.rollout_model, ctx.config.rollout
    device = next(model.parameters()).device
    experts = out.routed_experts_BTLK
    passes = RowPasses(
        model,
        out.input_ids_BT.to(device),
        out.attention_mask_BT.to(device),
        out.response_mask_BR.to(device),
        None if experts is None else experts.to(device),
        ctx.engines.sampling.temperature,
    )
    chosen = chosen_rows(uids, ctx.config.trainer.seed, rollout.mismatch_ledger)
    replay = _rollout_replay(model) if experts is not None and chosen else None
    ledger = rollout_anchors(
        passes,
        chosen,
        top_p=ctx.engines.sampling.top_p,
        processed=processed,
        replay=replay,
        trainer_replays=rollout.routing_replay,
    )
    return ledger.to(ctx.comm.device)


def mismatch_ledger(batch: Batch, ctx: StageContext) -> Batch:
    """Columns 4-5 of the chosen samples with the weights the update starts from (every train rank calls it
    together: fsdp2 gathers); `mismatch/ledger_tokens`, the tokens the ledger covers."""
    from distflow.rollout.mismatch_ledger import RowPasses, trainer_anchors
    from distflow.training.parallelize import gathered

    policy = ctx.engines.policy
    replays = ctx.config.rollout.routing_replay
    passes = RowPasses(
        policy.model,
        batch[INPUT_IDS],
        batch[ATTENTION_MASK],
        batch[RESPONSE_MASK],
        batch[ROUTED_EXPERTS] if replays else None,
        policy.temperature,
    )
    with gathered(policy.model):
        ledger, tokens = trainer_anchors(passes, batch[MISMATCH_LEDGER], replay=policy.replay if replays else None)
    ctx.metrics.total("mismatch/ledger_tokens", float(tokens))
    return batch.updated(mismatch_ledger=ledger)
