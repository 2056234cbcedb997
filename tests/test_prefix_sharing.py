"""Shared-prefix passes (training/prefix_sharing.py) give the padded pass's log-probs, values and gradients."""

import copy
import json

import pytest
import torch
from conftest import REPO, run_cli
from transformers import Qwen2Config, Qwen2ForCausalLM

from distflow.config import ConfigError, load_config
from distflow.data.batch import Batch
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer
from distflow.training.critic import ValueModel, response_values
from distflow.training.logprobs import batch_logprobs, response_logprobs
from distflow.training.models import cache_kwargs
from distflow.training.parallelize import checkpoint_blocks
from distflow.training.prefix_sharing import (
    distinct_prompts,
    length_buckets,
    prompt_rows,
    response_lengths,
    shared_prefix_outputs,
)
from distflow.training.sequences import left_pad, position_ids_from_mask, response_mask_from_ids

EOS, PAD = 2, 0


def _groups(seed: int = 0, prompts: int = 5, n: int = 4, response_width: int = 7):
    """Groups of n samples of prompts of 2-9 tokens (left-padded), the rows shuffled and one prompt
    alone; responses ending at an EOS at different columns or running to the end."""
    g = torch.Generator().manual_seed(seed)
    distinct = [
        torch.randint(3, 21, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
        for _ in range(prompts)
    ]
    rows = [p for p in distinct[:-1] for _ in range(n)] + [distinct[-1]]
    order = torch.randperm(len(rows), generator=g).tolist()
    ids_BP, mask_BP = left_pad([rows[i] for i in order], PAD)
    response_BR = torch.randint(3, 21, (len(rows), response_width), generator=g)
    for b in range(len(rows)):
        end = int(torch.randint(0, response_width + 2, (1,), generator=g))
        if end < response_width:
            response_BR[b, end] = EOS
    response_mask_BR = response_mask_from_ids(response_BR, EOS)
    response_BR = torch.where(response_mask_BR.bool(), response_BR, PAD)
    return torch.cat([ids_BP, response_BR], 1), torch.cat([mask_BP, response_mask_BR], 1), response_mask_BR


def test_distinct_prompts_maps_every_row_to_its_prompt():
    ids = torch.tensor([[0, 5, 6, 9, 9], [7, 7, 7, 1, 2], [0, 5, 6, 3, 0], [0, 7, 7, 4, 4]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1]])
    prompt_ids, prompt_mask, index = distinct_prompts(ids, mask, response_width=2)
    assert prompt_ids.shape == (3, 3)  # rows 0 and 2 share [pad 5 6]; [7 7 7] and [pad 7 7] differ
    for b in range(4):
        assert prompt_ids[index[b]].tolist() == ids[b, :3].tolist()
        assert prompt_mask[index[b]].tolist() == mask[b, :3].tolist()
    assert index[0] == index[2] and len({int(index[1]), int(index[3]), int(index[0])}) == 3


def test_a_prompts_rows_sum_their_gradients_one_after_another():
    # A cached prompt's keys at SmolLM2's shape, shared by 10 samples: large enough that a CPU splits
    # the work between threads (4 here, whatever the suite's worker has). Indexing's backward then adds
    # a prompt's rows in whichever order the threads reach them; the gradient must be each prompt's
    # samples added in order, every time.
    torch.manual_seed(0)
    index_B = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 1, 2])  # each prompt's rows in both halves of the batch
    keys_U = torch.randn(4, 3, 48, 64, requires_grad=True)
    grad_B = torch.randn(10, 3, 48, 64) * torch.logspace(0, 6, 10).view(10, 1, 1, 1)  # sums that round
    expected_U = torch.zeros_like(keys_U)
    for b, u in enumerate(index_B.tolist()):
        expected_U[u] += grad_B[b]
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for _ in range(20):
            rows_B = prompt_rows(keys_U, index_B)
            assert torch.equal(rows_B, keys_U[index_B])
            (gradient_U,) = torch.autograd.grad(rows_B, keys_U, grad_B)
            assert torch.equal(gradient_U, expected_U)
    finally:
        torch.set_num_threads(threads)


def test_response_lengths_count_to_the_last_attended_column():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])  # row 2: a hole (an observation)
    assert response_lengths(mask).tolist() == [3, 0, 3, 4]


