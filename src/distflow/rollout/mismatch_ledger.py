"""The mismatch ledger (`rollout.mismatch_ledger`): the gap between a token's trainer log-prob and the rollout's
recorded one, split into its sources by a chain of recomputes on 1 in N samples, each changing one thing.

    b          the rollout's recorded log-prob: its engine, dtype, sampler, experts and weights θ_b
    0 proc     θ_b, the rollout's dtype, its sampler's post-processing, its experts  ┐ on the rollout's rank, right
    1 raw      θ_b, the rollout's dtype, raw softmax(logits / T), its experts        │ after the rollout (the
    2 fp32     θ_b, float32, raw, the rollout's experts                              │ weights that sampled): one
    3 routed   θ_b, float32, raw, the trainer's routing (replayed, or its own)       ┘ unpadded row a forward
    4 t_fp32   θ_t, float32, raw, the trainer's routing                              ┐ on the train rank, before the
    5 t_dtype  θ_t, the trainer's dtype, raw, the trainer's routing                  ┘ update (`trainer_anchors`)
    p          the trainer's log-prob: its batched pass, the one `mismatch/*` compares

    engine     (proc - b) + (p - t_dtype)      kernels and batching: the engine's decode, the trainer's batched pass
    sampler    raw - proc                      top-p renormalisation in recorded log-probs (vLLM's processed ones)
    precision  (fp32 - raw) + (t_dtype - t_fp32)  each side's dtype against float32 (0 in a float32 run)
    routing    routed - fp32                   the rollout's experts against the trainer's (0: dense, or replayed)
    staleness  t_fp32 - routed                 the weights: θ_t against θ_b (0 in a synchronous run)
    total      p - b                           = the sum of the five: differences of float32 values in float64

A pass whose inputs equal an earlier one's is that pass (a float32 run's dtype passes, a dense model's routing
pass): its term is 0 exactly, not a rounding. The routing term needs the rollout's experts (`rollout.record_routing`
or `routing_replay`); without them a flipped expert counts under `engine`. The rows travel in the batch as the
`mismatch_ledger` field [B, R, 6] (NaN outside the chosen samples and their responses).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from distflow.rollout.sampling import nucleus_BV
from distflow.seeding import derive_seed
from distflow.training.token_logprobs import token_logprobs

PROC, RAW, FP32, ROUTED, T_FP32, T_DTYPE = range(6)
COLUMNS = 6
TERMS = ("engine", "sampler", "precision", "routing", "staleness", "total")


def chosen_rows(uids: list[int], seed: int, every: int) -> list[int]:
    """The rows whose samples the ledger recomputes: 1 in `every` by a hash of the sample's uid, so the same
    samples on any rank, layout and world size."""
    return [row for row, uid in enumerate(uids) if derive_seed(seed, "mismatch_ledger", int(uid)) % every == 0]


def _span(attention_mask_T: torch.Tensor, response_width: int, length: int) -> tuple[int, int]:
    """(start, stop) of a row's tokens: its prompt after the left padding, then its first `length` response
    tokens."""
    prompt_end = attention_mask_T.shape[0] - response_width
    start = int(attention_mask_T[:prompt_end].nonzero()[0, 0]) if attention_mask_T[:prompt_end].any() else prompt_end
    return start, prompt_end + length


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `model`'s forwards compute in (training/parallelize.compute_in)."""
    owner = getattr(model, "parameters_owner", model)
    return getattr(owner, "_distflow_compute_dtype", torch.float32)


@contextlib.contextmanager
def _float32(model: torch.nn.Module):
    """Forwards inside compute in float32: autocast off, over weights that must be float32 themselves."""
    param = next(model.parameters())
    if param.dtype != torch.float32:
        raise RuntimeError(
            f"rollout.mismatch_ledger recomputes in float32, but this model's weights are {param.dtype} here "
            "(fsdp2 gathers them in parallel.param_dtype): set parallel.param_dtype=float32 or turn the ledger off"
        )
    with torch.autocast(param.device.type, enabled=False):
        yield


def _logp(model, ids_T, experts_TLK, replay, length: int, temperature: float, top_p: float | None = None):
    """The last `length` tokens' log-probs from one forward of the unpadded row `ids_T` (with `experts_TLK`
    replayed through `replay`, where given), and with `top_p` those renormalised over the nucleus too."""
    places = torch.arange(ids_T.shape[0], device=ids_T.device).unsqueeze(0)
    with replay.replaying(experts_TLK.unsqueeze(0)) if replay is not None else contextlib.nullcontext():
        if replay is not None:
            replay.call(places)
        logits_TV = model(input_ids=ids_T.unsqueeze(0), position_ids=places).logits[0]
    logits_LV = logits_TV[-length - 1 : -1].float()
    raw_L = token_logprobs(logits_LV.unsqueeze(0), ids_T[-length:].unsqueeze(0), temperature=temperature)[0][0]
    if top_p is None or top_p >= 1.0:
        return raw_L, raw_L
    probs_LV = torch.softmax(logits_LV / temperature, dim=-1)
    return raw_L - nucleus_BV(probs_LV, top_p).sum(-1).log(), raw_L


