"""Slots: continuous batching inside one rollout, and grouped speculation, with plain decoding's samples.

    prompts P_1..P_G ──prefill once──▶ each prompt's KV [heads, P, d] + every sample's token 0
    S rows, one KV cache [S, heads, P + R + K, d], each row at its own column, running rows first:
      a forward   each running row feeds its last token, then its draft tokens, at its own columns
                  and positions ▸ each fed token's logits give the token after it, drawn from the
                  row's key at that position ▸ the drafts kept up to the first that differs from
                  what was drawn; the draw at the first difference is kept too
      an ended row  takes the next waiting sample (its prompt's KV copied in: one prefill a distinct prompt;
                  a kept row, rollout/kept_cache.py, takes its kept KV and its first forward feeds its last token),
                  or, with none waiting, the last running row moves into it (running rows stay
                  rows 0..A-1, so a forward reads a view of the cache, never a copy of it)

Why: a rollout that waits for its longest sample decodes its tail a few rows at a time, and a
decode forward of few rows costs nearly what a full one does (on a 2-core CPU, SmolLM2: 77 ms for
1 row, 399 ms for 64). Slots keep the rows full while samples wait. Once none wait, the rows that
left make room for draft tokens: a forward computes at most S row-positions (`draft_lengths`),
so speculation spends the capacity the tail leaves idle, not more.

The drafts (`Drafter`) come from the row's group: its siblings' tokens so far, the same prompt's
completions in earlier rollouts (`DraftHistory`), and its own: the continuation after the latest
earlier occurrence of the row's last few tokens (n-gram matching, as prompt-lookup decoding does).

Samples: token t of a sample is drawn from the sample's key at position t, from the logits after
its token t-1, whichever forward computed them and whoever its row-mates were; a draft is kept
only where it is that token. So the tokens are plain decoding's, and the log-probs too, up to
rounding: a verifying forward computes several positions of a row at once, and a row attends over
masked columns past its own, which can round a logit differently than a one-token step does
(tests/test_slots.py compares against `compact` bit for bit on tokens, log-probs to 1e-6).

The order of entry is fixed by data, never by timing: waiting samples whose prompt is expected
longest enter first (its earlier rollouts' mean length; else its siblings' that have ended; a
prompt with neither first of all), ties in row order.
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from distflow.config.errors import ConfigError
from distflow.rollout.decoding import Tally
from distflow.rollout.drafts import Drafter, DraftHistory
from distflow.rollout.engine import Request
from distflow.rollout.invariant import KEY_CHUNK
from distflow.rollout.kept_cache import kept_rows, row_cache
from distflow.rollout.prefill import prefill_prompts
from distflow.rollout.sampling import keyed_uniforms, sampled_logprob_B1, token_logprob_B1
from distflow.training.models import cache_kwargs

SLIDING_REFUSAL = (
    "rollout.compact.slots needs a model without sliding-window attention layers; set rollout.compact.slots=0"
)
"""Slots keep one cache layout for every layer: a sliding window's cache rolls (preflight.check_cache_layout
refuses such a model before any rank starts; the first slotted rollout refuses it too)."""


@torch.no_grad()
def decode_in_slots(
    model: torch.nn.Module,
    request: Request,
    num_slots: int,
    draft_tokens: int,
    history: DraftHistory | None = None,
):
    """The responses of `request` ([G·n, R], and log-probs with `request.logprobs`, as `decoding.decode`)
    decoded through `num_slots` rows, each verifying up to `draft_tokens` drafts a forward; and the
    rollout's `RolloutStats`. `history`: earlier rollouts' completions by prompt (drafts, order of entry),
    updated with this one's."""
    run = _Rollout(model, request, num_slots, draft_tokens, history)
    run.decode()
    if history is not None:
        history.add(run.prompt_keys, run.tokens, request.n)
    out = run.response_BR if run.logp_BR is None else (run.response_BR, run.logp_BR)
    return out, run.tally.stats()