def test_length_buckets_split_where_padding_is_saved_and_only_there():
    equal = length_buckets(torch.full((32,), 8))
    assert [(rows.tolist(), longest) for rows, longest in equal] == [(list(range(32)), 8)]
    spread = torch.randperm(128, generator=torch.Generator().manual_seed(0)) % 64 + 1  # lengths 1..64, twice each
    buckets = length_buckets(spread)
    assert [longest for _, longest in buckets] == [64, 48, 32, 16]  # four quarters, longest first
    assert sorted(int(b) for rows, _ in buckets for b in rows) == list(range(128))  # every row once
    for rows, longest in buckets:
        assert int(spread[rows].max()) == longest
    computed = sum(len(rows) * longest for rows, longest in buckets)
    assert computed == 32 * (64 + 48 + 32 + 16) < 128 * 64  # 5,120 columns instead of 8,192
    # a split saving under 3% of the one-bucket columns is not worth a forward call
    assert len(length_buckets(torch.tensor([10] * 99 + [1]))) == 1
    assert len(length_buckets(torch.tensor([10] * 90 + [1] * 10))) == 2
    assert len(length_buckets(spread, max_buckets=2)) == 2


def test_logprobs_entropies_loss_and_gradients_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups()
    valid = response_mask.bool()
    results = {}
    for shared in (False, True):
        model.zero_grad()
        logp, entropy = response_logprobs(
            model,
            ids,
            mask,
            response_mask.shape[1],
            temperature=0.7,
            with_entropy=True,
            entropy_grad=True,
            shared_prefix=shared,
        )
        loss = ((logp + 0.1 * entropy) * response_mask).sum() / response_mask.sum()
        loss.backward()
        results[shared] = (logp[valid], entropy[valid], loss, [p.grad.clone() for p in model.parameters()])
    (logp_a, ent_a, loss_a, grads_a), (logp_b, ent_b, loss_b, grads_b) = results[False], results[True]
    assert (logp_a - logp_b).abs().max() <= 1e-6
    assert (ent_a - ent_b).abs().max() <= 1e-6
    assert abs(loss_a.item() - loss_b.item()) <= 1e-6
    assert all(g.abs().max() > 0 for g in grads_a)  # every parameter gets a gradient, prompt-only rows too
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert (grad_a - grad_b).abs().max() <= 1e-6 * max(1.0, grad_a.abs().max().item())


def test_with_a_gradient_the_tokens_are_embedded_once_per_pass():
    """One embedding call makes one dense [V, D] gradient in the backward, not one per forward call; without a
    gradient the model embeds its own ids. The values and gradients are the padded pass's (the test above)."""
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups()
    embedded = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(tuple(args[0].shape)))
    logp, _ = response_logprobs(model, ids, mask, response_mask.shape[1], shared_prefix=True)
    assert embedded == [tuple(ids.shape)]
    embedded.clear()
    with torch.no_grad():
        again, _ = response_logprobs(model, ids, mask, response_mask.shape[1], shared_prefix=True)
    assert len(embedded) > 2  # the prompt pass, then each length bucket's
    assert torch.equal(again, logp.detach())  # the same embeddings, gathered or looked up


def test_each_distinct_prompt_goes_through_the_model_once():
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups(prompts=5, n=4)  # 4 groups of 4 and one prompt alone: 17 rows, 5 prompts
    calls = []

    def forward(ids, mask, positions, cache, keep):
        calls.append((tuple(ids.shape), cache is not None, keep))
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(cache),
            use_cache=cache is not None,
        ).logits

    shared_prefix_outputs(forward, model.config, ids, mask, response_mask.shape[1])
    width = ids.shape[1] - response_mask.shape[1]
    assert calls[0] == ((5, width), True, True)  # the prompts, once each
    lengths = response_mask.sum(1).tolist()
    buckets = length_buckets(response_mask.sum(1))
    # then the responses, each length bucket's rows up to its longest response but one token
    assert calls[1:] == [((len(rows), longest - 1), True, False) for rows, longest in buckets if longest > 1]
    assert sorted(int(b) for rows, _ in buckets for b in rows) == list(range(17))
    assert sum(len(rows) * (longest - 1) for rows, longest in buckets if longest > 1) < 17 * (max(lengths) - 1)
    calls.clear()
    # rows of three different prompts: nothing to share, one padded pass
    index = distinct_prompts(ids, mask, response_mask.shape[1])[2]
    lone = [int((index == u).nonzero()[0]) for u in range(3)]
    shared_prefix_outputs(forward, model.config, ids[lone], mask[lone], response_mask.shape[1])
    assert calls == [((3, ids.shape[1]), False, response_mask.shape[1] + 1)]  # the last R + 1 columns' outputs


