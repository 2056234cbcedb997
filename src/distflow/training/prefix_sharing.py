"""Shared-prefix passes: each distinct prompt of a micro-batch goes through the model once.

    padded   [B, W+R]   every sample carries its prompt: a group of n samples computes it n times
    shared   prompts [U, W]  (U distinct prompts) ──forward, KV cache kept──▶ cache [U, W]
             per length bucket k (rows N_k whose responses are at most L_k long):
               cache ──row of each sample's prompt (a gather)──▶ [N_k, W]
               responses [N_k, L_k - 1] ──forward over that cache──▶ outputs [N_k, L_k - 1]
             outputs [B, R] = the prompt pass's last column per sample | each bucket's rows

The output that predicts response token 0 is the last prompt column's, from the prompt pass
(taken for each sample's prompt); tokens 1..L-1 of a response of length L are predicted by
its columns 0..L-2, which attend to the cached prompt and to their own earlier tokens, at the
positions the padded pass gives them. Responses are grouped by length (`length_buckets`) so
that a short response is not computed to the batch's longest: a bucket is split off where it
saves at least 3% of the columns (each is one more forward call; on a GPU, where a call costs
its launches more than its columns, there is one bucket: `max_length_buckets`); columns past a bucket's
length are zeros in the outputs, as the padded pass's are masked out downstream. Gradients flow
through the cache into the prompt pass; the gather's
backward sums the n samples' contributions to their prompt, so log-probs, values, losses and
every gradient equal the padded pass's to float rounding (tests/test_prefix_sharing.py).

GRPO-style groups (n samples per prompt) make U = B / n: the prompt's tokens are computed once
instead of n times, in the forward and in the backward. A micro-batch without a repeated
prompt runs the padded pass (the same result without the second call), and so does every
micro-batch on a GPU, where the second call costs more than the columns it saves
(`shares_prefixes`).

The caches are write-once, so activation checkpointing may run either pass again in the
backward: the prompt pass's cache keeps the keys and values of its latest call (a recomputation
replaces them with equal ones instead of appending), and the responses read a second cache that
holds each sample's gathered prompt keys and values and never changes. This needs the
full-attention cache layers of transformers (`DynamicLayer`); a model with other kinds
(sliding-window layers keep a window of the cache and their masks depend on what they stored)
runs the padded pass, with a warning. Packed rows hold several prompts, so
`passes.padding_free` and this exclude each other (the config's `auto` picks this one unless
padding_free is set).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from distflow.training.packing import OnCall, Reduce, keep_outputs, places_BT, response_outputs
from distflow.training.parallelize import is_sharded
from distflow.training.sequences import position_ids_from_mask

# (input_ids, attention_mask, position_ids, cache or None, keep) -> outputs [rows, columns, ...]
# (keep > 0: only the last `keep` columns are read; a language model may skip the others' logits).
# The ids [rows, columns] may come as their embeddings [rows, columns, D] where an `Embed` is given.
PrefixForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, DynamicCache | None, int], torch.Tensor]
Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids [B, T] -> their input embeddings [B, T, D]


def distinct_prompts(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, response_width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids [U, W], prompt mask [U, W], index_B): row b's prompt is row index_B[b]."""
    width = input_ids_BT.shape[1] - response_width
    keys = torch.cat([input_ids_BT[:, :width], attention_mask_BT[:, :width].to(input_ids_BT.dtype)], dim=1)
    unique, index_B = torch.unique(keys, dim=0, return_inverse=True)
    return unique[:, :width], unique[:, width:].to(attention_mask_BT.dtype), index_B


def first_rows(index_B: torch.Tensor, count: int) -> torch.Tensor:
    """For each of `count` distinct prompts, the first row b with index_B[b] equal to it, [U].

    >>> first_rows(torch.tensor([1, 0, 1, 0, 2]), 3).tolist()
    [1, 0, 4]
    """
    rows_B = torch.arange(len(index_B), device=index_B.device)
    return rows_B.new_full((count,), len(index_B)).scatter_reduce(0, index_B, rows_B, "amin")