def draft_lengths(num_running: int, num_slots: int, draft_tokens: int) -> int:
    """How many drafts each running row may verify in a forward: the row-positions of a forward stay
    within `num_slots` (a full batch decodes without drafts; the tail's idle rows carry them).

    >>> [draft_lengths(a, 64, 4) for a in (64, 33, 32, 16, 13, 12, 1)]
    [0, 0, 1, 3, 3, 4, 4]
    """
    return max(0, min(draft_tokens, num_slots // max(num_running, 1) - 1))


class _SlotLayer(CacheLayerMixin):
    """One layer's keys and values for S rows, each written at its own columns (`_SlotCache.at`); a forward
    attends over a view of the running rows' columns [first, end)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: _SlotCache, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.slots, self.keys, self.values, self.is_initialized = cache, keys, values, True

    def lazy_initialization(self, key_states, value_states) -> None:  # laid out at construction
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        rows_Aq, columns_Aq, num_rows, first, end = self.slots.where
        self.keys[rows_Aq, :, columns_Aq] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[rows_Aq, :, columns_Aq] = value_states.transpose(1, 2).to(self.values.dtype)
        return self.keys[:num_rows, :, first:end], self.values[:num_rows, :, first:end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots.where[4] - self.slots.where[3], 0

    def get_seq_length(self) -> int:
        return self.slots.where[4] - self.slots.where[3] - self.slots.where[0].shape[1]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class _SlotCache(Cache):
    """The rows' KV cache: a `_SlotLayer` a model layer, laid out like `like`'s (each layer's keys and values,
    [..., heads, positions, head size]: their dtypes, heads, head size), `columns` wide."""

    def __init__(self, like, num_slots: int, columns: int) -> None:
        layers = []
        for keys_like, values_like in like:
            keys = keys_like.new_zeros(num_slots, keys_like.shape[-3], columns, keys_like.shape[-1])
            values = values_like.new_zeros(num_slots, values_like.shape[-3], columns, values_like.shape[-1])
            layers.append(_SlotLayer(self, keys, values))
        super().__init__(layers=layers)
        self.where: tuple = ()

    def at(self, rows_Aq: torch.Tensor, columns_Aq: torch.Tensor, first: int, end: int) -> None:
        """The next forward writes its [A, q] positions at these rows and columns, and attends over the first
        A rows' columns [first, end)."""
        self.where = (rows_Aq, columns_Aq, rows_Aq.shape[0], first, end)

    def enter(self, row: int, sources, end: int) -> None:
        """Row `row` starts a sample: `sources`' keys and values (each layer's, [heads, L, head size]) in the L
        columns before `end` (the columns left of them are masked)."""
        for mine, (keys, values) in zip(self.layers, sources, strict=True):
            mine.keys[row, :, end - keys.shape[1] : end] = keys
            mine.values[row, :, end - values.shape[1] : end] = values

    def move(self, source: int, target: int, columns: int) -> None:
        for layer in self.layers:
            layer.keys[target, :, :columns] = layer.keys[source, :, :columns]
            layer.values[target, :, :columns] = layer.values[source, :, :columns]


class _Rollout:
    """One rollout's state: the samples' tokens on the host (for drafts), the responses on the device, the
    rows and what each holds, and the counts of `RolloutStats`."""

    def __init__(self, model, request: Request, num_slots: int, draft_tokens: int, history: DraftHistory | None):
        ids_GP, mask_GP = request.prompt_ids_GP, request.prompt_mask_GP
        self.model, self.request, self.device = model, request, ids_GP.device
        (G, P), n, R = ids_GP.shape, request.n, request.max_new_tokens
        self.width, self.n, self.R, self.num_rows = P, n, R, G * n
        self.num_slots, self.draft_tokens = max(1, min(num_slots, self.num_rows)), draft_tokens
        self.stop = set(request.stop_ids)
        self.prompt_len_G = mask_GP.sum(-1)
        self.last_prompt_G = ids_GP[:, -1].tolist()  # a kept row's first forward feeds its prompt's last token
        self.prompt_mask_GP = mask_GP.bool()
        self.prompt_keys = [tuple(ids[m.bool()].tolist()) for ids, m in zip(ids_GP, mask_GP, strict=True)]
        earlier = [history.completions(p) if history is not None else [] for p in self.prompt_keys]
        self.expected_G = [sum(map(len, e)) / len(e) if e else None for e in earlier]
        self.ended_G: list[list[int]] = [[] for _ in earlier]  # each prompt's ended samples' lengths
        self.drafters = [Drafter(e) for e in earlier]
        self.tokens: list[list[int]] = [[] for _ in range(self.num_rows)]
        for b, tokens in enumerate(self.tokens):
            self.drafters[b // n].add_sample(b, tokens)
        self.response_BR = torch.full((self.num_rows, R), request.pad_id, dtype=torch.long, device=self.device)
        self.logp_BR = torch.zeros(self.response_BR.shape, device=self.device) if request.logprobs else None
        self.uniforms_BR = (
            None if request.keys_B is None else keyed_uniforms(request.keys_B, R, request.offsets_B).float()
        )
        self.tally = Tally()

    def decode(self) -> None:
        self._start()
        waiting = [b for b in range(self.num_rows) if not self._ended(b)]
        self.tally.capacity = min(self.num_slots, len(waiting))  # full: every slot a sample can take, running
        self.rows: list[int] = []  # row a holds sample rows[a]
        self.next_t: list[int] = []  # and has drawn its first next_t[a] tokens
        self._fill(waiting)
        while self.rows:
            done = self._forward()
            self._leave(done, waiting)
        del self.cache, self.prefill

    def _start(self) -> None:
        """The fresh prompts prefilled (the distinct ones, once) and their samples' token 0 drawn; a kept row
        (`request.caches`) draws its next token in its first forward, fed its prompt's last token. The slots
        are laid out like the prefill's cache, or with every prompt kept, like a kept one."""
        request, caches = self.request, self.request.caches
        kept = set(kept_rows(request, caches)) if caches is not None else set()
        fresh = [g for g in range(len(self.prompt_keys)) if g not in kept]
        distinct = self._map_distinct(fresh)
        self.prefill = None
        if fresh:
            ids_FP, mask_FP = request.prompt_ids_GP[distinct], request.prompt_mask_GP[distinct]
            # Beside kept rows (whose rows are long) the fresh prompts are prefilled at their own widest width.
            width = int(mask_FP.sum(-1).max()) if caches is not None else self.width
            self.prefill, logits_FV = prefill_prompts(self.model, ids_FP[:, -width:], mask_FP[:, -width:])
            if _sliding(self.prefill):
                raise ConfigError(SLIDING_REFUSAL)
            self._first_tokens(fresh, logits_FV)
            del logits_FV
            if caches is not None:  # a sample capped at its first token leaves its prompt's cache (n = 1)
                for g in fresh:
                    self._leave_cache(g, self.prefill.layers, self.fresh_of[g], width, width)
        like = [(layer.keys, layer.values) for layer in self.prefill.layers] if fresh else caches.given[min(kept)]
        self.cache = _SlotCache(like, self.num_slots, self.width + self.R + self.draft_tokens)

    def _map_distinct(self, fresh: list[int]) -> list[int]:
        """Each fresh prompt's row in the prefill (`fresh_of`): a prompt that comes several times is prefilled
        once (partial rollouts send a fresh group's samples as copies of its prompt); the first prompt of each
        distinct one, in order."""
        self.fresh_of: dict[int, int] = {}
        row_of: dict[tuple, int] = {}
        firsts = []
        for g in fresh:
            if self.prompt_keys[g] not in row_of:
                row_of[self.prompt_keys[g]] = len(firsts)
                firsts.append(g)
            self.fresh_of[g] = row_of[self.prompt_keys[g]]
        return firsts

    def _first_tokens(self, fresh: list[int], logits_FV: torch.Tensor) -> None:
        """The fresh prompts' samples' token 0, from their prompt's last logits (one draw for all those rows, as
        `decode`'s)."""
        rows = [b for g in fresh for b in range(g * self.n, (g + 1) * self.n)]
        rows_N = torch.tensor(rows, device=self.device)
        source_N = torch.tensor([self.fresh_of[b // self.n] for b in rows], device=self.device)
        token_N1, logp_N1 = self._draw(
            logits_FV[source_N], None if self.uniforms_BR is None else self.uniforms_BR[rows_N, :1]
        )
        self.response_BR[rows_N, 0] = token_N1[:, 0]
        if self.logp_BR is not None:
            self.logp_BR[rows_N, 0] = logp_N1[:, 0]
        for b, token in zip(rows, token_N1[:, 0].tolist(), strict=True):
            self.tokens[b].append(token)
            self.drafters[b // self.n].grown(b, 0)
            if self._ended(b):
                self.ended_G[b // self.n].append(1)
        self.tally.ended(sum(map(len, self.ended_G)))

    def _draw(self, logits_NV: torch.Tensor, uniform_N1: torch.Tensor | None):
        request = self.request
        if uniform_N1 is None:
            token_N1 = logits_NV.argmax(dim=-1, keepdim=True)
            logp_N1 = (
                token_logprob_B1(logits_NV, token_N1, temperature=request.temperature) if request.logprobs else None
            )
            return token_N1, logp_N1
        return sampled_logprob_B1(logits_NV, uniform_N1, temperature=request.temperature, top_p=request.top_p)

    def _ended(self, b: int) -> bool:
        tokens = self.tokens[b]
        return len(tokens) >= self.R or (bool(tokens) and tokens[-1] in self.stop)

    def _priority(self, b: int) -> tuple:
        """Longest expected first: the prompt's earlier rollouts' mean length, else its ended samples' mean
        length, else first of all (nothing says it is short); ties in row order."""
        g = b // self.n
        expected = self.expected_G[g]
        if expected is None:
            ended = self.ended_G[g]
            expected = sum(ended) / len(ended) if ended else math.inf
        return (-expected, b)

    def _fill(self, waiting: list[int]) -> None:
        """Rows after the running ones take waiting samples while rows are free."""
        if waiting and len(self.rows) < self.num_slots:
            waiting.sort(key=self._priority, reverse=True)  # the first to enter last: popped from the end
        while waiting and len(self.rows) < self.num_slots:
            b = waiting.pop()
            self._enter(len(self.rows), b)
            self.rows.append(b)
            self.next_t.append(len(self.tokens[b]))

    def _enter(self, a: int, b: int) -> None:
        """Row a takes sample b: its prompt's prefill in the columns before `width`, or its kept cache in those
        before `width - 1` (its prompt's last token, which its first forward feeds, takes column width - 1)."""
        g = b // self.n
        if g in self.fresh_of:
            u = self.fresh_of[g]
            self.cache.enter(a, [(layer.keys[u], layer.values[u]) for layer in self.prefill.layers], self.width)
        else:
            self.cache.enter(a, self.request.caches.given[g], self.width - 1)

    def _forward(self) -> list[int]:
        """One forward of the running rows, each with its drafts; the rows whose sample ended."""
        A = len(self.rows)
        k = draft_lengths(A, self.num_slots, self.draft_tokens)
        drafts = [self._drafts(a, k) for a in range(A)] if k else [[] for _ in range(A)]
        q = 1 + max(map(len, drafts))
        last = [self.tokens[b][-1] if self.tokens[b] else self.last_prompt_G[b // self.n] for b in self.rows]
        inputs = [[last[a], *d] + [last[a]] * (q - 1 - len(d)) for a, d in enumerate(drafts)]
        offsets_q = torch.arange(q, device=self.device)
        next_A = torch.tensor(self.next_t, device=self.device)
        columns_Aq = self.width + next_A.unsqueeze(1) - 1 + offsets_q  # token next_t - 1 + i at its own column
        prompts_A = torch.tensor([b // self.n for b in self.rows], device=self.device)
        positions_Aq = self.prompt_len_G[prompts_A].unsqueeze(1) + columns_Aq - self.width
        end = int(columns_Aq[:, -1].max()) + 1
        # Prompts are left-padded to `width`: no running row attends left of the longest running one's first
        # column (the widest rows may have ended or not entered yet), so the forward's columns start there,
        # rounded down to whole KEY_CHUNKs: batch-invariant attention sums chunks counted from column 0, and
        # whole chunks of masked columns add exact zeros, so its bits stay those of a forward from column 0.
        first = (self.width - int(self.prompt_len_G[prompts_A].max())) // KEY_CHUNK * KEY_CHUNK
        self.cache.at(torch.arange(A, device=self.device).unsqueeze(1).expand(A, q), columns_Aq, first, end)
        out = self.model(
            input_ids=torch.tensor(inputs, device=self.device),
            attention_mask=self._mask(prompts_A, columns_Aq, first, end),
            position_ids=positions_Aq,
            **cache_kwargs(self.cache),
            use_cache=True,
        )
        logits_NV = out.logits.float().reshape(A * q, -1)
        at_Aq = (next_A.unsqueeze(1) + offsets_q).clamp(max=self.R - 1)  # the positions drawn
        rows_B = torch.tensor(self.rows, device=self.device)
        uniform_N1 = None
        if self.uniforms_BR is not None:
            uniform_N1 = self.uniforms_BR[rows_B.unsqueeze(1), at_Aq].reshape(A * q, 1)
        token_N1, logp_N1 = self._draw(logits_NV, uniform_N1)
        self.tally.forward(A, sum(map(len, drafts)))
        return self._keep(drafts, token_N1.view(A, q), None if logp_N1 is None else logp_N1.view(A, q))

    def _drafts(self, a: int, k: int) -> list[int]:
        b = self.rows[a]
        room = self.R - 1 - self.next_t[a]  # tokens drawn this forward stay below max_new_tokens
        return self.drafters[b // self.n].propose(b, min(k, room)) if room > 0 else []

    def _mask(self, prompts_A: torch.Tensor, columns_Aq: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """[A, 1, q, L] over columns [first, end): a row's query i sees its prompt's real columns and its own
        columns up to its own."""
        columns_L = torch.arange(first, end, device=self.device)
        mask_AqL = columns_L <= columns_Aq.unsqueeze(-1)
        prompt_AL = torch.ones(len(self.rows), end - first, dtype=torch.bool, device=self.device)
        prompt_AL[:, : self.width - first] = self.prompt_mask_GP[prompts_A, first:]
        return (mask_AqL & prompt_AL.unsqueeze(1)).unsqueeze(1)

    def _keep(self, drafts: list[list[int]], token_Aq: torch.Tensor, logp_Aq: torch.Tensor | None) -> list[int]:
        """Each row's drawn tokens up to its first draft that differs (that draw kept too), cut at a stop token or
        at max_new_tokens: written to the responses; the rows whose sample ended."""
        drawn = token_Aq.tolist()
        rows_N, columns_N, places_N, done = [], [], [], []
        for a, (b, d) in enumerate(zip(self.rows, drafts, strict=True)):
            tokens, start = self.tokens[b], self.next_t[a]
            for i, token in enumerate(drawn[a]):
                tokens.append(token)
                rows_N.append(b)
                columns_N.append(start + i)
                places_N.append(a * token_Aq.shape[1] + i)
                if self._ended(b) or i >= len(d) or token != d[i]:
                    break
            self.tally.accept(len(tokens) - start - 1)
            self.next_t[a] = len(tokens)
            self.drafters[b // self.n].grown(b, start)
            if self._ended(b):
                done.append(a)
                self.ended_G[b // self.n].append(len(tokens))
        self.tally.ended(len(done))
        places = torch.tensor(places_N, device=self.device)
        rows, columns = torch.tensor(rows_N, device=self.device), torch.tensor(columns_N, device=self.device)
        self.response_BR[rows, columns] = token_Aq.reshape(-1)[places]
        if self.logp_BR is not None:
            self.logp_BR[rows, columns] = logp_Aq.reshape(-1)[places]
        return done

    def _leave(self, done: list[int], waiting: list[int]) -> None:
        """Ended rows take waiting samples; with none waiting, the last running rows move into them."""
        for a in sorted(done, reverse=True):
            if self.request.caches is not None:
                self._leave_cache(self.rows[a], self.cache.layers, a, self.width, self.width + self.next_t[a] - 1)
            last = len(self.rows) - 1
            if a != last:
                self.cache.move(last, a, self.width + self.next_t[last])
                self.rows[a], self.next_t[a] = self.rows[last], self.next_t[last]
            self.rows.pop()
            self.next_t.pop()
        self._fill(waiting)

    def _leave_cache(self, b: int, layers, row: int, width: int, end: int) -> None:
        """Sample b stopped at max_new_tokens without a stop token: its cache row over its prompt (its last
        column width - 1) and tokens but the last (columns up to `end`) left in `request.caches`
        (rollout/kept_cache.py)."""
        tokens = self.tokens[b]
        if len(tokens) >= self.R and tokens[-1] not in self.stop:
            start = width - int(self.prompt_len_G[b // self.n])
            self.request.caches.left[b] = row_cache(layers, row, start, end)


def _sliding(prefill: DynamicCache) -> bool:
    """Whether the model has sliding-window attention layers (their cache rolls: not one of slots)."""
    return any(getattr(layer, "is_sliding", False) for layer in prefill.layers)
