"""Metrics computed from a step's reduced metrics (the same on every rank, no communication)."""

from __future__ import annotations


def add_derived(metrics: dict[str, float]) -> dict[str, float]:
    """Throughput and the train-token imbalance, from the stage times and token counts.

    Generation time is the rollout stage's plus dynamic sampling's extra rollouts; training
    time is the policy update's. The per-rank train-token maximum is replaced by its ratio
    to the mean (1.0 = perfectly balanced).
    """
    rollout_s = metrics["time/rollout_s"] + metrics.get("time/resample_rollout_s", 0.0)
    metrics["throughput/generated_tokens_per_s"] = metrics["tokens/generated"] / rollout_s
    metrics["throughput/trained_tokens_per_s"] = metrics.get("tokens/trained", 0.0) / metrics["time/policy_update_s"]
    if metrics.get("data/train_tokens_per_rank", 0) > 0:
        metrics["data/train_token_imbalance"] = (
            metrics.pop("data/train_tokens_per_rank_max") / metrics["data/train_tokens_per_rank"]
        )
    return metrics
