"""Per-token log-probabilities (and entropies) of response tokens under a model."""

from __future__ import annotations

import torch

from distflow.engines.sequences import position_ids_from_mask


def response_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token (the last R = `response_width` columns), shape [B, R].

    The logits at column t predict token t+1, hence the shift by one.
    """
    response_start = input_ids_BT.shape[1] - response_width
    logits_BTV = model(
        input_ids=input_ids_BT,
        attention_mask=attention_mask_BT,
        position_ids=position_ids_from_mask(attention_mask_BT),
        use_cache=False,
    ).logits
    logits_BRV = logits_BTV[:, response_start - 1 : -1, :].float()
    targets_BR = input_ids_BT[:, response_start:]
    logz_BR = torch.logsumexp(logits_BRV, dim=-1)
    logp_BR = torch.gather(logits_BRV, -1, targets_BR.unsqueeze(-1)).squeeze(-1) - logz_BR
    entropy_BR = None
    if with_entropy:
        with torch.no_grad():
            probs_BRV = torch.softmax(logits_BRV, dim=-1)
            entropy_BR = logz_BR - (probs_BRV * logits_BRV).sum(-1)
    return logp_BR, entropy_BR
