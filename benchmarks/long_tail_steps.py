"""What one decode step costs, for benchmarks/long_tail.py: the model's forward alone, the forward with
the KV cache growing as `compact`'s does, one `compact` step, and one compaction, at given rows and context.

    forward      one HF forward of R rows x 1 token over a static KV cache of C columns plus the new one,
                 written in place (no copy): the model's work and nothing else
    + cache cat  the same forward over a `DynamicCache` of C columns, which `torch.cat`s the new column
                 onto every layer's keys and values, copying the whole cache: what every `compact` and
                 `generate` step pays
    compact step `generate(engine=CompactEngine())` of one prompt x R samples, stop tokens made impossible
                 (so all R rows run), once for T tokens and once for 1: (t_T - t_1) / (T - 1), the prefill
                 cancelled out. Its prompt is C - T/2 tokens wide, so its steps attend on average over C
                 columns. Forward, cache growth, the keyed draw, the look at the ended rows: a step of the
                 engine's loop
    compaction   one `batch_select_indices` that drops one row of R from a cache of C columns: what each
                 look that finds ended rows costs `compact` on top of its steps (it copies the whole cache)

Each cell is the fastest of `repeats` calls (after one warm-up) in each of `rounds` rounds, and the fastest
round's; the rounds go over every cell in turn, so load on the machine reaches all cells alike. The cache's
keys and values are those of a real prefill of C tokens (one row, repeated to R): values do not change
what a product costs. Not a benchmark on its own: long_tail.py prints the table and the JSON.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, StaticCache

from distflow.rollout.compact import CompactEngine
from distflow.rollout.generation import generate
from distflow.training.models import cache_kwargs


def context_ids(tokenizer, columns: int) -> list[int]:
    """`columns` token ids of plain text (sums, over and over): a context that is no one's prompt."""
    sums = ((7 + 13 * i % 90, 11 + 29 * i % 80) for i in range(columns))
    text = " ".join(f"{a} + {b} = {a + b}" for a, b in sums)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < columns:
        raise ValueError(f"the context text has {len(ids)} tokens, fewer than {columns}")
    return ids[:columns]


@torch.no_grad()
def prefilled(model, tokenizer, columns: int) -> DynamicCache:
    """One row's KV cache after a prefill of `columns` tokens."""
    cache = DynamicCache(config=model.config)
    ids_1C = torch.tensor([context_ids(tokenizer, columns)])
    positions_1C = torch.arange(columns).unsqueeze(0)
    model(input_ids=ids_1C, position_ids=positions_1C, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    return cache


def repeated(one: DynamicCache, rows: int, cache: DynamicCache | StaticCache) -> DynamicCache | StaticCache:
    """`cache` filled with `rows` copies of `one`'s row."""
    for index, layer in enumerate(one.layers):
        cache.update(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1), index)
    return cache