def prompt_rows(prompts_U: torch.Tensor, index_B: torch.Tensor) -> torch.Tensor:
    """Row index_B[b] of `prompts_U` for each sample b, [B, ...], with a backward that sums each prompt's
    samples in the same order every time. Indexing's backward (`index_put` with accumulation) adds
    the repeated rows from several threads on a CPU, in whichever order they come (same-seed runs then
    drift apart); `index_select`'s (`index_add_`) adds them one row after another there. On CUDA it
    is the other way round: `index_add_` adds atomically, indexing sorts first."""
    if prompts_U.device.type == "cpu":
        return prompts_U.index_select(0, index_B)
    return prompts_U[index_B]


def input_embedding(model: torch.nn.Module) -> Embed | None:
    """`model`'s input embedding (under DDP, its module's), for `shared_prefix_outputs` to embed a micro-batch's
    tokens once: where a gradient is taken for an embedding that trains. None where nothing is saved (no
    gradient) or where it cannot be called alone: a sharded model gathers its weights in its root's forward."""
    inner = getattr(model, "module", model)
    get = getattr(inner, "get_input_embeddings", None)
    embedding = get() if get is not None and not is_sharded(inner) else None
    weight = getattr(embedding, "weight", None)
    return embedding if weight is not None and torch.is_grad_enabled() and weight.requires_grad else None


def passes_outputs(
    forward,
    model_config,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    shared_prefix: bool | None,
    padding_free: bool,
    lockstep: bool,
    model: torch.nn.Module,
    reduce: Reduce | None = None,
    embed: Embed | None = None,
    on_call: OnCall | None = None,
) -> torch.Tensor:
    """The outputs that predict the response tokens, [B, R, ...], batched as `passes` asks: each distinct
    prompt once (`shared_prefix` true; None: where the device gains from it), else padded or packed
    (`padding_free`; `model` is what `forward` runs). The log-prob and value passes both call this.
    `reduce` maps each forward call's outputs, with the tokens they predict, to what is kept of them
    (a language model's logits to log-probs), so the [B, R, V] logits are never assembled. `embed`: as
    `shared_prefix_outputs`'s. `on_call` (packing.OnCall): told each forward call's tokens before it."""
    if shared_prefix is not False:
        return shared_prefix_outputs(
            forward,
            model_config,
            input_ids_BT,
            attention_mask_BT,
            response_width,
            lockstep=lockstep,
            follow_device=shared_prefix is None,
            reduce=reduce,
            embed=embed,
            on_call=on_call,
        )
    return response_outputs(
        forward,
        input_ids_BT,
        attention_mask_BT,
        response_width,
        padding_free=padding_free,
        model=model,
        reduce=reduce,
        on_call=on_call,
    )


