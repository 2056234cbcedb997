"""The disaggregated weight sync: which rows each train rank sends (weight_shares) and the transport
that sends them to the rollout ranks (weight_sync)."""