def test_on_a_gpu_the_passes_run_padded_in_one_call(monkeypatch):
    """A second forward call costs a GPU its kernel launches whatever its columns (`shares_prefixes`):
    there the passes run padded, with the padded pass's outputs; on a CPU the prompts are shared."""
    from distflow.training import prefix_sharing

    assert prefix_sharing.shares_prefixes(torch.device("cpu"))
    assert not prefix_sharing.shares_prefixes(torch.device("cuda"))
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups(prompts=4, n=4)
    calls = []

    def forward(ids, mask, positions, cache, keep):
        calls.append((tuple(ids.shape), cache is not None))
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache)).logits

    shared = shared_prefix_outputs(forward, model.config, ids, mask, response_mask.shape[1])
    assert len(calls) >= 2 and calls[0][1]  # the prompt pass, then the responses over its cache
    calls.clear()
    monkeypatch.setattr(prefix_sharing, "shares_prefixes", lambda device: False)
    for lockstep in (False, True):  # in lockstep too: every rank, on the same device, makes the one call
        padded = shared_prefix_outputs(forward, model.config, ids, mask, response_mask.shape[1], lockstep=lockstep)
        assert calls == [(tuple(ids.shape), False)]
        calls.clear()
        valid = response_mask.bool()
        assert (padded[valid] - shared[valid]).abs().max() <= 1e-5
    # passes.shared_prefix=true set by the user: the prompts are shared there too (None follows the device).
    again = shared_prefix_outputs(forward, model.config, ids, mask, response_mask.shape[1], follow_device=False)
    assert len(calls) >= 2 and calls[0][1] and torch.equal(again, shared)


def test_in_lockstep_every_call_makes_the_same_two_forward_calls():
    """Under fsdp2 training each forward is a collective: a micro-batch of shared prompts, one of
    distinct prompts and a one-row zero-gradient pass must make the same calls on every rank."""
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups(prompts=5, n=4)
    width = response_mask.shape[1]
    index = distinct_prompts(ids, mask, width)[2]
    lone = [int((index == u).nonzero()[0]) for u in range(3)]
    for rows in (list(range(17)), lone, lone[:1]):
        calls = []

        def forward(ids, mask, positions, cache, keep, calls=calls):
            calls.append((tuple(ids.shape), cache is not None, keep))
            return model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(cache),
                use_cache=cache is not None,
            ).logits

        out = shared_prefix_outputs(forward, model.config, ids[rows], mask[rows], width, lockstep=True)
        distinct = len(set(index[rows].tolist()))
        # the prompts (keeping the cache), then every response at full width
        assert calls == [((distinct, ids.shape[1] - width), True, True), ((len(rows), width), True, False)]
        padded = model(
            input_ids=ids[rows], attention_mask=mask[rows], position_ids=position_ids_from_mask(mask[rows])
        ).logits[:, -width - 1 : -1]
        valid = response_mask[rows].bool()
        assert (out[valid] - padded[valid]).abs().max() <= 1e-5


def test_values_and_their_gradients_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=4)
    values = ValueModel(copy.deepcopy(model.base_model), model.config.hidden_size)
    torch.nn.init.normal_(values.value_head.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    ids, mask, response_mask = _groups(seed=1)
    valid = response_mask.bool()
    results = {}
    for shared in (False, True):
        values.zero_grad()
        out = response_values(values, ids, mask, response_mask.shape[1], shared_prefix=shared)
        (out.pow(2) * response_mask).sum().backward()
        results[shared] = (out[valid], [p.grad.clone() for p in values.parameters()])
    (padded, grads_a), (shared, grads_b) = results[False], results[True]
    assert (padded - shared).abs().max() <= 1e-6 * padded.abs().max()  # values of up to ~9
    for grad_a, grad_b in zip(grads_a, grads_b, strict=True):
        assert (grad_a - grad_b).abs().max() <= 1e-5 * max(1.0, grad_a.abs().max().item())


def test_batch_logprobs_in_micro_batches_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=5)
    ids, mask, response_mask = _groups(seed=2)
    batch = Batch({"input_ids": ids, "attention_mask": mask, "response_mask": response_mask})
    padded = batch_logprobs(model, batch, micro_batch_size=6, temperature=1.0)
    shared = batch_logprobs(model, batch, micro_batch_size=6, temperature=1.0, shared_prefix=True)
    valid = response_mask.bool()
    assert (padded[valid] - shared[valid]).abs().max() <= 1e-6


