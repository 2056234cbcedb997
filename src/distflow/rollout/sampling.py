"""Per-sample keyed sampling: a sample's randomness depends on its key, not on its batch.

    u[b, t] = hash(key[b], t) ∈ (0, 1)         counter-based, no generator state
    token   = inverse CDF of softmax(logits / T) (after top-p) at u[b, t]

This is categorical sampling, in float32 (`sampled_logprob_B1` says how exact), and because
the noise of sample b at response position t is a pure function of (key[b], t), the same seed
gives the same completions whichever rank generates a sample, with whatever batch-mates and
padding — the basis of distflow's layout invariance (1 rank, N ranks, any placement: same samples).

Plugged into Hugging Face `generate` as a logits processor under greedy decoding: the
processor leaves one finite score per row (the sampled token), so argmax picks it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

_MASK32 = 0xFFFFFFFF
_SALTS_21 = torch.tensor([[0x5EED1], [0x5EED2]])  # the two halves of a 52-bit uniform


@dataclass(frozen=True)
class SamplingSpec:
    """How completions are sampled. The one object that carries the temperature: rollout,
    evaluation and every log-prob pass (old, reference, training) use it, so PPO ratios and
    KL terms are taken under exactly the sampling distribution."""

    temperature: float
    top_p: float
    max_new_tokens: int
    engine: Any = "compact"
    """The rollout engine that computes the samples (a `distflow.rollout.engine.RolloutEngine`, or a
    built-in one's name); it does not change them, except vLLM's, which has its own sampler."""

    @classmethod
    def of(cls, rollout, *, engine: Any = None) -> SamplingSpec:
        """From the run's `rollout` config section, with this rank's built `engine` (default: the engine
        the section names, with its default options)."""
        return cls(
            rollout.temperature, rollout.top_p, rollout.max_new_tokens, rollout.engine if engine is None else engine
        )


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for h < 2^32 without int64 overflow: the constant split into 16-bit halves,
    h * (c mod 2^16) + ((h * (c >> 16)) mod 2^16) << 16, each product below 2^48."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: every input bit affects every output bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


_SALT_STATES_21 = _fmix32(_SALTS_21)  # the hash's state after its salt: the same for every draw


def _absorb(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """The hash state after a 64-bit word: its low 32 bits, then its high 32."""
    return _fmix32(_mul32(h ^ (word & _MASK32), 0x9E3779B1) ^ ((word >> 32) & _MASK32))


def _absorb_small(h: torch.Tensor, word: torch.Tensor) -> torch.Tensor:
    """`_absorb` of a word in [0, 2^32), bit for bit: its high half is 0, and x ^ 0 = x."""
    return _fmix32(_mul32(h ^ word, 0x9E3779B1))


def keyed_uniform(keys_B: torch.Tensor, position: int) -> torch.Tensor:
    """One uniform in (0, 1) per key for this position, float64 with 52 random bits.

    >>> u = keyed_uniform(torch.arange(4), 0)
    >>> bool(((u > 0) & (u < 1)).all()), torch.equal(u, keyed_uniform(torch.arange(4), 0))
    (True, True)
    """
    keys_B = keys_B.long()
    return _uniforms(keys_B, torch.full_like(keys_B, position))


def keyed_uniforms(keys_B: torch.Tensor, num_positions: int, offsets_B: torch.Tensor | None = None) -> torch.Tensor:
    """The uniforms of positions 0..R-1 at once, [B, R]: column t is `keyed_uniform(keys_B, t)`, bit
    for bit (the hash is exact integer arithmetic, element by element). A decode loop draws them all
    before its first token, so a decoded token pays for one column, not for the ~70 small integer
    operations of the hash (each a kernel launch on a GPU). `offsets_B`: row b's columns are positions
    offsets_B[b] .. offsets_B[b] + R - 1 instead (a sample continued after the tokens it already has).

    >>> keys = torch.tensor([5, 17, 2**40])
    >>> torch.equal(keyed_uniforms(keys, 3)[:, 2], keyed_uniform(keys, 2))
    True
    >>> torch.equal(keyed_uniforms(keys, 2, torch.tensor([1, 1, 1])), keyed_uniforms(keys, 3)[:, 1:])
    True
    """
    positions_BR = torch.arange(num_positions, device=keys_B.device).unsqueeze(0)
    if offsets_B is not None:
        positions_BR = positions_BR + offsets_B.to(keys_B.device).long().unsqueeze(-1)
    return _uniforms(keys_B.long().unsqueeze(-1), positions_BR)


def _uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms of (key, position) pairs, the two broadcast together (positions in [0, 2^32))."""
    # both 32-bit halves in one pass (a decode step pays each op's dispatch once)
    salts = _SALT_STATES_21.to(keys.device).view(2, *[1] * keys.dim())
    high, low = _absorb_small(_absorb(salts, keys.unsqueeze(0)), positions.unsqueeze(0))
    bits = high * (1 << 20) + (low >> 12)  # 52 bits
    return (bits.double() + 0.5) / float(1 << 52)


def sample_from_logits(
    logits_BV: torch.Tensor,
    keys_B: torch.Tensor | None,
    position: int,
    *,
    temperature: float,
    top_p: float = 1.0,
    uniform_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token ids drawn from softmax(logits / T) restricted to the top-p nucleus; `uniform_B`: the rows'
    `keyed_uniform(keys_B, position)`, drawn ahead (`keyed_uniforms`)."""
    if uniform_B is None:
        uniform_B = keyed_uniform(keys_B.to(logits_BV.device), position)
    uniform_B1 = uniform_B.to(logits_BV.device).unsqueeze(-1)
    return sampled_B1(logits_BV, uniform_B1, temperature=temperature, top_p=top_p).squeeze(-1)


@functools.cache
def _minus_inf(device: torch.device) -> torch.Tensor:
    """-inf in float32 on `device`, made once per device: a copy from the host per decoded token would
    cost a GPU a transfer, and could not be captured in a CUDA graph (rollout/graphed.py)."""
    return torch.tensor(float("-inf"), dtype=torch.float32, device=device)


def _scaled(logits_BV: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T in float32."""
    scaled_BV = logits_BV.float()
    if temperature != 1.0:  # x / 1.0 is x: the same values without the op
        scaled_BV = scaled_BV / temperature
    return scaled_BV


def _exp_and_lse(scaled_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp(scaled - its row max) [B, V], logsumexp(scaled) [B, 1]): the steps of `torch.logsumexp`, so
    the log-sum-exp is its own, bit for bit, on rows with a finite max (tests/test_sampling.py), and
    the exponentials it sums are kept: the draw's probabilities, unnormalised, with no further pass."""
    max_B1 = scaled_BV.amax(dim=-1, keepdim=True)
    exp_BV = (scaled_BV - max_B1).exp_()
    return exp_BV, exp_BV.sum(dim=-1, keepdim=True).log_().add_(max_B1)


def nucleus_candidates(device: torch.device) -> tuple[int, ...]:
    """How many of the likeliest tokens top-p looks among first, in turn, before sorting the vocabulary:
    on a CPU 64, then 1,024; none on a GPU, where each look would be a wait on the host."""
    return (64, 1024) if device.type == "cpu" else ()


def nucleus_BV(probs_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs_BV` (rows summing to 1) with 0 outside each row's nucleus: the tokens whose strictly more
    likely tokens hold less than `top_p` of the mass. In descending order of probability, the tokens up
    to the first whose running sum reaches `top_p`, and every token as likely as that one: a token's
    place among equals does not decide whether it is kept.

    On a CPU the nucleus is looked for among the k most likely tokens first (`nucleus_candidates`): a
    partial sort, 30x cheaper than sorting 49,152 tokens. Where every row's k tokens hold `top_p`, the
    running sums over them are the first k of a full sort's (a running sum adds in order, and equal
    values add alike in any order), so the nucleus is the full sort's; else the next k, then the sort.
    The check reads a value on the host, which a GPU would wait for: there the vocabulary is sorted."""
    for k in (k for k in nucleus_candidates(probs_BV.device) if k < probs_BV.shape[-1]):
        top_BK = probs_BV.topk(k, dim=-1).values
        mass_BK = top_BK.cumsum(-1)
        if bool((mass_BK[:, -1] >= top_p).all()):
            return _at_least(probs_BV, top_BK, mass_BK, top_p)
    sorted_BV = probs_BV.sort(dim=-1, descending=True).values
    return _at_least(probs_BV, sorted_BV, sorted_BV.cumsum(-1), top_p)


def _at_least(probs_BV: torch.Tensor, sorted_BK: torch.Tensor, mass_BK: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs_BV` where at least the least likely token of the nucleus (the first whose running sum in
    `mass_BK` reaches `top_p`), else 0."""
    last_B1 = (mass_BK < top_p).sum(dim=-1, keepdim=True).clamp(max=sorted_BK.shape[-1] - 1)
    least_B1 = sorted_BK.gather(-1, last_B1)
    return torch.where(probs_BV >= least_B1, probs_BV, torch.zeros_like(probs_BV))


def sampled_B1(logits_BV: torch.Tensor, uniform_B1: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    """`sample_from_logits` for a decode loop, [B, 1] in and out (no reshaping per token)."""
    return sampled_logprob_B1(logits_BV, uniform_B1, temperature=temperature, top_p=top_p)[0]


def sampled_logprob_B1(
    logits_BV: torch.Tensor, uniform_B1: torch.Tensor, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`sampled_B1`, the drawn token's `token_logprob_B1`, bit for bit), the two from one pass over the
    vocabulary, in float32: the probabilities are the exponentials that the log-sum-exp sums.

    float32 is exact enough: a token's probability is off by the rounding of its logit / T (a relative
    2^-24 of the logit: ~1e-5 of the probability for logits near 100, below the rounding of the logits
    a float32 model computes) and of the running sum (~1e-7 of the total), against float64's ~1e-16;
    a draw differs from float64's only where its uniform lies that close to a bin edge
    (tests/test_sampling.py). On a CPU it costs a third of a float64 draw or less (`benchmarks/sampling.py`)."""
    scaled_BV = _scaled(logits_BV, temperature)
    probs_BV, lse_B1 = _exp_and_lse(scaled_BV)
    if top_p < 1.0:
        probs_BV = nucleus_BV(probs_BV / probs_BV.sum(dim=-1, keepdim=True), top_p)
    on_cpu = probs_BV.device.type == "cpu"
    cdf_BV = probs_BV.cumsum_(-1) if on_cpu else probs_BV.cumsum(-1)  # a GPU's check below reads the masses
    # The first token whose cumulative mass passes u. In a sequential running sum (a CPU's) a token
    # of zero mass adds exactly 0, so it is never the first to pass u; but rounding can leave u at or
    # past the total mass, where no token passes it: then the last token with mass, the first whose
    # cumulative mass equals the total, which is the first to pass the float just below the total.
    # So one search at the smaller of the two (the search is monotone in its value) needs no look at
    # the values on the host (a loop stepping back over empty bins would stall a GPU once per token).
    # The uniform is rounded to float32 first (the decode loops round theirs once, ahead), so a
    # float64 one and its float32 copy draw alike.
    total_B1 = cdf_BV[:, -1:]
    target_B1 = uniform_B1.to(cdf_BV.dtype) * total_B1
    target_B1 = torch.minimum(target_B1, torch.nextafter(total_B1, _minus_inf(cdf_BV.device)))
    token_B1 = torch.searchsorted(cdf_BV, target_B1, right=True).clamp(max=logits_BV.shape[-1] - 1)  # NaN too
    if not on_cpu:
        # A GPU's parallel scan adds in another order, so an empty bin can round past its neighbour;
        # a token of zero mass (outside the nucleus) is then replaced by the most likely one.
        empty_B1 = probs_BV.gather(-1, token_B1) == 0
        token_B1 = torch.where(empty_B1, probs_BV.argmax(-1, keepdim=True), token_B1)
    return token_B1, scaled_BV.gather(-1, token_B1) - lse_B1


def token_logprob_B(logits_BV: torch.Tensor, token_B: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each row's token, in float32 as the training passes take it
    (`training.logprobs`; top-p is ignored there too): the behaviour log-prob `rollout_logp`."""
    return token_logprob_B1(logits_BV, token_B.unsqueeze(-1), temperature=temperature).squeeze(-1)


def token_logprob_B1(logits_BV: torch.Tensor, token_B1: torch.Tensor, *, temperature: float) -> torch.Tensor:
    """`token_logprob_B` for a decode loop, [B, 1] in and out."""
    scaled_BV = _scaled(logits_BV, temperature)
    return scaled_BV.gather(-1, token_B1) - torch.logsumexp(scaled_BV, dim=-1, keepdim=True)


class KeyedSampler:
    """Logits processor for `generate(do_sample=False)` that samples with per-row keys."""

    def __init__(
        self,
        keys_B: torch.Tensor,
        prompt_width: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        offsets_B: torch.Tensor | None = None,
    ) -> None:
        self.uniform_BR = keyed_uniforms(keys_B, max_new_tokens, offsets_B).float()  # every position's draw, ahead
        self.prompt_width = prompt_width
        self.temperature = temperature
        self.top_p = top_p
        self.logp_B: list[torch.Tensor] = []
        """Each drawn token's behaviour log-prob, one entry per position."""

    def __call__(self, input_ids_BT: torch.Tensor, scores_BV: torch.Tensor) -> torch.Tensor:
        position = input_ids_BT.shape[1] - self.prompt_width  # index of the response token being drawn
        uniform_B1 = self.uniform_BR[:, position : position + 1].to(scores_BV.device)
        token_B1, logp_B1 = sampled_logprob_B1(scores_BV, uniform_B1, temperature=self.temperature, top_p=self.top_p)
        self.logp_B.append(logp_B1.squeeze(-1))
        out_BV = torch.full_like(scores_BV, float("-inf"))
        return out_BV.scatter(-1, token_B1, 0.0)