def fastest(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run` (which returns its own seconds), after one untimed."""
    run()
    return min(run() for _ in range(repeats))


@torch.no_grad()
def forward_s(model, one: DynamicCache, rows: int, *, growing: bool, repeats: int) -> float:
    """Seconds of one decode forward of `rows` rows over `one`'s columns: over a static cache (`growing`
    False: the forward alone) or a dynamic one (True: plus the cache's `torch.cat`). After each forward the
    cache is cropped back, so every timed forward sees the same context."""
    columns = one.get_seq_length()
    if growing:
        cache = repeated(one, rows, DynamicCache(config=model.config))
    else:
        cache = repeated(one, rows, StaticCache(config=model.config, max_cache_len=columns + 1))
    inputs = {
        "input_ids": torch.full((rows, 1), int(model.config.bos_token_id or 0)),
        "attention_mask": torch.ones(rows, columns + 1, dtype=torch.long),
        "position_ids": torch.full((rows, 1), columns),
        **cache_kwargs(cache),
        "use_cache": True,
    }

    def run() -> float:
        start = time.perf_counter()
        model(**inputs)
        seconds = time.perf_counter() - start
        cache.crop(-1)  # the new column goes: the next forward sees `columns` again
        return seconds

    return fastest(run, repeats)


def compaction_s(one: DynamicCache, rows: int, repeats: int) -> float:
    """Seconds of dropping one row of `rows` from a dynamic cache of `one`'s columns."""
    keep = torch.arange(rows - 1)

    def run() -> float:
        cache = repeated(one, rows, DynamicCache())
        start = time.perf_counter()
        cache.batch_select_indices(keep)
        return time.perf_counter() - start

    return fastest(run, repeats)


def compact_step_s(model, tokenizer, never_stops, rows: int, columns: int, tokens: int, repeats: int) -> float:
    """Seconds of one step of `compact`'s loop at `rows` rows attending over `columns` on average:
    (t_tokens - t_1) / (tokens - 1), each the fastest of `repeats` rollouts that never stop (`never_stops`:
    a context manager under which the model never samples a stop token)."""
    prompt = [context_ids(tokenizer, columns - tokens // 2)]
    keys = list(range(rows))
    engine = CompactEngine()

    def rollout(length: int):
        def run() -> float:
            start = time.perf_counter()
            out = generate(
                model,
                tokenizer,
                [""],
                prompt_ids=prompt,
                max_new_tokens=length,
                temperature=1.0,
                sample_keys=keys,
                samples_per_prompt=rows,
                engine=engine,
                logprobs=True,
            )
            seconds = time.perf_counter() - start
            assert int(out.response_mask_BR.sum()) == rows * length, "a row stopped: the step was not at full rows"
            return seconds

        return run

    with never_stops():
        return (fastest(rollout(tokens), repeats) - fastest(rollout(1), repeats)) / (tokens - 1)


def curve(
    model,
    tokenizer,
    never_stops,
    *,
    contexts: tuple[int, ...],
    rows: tuple[int, ...],
    compact_rows: tuple[int, ...],
    tokens: int,
    rounds: int,
    repeats: int,
) -> list[dict]:
    """The decode-step table: one row per (context, rows), milliseconds, each cell its fastest round's."""
    ones = {columns: prefilled(model, tokenizer, columns) for columns in contexts}
    cells: dict[tuple[int, int], dict[str, float]] = {}

    def keep(columns: int, count: int, name: str, seconds: float) -> None:
        cell = cells.setdefault((columns, count), {})
        cell[name] = min(cell.get(name, float("inf")), seconds)

    for _ in range(rounds):
        for columns in contexts:
            one = ones[columns]
            for count in rows:
                keep(columns, count, "forward", forward_s(model, one, count, growing=False, repeats=repeats))
                keep(columns, count, "forward_cat", forward_s(model, one, count, growing=True, repeats=repeats))
                if count > 1:
                    keep(columns, count, "compaction", compaction_s(one, count, repeats))
            for count in compact_rows:
                step = compact_step_s(model, tokenizer, never_stops, count, columns, tokens, repeats)
                keep(columns, count, "compact_step", step)
    table = []
    for (columns, count), cell in sorted(cells.items()):
        row = {"context": columns, "rows": count}
        row |= {f"{name}_ms": round(1e3 * seconds, 3) for name, seconds in cell.items()}
        if "compact_step" in cell:
            row["compact_over_forward"] = round(cell["compact_step"] / cell["forward"], 2)
        table.append(row)
    return table


def print_curve(table: list[dict], model_name: str, rounds: int, repeats: int, tokens: int) -> None:
    print(
        f"\ndecode step, ms ({model_name}; fastest of {rounds} interleaved rounds x {repeats} calls; compact step: "
        f"(t_{tokens} - t_1) / {tokens - 1} of a rollout at full rows, its prompt context - {tokens // 2} wide)"
    )
    names = ("forward", "+cache cat", "compact step", "/forward", "compaction")
    print(f"{'context':>8}{'rows':>6}" + "".join(f"{name:>14}" for name in names))
    for row in table:
        cells = [row.get(key) for key in ("forward_ms", "forward_cat_ms", "compact_step_ms")]
        cells += [row.get("compact_over_forward"), row.get("compaction_ms")]
        shown = ["" if value is None else f"{value:.2f}" for value in cells]
        shown[3] += "x" if shown[3] else ""
        print(f"{row['context']:>8}{row['rows']:>6}" + "".join(f"{value:>14}" for value in shown))
    print("  a token decoded alone costs forward(1 row) / (forward(R rows) / R) of one in a full batch of R")