def test_with_activation_checkpointing_the_gradients_equal_the_padded_pass():
    """The decoder blocks recompute both passes in the backward: the write-once caches give the same
    keys and values again (an appending cache would grow and fail torch's recomputation check)."""
    ids, mask, response_mask = _groups(seed=3)
    grads = {}
    for shared in (False, True):
        model = build_tiny_model(build_char_tokenizer(), seed=6)
        checkpoint_blocks(model)
        logp, _ = response_logprobs(model, ids, mask, response_mask.shape[1], shared_prefix=shared)
        ((logp * response_mask).sum() / response_mask.sum()).backward()
        grads[shared] = [p.grad.clone() for p in model.parameters()]
    for grad_a, grad_b in zip(grads[False], grads[True], strict=True):
        assert (grad_a - grad_b).abs().max() <= 1e-6 * max(1.0, grad_a.abs().max().item())


def test_a_model_with_sliding_window_layers_runs_the_padded_pass_and_says_so():
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    ids, mask, response_mask = _groups(seed=4)
    padded = response_logprobs(model, ids, mask, response_mask.shape[1])[0]
    with pytest.warns(UserWarning, match="DynamicSlidingWindowLayer.*run padded"):
        shared = response_logprobs(model, ids, mask, response_mask.shape[1], shared_prefix=True)[0]
    assert torch.equal(padded, shared)


def test_auto_shares_prefixes_unless_the_passes_are_packed():
    assert load_config(None, []).passes.shared_prefix is None  # on where the device gains: shares_prefixes
    assert load_config(None, ["passes.padding_free=true"]).passes.shared_prefix is False
    assert load_config(None, ["passes.shared_prefix=false"]).passes.shared_prefix is False
    with pytest.raises(ConfigError, match="passes.shared_prefix=true and passes.padding_free=true"):
        load_config(None, ["passes.shared_prefix=true", "passes.padding_free=true"])


@pytest.mark.heavy  # two 2-rank CLI runs (~150 s); tests/test_fsdp2.py trains 2 ranks with it in the default suite
def test_a_cli_run_with_shared_prefix_logs_what_the_padded_run_logs(tmp_path, cache_dir):
    """The real CLI on 2 ranks, 3 steps: the same rewards, and training metrics equal to float rounding."""
    rows = {}
    for shared in ("false", "true"):  # true: the default
        result = run_cli(
            "train",
            str(REPO / "examples/arith_grpo.yaml"),
            f"passes.shared_prefix={shared}",
            "trainer.total_steps=3",
            "trainer.prompts_per_step=4",
            "rollout.num_samples=4",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint.every=0",
            "checkpoint.at_end=false",
            f"warmstart.cache_dir={cache_dir}",
            f"trainer.output_dir={tmp_path}",
            f"trainer.run_name=shared_{shared}",
            "--nproc",
            "2",
            cwd=tmp_path,
            timeout=1800,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (tmp_path / f"shared_{shared}" / "metrics.jsonl").read_text().splitlines()
        rows[shared] = [json.loads(line) for line in lines if json.loads(line)["step"] >= 1]
    assert len(rows["true"]) == len(rows["false"]) == 3
    for want, got in zip(rows["false"], rows["true"], strict=True):
        assert got["reward/mean"] == want["reward/mean"] and got["tokens/generated"] == want["tokens/generated"]
        for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_the_lora_reference_passes_with_shared_prefixes_as_the_policy_does():
    """The reference under LoRA (the policy, adapters off) runs the policy's pass mode: its
    shared-prefix log-probs equal its padded ones and the base model's."""
    from distflow.config.model import LoraConfig
    from distflow.training.lora import AdaptersOff, apply_lora

    base = build_tiny_model(build_char_tokenizer(), seed=5)
    reference = AdaptersOff(apply_lora(copy.deepcopy(base), LoraConfig(rank=4), seed=1))
    ids, mask, response_mask = _groups(seed=3)
    batch = Batch({"input_ids": ids, "attention_mask": mask, "response_mask": response_mask})
    shared = batch_logprobs(reference, batch, micro_batch_size=6, temperature=1.0, shared_prefix=True)
    padded = batch_logprobs(reference, batch, micro_batch_size=6, temperature=1.0)
    of_base = batch_logprobs(base, batch, micro_batch_size=6, temperature=1.0)
    valid = response_mask.bool()
    assert (shared[valid] - padded[valid]).abs().max() <= 1e-6
    assert (padded[valid] - of_base[valid]).abs().max() <= 1e-6