def shared_prefix_outputs(
    forward: PrefixForward,
    model_config,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    response_width: int,
    *,
    lockstep: bool = False,
    follow_device: bool = True,
    reduce: Reduce | None = None,
    embed: Embed | None = None,
    on_call: OnCall | None = None,
) -> torch.Tensor:
    """The outputs that predict the response tokens, [B, R, ...], each distinct prompt computed once.

    `model_config` (the model's) says which cache layers the model uses. With `lockstep` every call makes the
    same two forward calls whatever its rows (the prompts, then every response at full width): under fsdp2
    training each forward is a collective, so the ranks' calls must match, including a rank's zero-gradient pass
    (training/trainable.py). With `follow_device` (the user left `passes.shared_prefix` unset) the device decides
    (`shares_prefixes`); otherwise prompts are shared wherever it runs. `reduce`, `on_call`: as `passes_outputs`'s.
    `embed` (`input_embedding`'s): the tokens are embedded once, and the forward calls get their embeddings
    instead of their ids (`_fed`)."""
    reduce = reduce or keep_outputs
    batch, total = input_ids_BT.shape
    width = total - response_width
    if follow_device and not shares_prefixes(input_ids_BT.device):
        return _padded(forward, input_ids_BT, attention_mask_BT, width, reduce, on_call)
    prompt_ids_UW, prompt_mask_UW, index_B = distinct_prompts(input_ids_BT, attention_mask_BT, response_width)
    cache = _write_once_cache(model_config)
    unshared = prompt_ids_UW.shape[0] == batch and not lockstep
    if unshared or width == 0 or response_width == 0 or cache is None:  # nothing to share: the padded pass
        return _padded(forward, input_ids_BT, attention_mask_BT, width, reduce, on_call)
    tokens_BT, prompts_UW = _fed(embed, input_ids_BT, prompt_ids_UW, index_B, width)
    tell = _teller(on_call, input_ids_BT)
    tell(first_rows(index_B, len(prompt_ids_UW)), slice(0, width))  # each prompt's first sample's row
    first_U = forward(prompts_UW, prompt_mask_UW, position_ids_from_mask(prompt_mask_UW), cache, 1)[:, -1:]
    first_B = reduce(prompt_rows(first_U, index_B), input_ids_BT[:, width : width + 1])
    positions_BT = position_ids_from_mask(attention_mask_BT)
    rest = first_B.new_zeros((batch, response_width - 1, *first_B.shape[2:]))
    buckets = (
        [(torch.arange(batch, device=index_B.device), response_width)]
        if lockstep
        else length_buckets(
            response_lengths(attention_mask_BT[:, width:]), max_buckets=max_length_buckets(input_ids_BT.device)
        )
    )
    for rows_N, length in buckets:
        # A response's last token predicts nothing: L - 1 columns (in lockstep all R, never none).
        columns = response_width if lockstep else length - 1
        if columns <= 0:  # responses of one token are predicted by their prompt's last column alone (of none:
            continue  # nothing; an agent episode that never called the model has an empty response)
        end = width + columns
        gathered = _read_only_cache(model_config, cache, index_B[rows_N])  # the backward sums each prompt's rows
        tell(rows_N, slice(width, end))
        out = forward(
            tokens_BT[rows_N, width:end], attention_mask_BT[rows_N, :end], positions_BT[rows_N, width:end], gathered, 0
        )
        rest[rows_N, : length - 1] = reduce(out[:, : length - 1], input_ids_BT[rows_N, width + 1 : width + length])
    return torch.cat([first_B, rest], dim=1)


def _teller(on_call: OnCall | None, input_ids_BT: torch.Tensor) -> Callable[[torch.Tensor, slice], None]:
    """`on_call` told of a call over rows and columns of the batch (nothing to tell: nothing done)."""
    if on_call is None:
        return lambda rows, columns: None
    places = places_BT(input_ids_BT)
    return lambda rows, columns: on_call(places[rows, columns])


def _fed(embed: Embed | None, input_ids_BT, prompt_ids_UW, index_B, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, T], the prompt pass's [U, W]): the ids, or with `embed` their embeddings ([B, T, D], [U, W, D]),
    the batch's embedded once: the backward then makes one dense [V, D] embedding gradient, not one per call."""
    if embed is None:
        return input_ids_BT, prompt_ids_UW
    tokens_BTD = embed(input_ids_BT)
    return tokens_BTD, tokens_BTD[first_rows(index_B, len(prompt_ids_UW)), :width]


def _padded(
    forward: PrefixForward, input_ids_BT, attention_mask_BT, width: int, reduce: Reduce, on_call: OnCall | None = None
) -> torch.Tensor:
    """The padded pass's outputs that predict the response tokens (one forward call, keeping the outputs
    of the last R + 1 columns only: a language model's head skips the prompt's)."""
    keep = input_ids_BT.shape[1] - width + 1
    if on_call is not None:
        on_call(places_BT(input_ids_BT))
    out = forward(input_ids_BT, attention_mask_BT, position_ids_from_mask(attention_mask_BT), None, keep)
    return reduce(out[:, -keep:-1], input_ids_BT[:, width:])


def shares_prefixes(device: torch.device) -> bool:
    """Whether `passes.shared_prefix` computes each distinct prompt once on this device, or the passes
    run padded. Sharing makes two forward calls (and two backward) where the padded pass makes one.
    On a CPU a call costs its arithmetic, and a group's n - 1 prompts saved pay for the second call;
    on a GPU a call of a model this size costs its kernel launches whatever its columns, and the
    second call doubles them (benchmarks/host_costs.py at the recipe's shape: the policy update's
    ops ~1.9x the padded pass's), so there the passes run padded."""
    return device.type == "cpu"