def _float32_logp(args: tuple) -> torch.Tensor:
    """`_logp(*args)`'s raw log-probs from a float32 forward (args[0]: the model)."""
    with _float32(args[0]):
        return _logp(*args)[1]


@dataclass
class RowPasses:
    """One side's passes over the chosen rows: the model, its rows' tokens and experts, and how it routes."""

    model: torch.nn.Module
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    response_mask_BR: torch.Tensor
    experts_BTLK: torch.Tensor | None
    temperature: float

    def rows(self, chosen: list[int]):
        """(row, its response length, its tokens, its experts) of each chosen row with a response."""
        width = self.response_mask_BR.shape[1]
        for row in chosen:
            length = int(self.response_mask_BR[row].sum())
            if length == 0:
                continue
            start, stop = _span(self.attention_mask_BT[row], width, length)
            experts = None if self.experts_BTLK is None else self.experts_BTLK[row, start:stop]
            yield row, length, self.input_ids_BT[row, start:stop], experts


def rollout_anchors(passes: RowPasses, chosen: list[int], *, top_p: float, processed: bool, replay, trainer_replays):
    """Columns 0-3 for the chosen rows, [B, R, 6] (NaN elsewhere), with the weights that sampled: `processed`,
    the engine recorded log-probs renormalised over the top-p nucleus; `replay`, a RoutingReplay that replaces
    on the rollout model (None: no experts recorded); `trainer_replays`, the trainer replays them."""
    B, R = passes.response_mask_BR.shape
    ledger = torch.full((B, R, COLUMNS), float("nan"), device=passes.response_mask_BR.device)
    in_float32 = compute_dtype(passes.model) == torch.float32
    with torch.no_grad():
        for row, length, ids, experts in passes.rows(chosen):
            rep = replay if experts is not None else None
            args = (passes.model, ids, experts, rep, length, passes.temperature)
            proc, raw = _logp(*args, top_p if processed else None)
            fp32 = raw if in_float32 else _float32_logp(args)
            if rep is None or trainer_replays:
                routed = fp32
            else:
                with _float32(passes.model):
                    routed = _logp(passes.model, ids, None, None, length, passes.temperature)[1]
            ledger[row, :length, PROC], ledger[row, :length, RAW] = proc, raw
            ledger[row, :length, FP32], ledger[row, :length, ROUTED] = fp32, routed
    return ledger


def trainer_anchors(passes: RowPasses, ledger_BRC: torch.Tensor, *, replay) -> tuple[torch.Tensor, int]:
    """`ledger_BRC` with columns 4-5 filled by the current weights (`replay`: the trainer's RoutingReplay when it
    replays the rollout's experts, else None), and the number of tokens the ledger covers on this rank."""
    ledger = ledger_BRC.clone()
    chosen = (~torch.isnan(ledger[:, 0, PROC])).nonzero().flatten().tolist()
    in_float32 = compute_dtype(passes.model) == torch.float32
    tokens = 0
    with torch.no_grad():
        for row, length, ids, experts in passes.rows(chosen):
            rep = replay if experts is not None else None
            args = (passes.model, ids, experts, rep, length, passes.temperature)
            t_dtype = _logp(*args)[1]
            t_fp32 = t_dtype if in_float32 else _float32_logp(args)
            ledger[row, :length, T_FP32], ledger[row, :length, T_DTYPE] = t_fp32, t_dtype
            tokens += length
    return ledger, tokens


def terms(ledger_NC: torch.Tensor, p_N: torch.Tensor, b_N: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each token's five terms and their total (float64), from its anchors, its trainer log-prob `p_N` and its
    recorded one `b_N`: pure arithmetic, so the five add up to the total to float64 rounding."""
    a = ledger_NC.double()
    p, b = p_N.double(), b_N.double()
    return {
        "engine": (a[:, PROC] - b) + (p - a[:, T_DTYPE]),
        "sampler": a[:, RAW] - a[:, PROC],
        "precision": (a[:, FP32] - a[:, RAW]) + (a[:, T_DTYPE] - a[:, T_FP32]),
        "routing": a[:, ROUTED] - a[:, FP32],
        "staleness": a[:, T_FP32] - a[:, ROUTED],
        "total": p - b,
    }


@dataclass
class LedgerTally:
    """The ledger's terms summed over one step's update (loss tokens of the chosen samples)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    num_tokens: float = 0.0

    def add(self, ledger_BRC: torch.Tensor, prox_BR: torch.Tensor, behav_BR: torch.Tensor, mask_BR) -> None:
        known_BR = mask_BR.bool() & ~torch.isnan(ledger_BRC[..., PROC]) & ~torch.isnan(ledger_BRC[..., T_DTYPE])
        if not known_BR.any():
            return
        for name, values in terms(ledger_BRC[known_BR], prox_BR.detach()[known_BR], behav_BR[known_BR]).items():
            self.sums[name] += float(values.sum())
        self.num_tokens += float(known_BR.sum())

    def record(self, metrics) -> None:
        """`mismatch/ledger_<term>`: each term's mean over the ledger's tokens (signed: trainer minus rollout);
        the five means add up to `mismatch/ledger_total`'s."""
        for name, total in self.sums.items():
            metrics.mean(f"mismatch/ledger_{name}", total, self.num_tokens)