def response_lengths(response_mask_BR: torch.Tensor) -> torch.Tensor:
    """Columns up to each row's last attended response token, [B]."""
    columns = torch.arange(1, response_mask_BR.shape[1] + 1, device=response_mask_BR.device)
    return (
        (response_mask_BR.ne(0) * columns).amax(dim=1)
        if response_mask_BR.shape[1]
        else columns.new_zeros(response_mask_BR.shape[0])
    )


def length_buckets(
    lengths_B: torch.Tensor, *, max_buckets: int = 4, min_saving: float = 0.03
) -> list[tuple[torch.Tensor, int]]:
    """Rows grouped by response length, [(rows, longest length)], longest first.

    The responses' forward computes each bucket's rows to its longest length instead of every
    row to the batch's longest. Starting from one bucket, the split that saves the most padded
    columns is made while it saves at least `min_saving` of the one-bucket columns (each bucket
    is one more forward call) and there are fewer than `max_buckets`. Rows of equal lengths stay
    one bucket; the choice depends on the lengths alone.
    """
    order_B = torch.argsort(lengths_B.cpu(), descending=True, stable=True)
    sorted_B = lengths_B.cpu()[order_B]
    bounds = [0, len(order_B)]
    threshold = min_saving * len(order_B) * (int(sorted_B[0]) if len(order_B) else 0)
    while len(bounds) - 1 < max_buckets:
        best = (0, None)  # (columns saved, split index)
        for start, stop in zip(bounds, bounds[1:], strict=False):
            split = torch.arange(start + 1, stop)
            if len(split):
                saved = (stop - split) * (sorted_B[start] - sorted_B[split])
                at = int(saved.argmax())
                best = max(best, (int(saved[at]), int(split[at])), key=lambda b: b[0])
        if best[1] is None or best[0] <= 0 or best[0] < threshold:
            break
        bounds = sorted([*bounds, best[1]])
    device = lengths_B.device
    return [(order_B[a:b].to(device), int(sorted_B[a])) for a, b in zip(bounds, bounds[1:], strict=False)]


def max_length_buckets(device: torch.device) -> int:
    """How many length buckets the responses may be split into. On a CPU a forward call costs its
    arithmetic, so a bucket that saves 3% of the columns pays for its call; on a GPU a call of a
    model this size costs its kernel launches whatever its columns, so the responses run as one call
    (on an H200 the recipe's update made 9 calls for its 2 micro-batches, and took 1.2 s for 0.05 s of
    kernels)."""
    return 4 if device.type == "cpu" else 1


def _write_once_cache(model_config) -> DynamicCache | None:
    """A cache for the prompt pass whose layers keep their latest call's keys and values; None
    (with a warning, once per model kind) if the model has layers other than full attention."""
    cache = DynamicCache(config=model_config)
    kinds = {type(layer).__name__ for layer in cache.layers} - {DynamicLayer.__name__}
    if kinds or not cache.layers:
        _warn_padded(type(model_config).__name__, ", ".join(sorted(kinds)) or "no cache layers from its config")
        return None
    for layer in cache.layers:
        layer.update = functools.partial(_keep, layer)
    return cache


def _read_only_cache(model_config, prompts: DynamicCache, index_B: torch.Tensor) -> DynamicCache:
    """A cache holding row index_B[b] of the prompt cache for sample b, which a forward reads and never grows."""
    cache = DynamicCache(config=model_config)
    for layer, prompt in zip(cache.layers, prompts.layers, strict=True):
        _keep(layer, prompt_rows(prompt.keys, index_B), prompt_rows(prompt.values, index_B))
        layer.update = functools.partial(_read, layer)
    return cache


def _keep(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
    layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
    layer.keys, layer.values = keys, values
    return keys, values


def _read(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
    return torch.cat([layer.keys, keys], dim=-2), torch.cat([layer.values, values], dim=-2)


@functools.cache
def _warn_padded(model_kind: str, layer_kinds: str) -> None:
    warnings.warn(
        f"passes.shared_prefix: {model_kind}'s cache has {layer_kinds}; its log-prob and training "
        "passes run padded (the same results, each sample computing its prompt)",
        stacklevel=3,
    )
