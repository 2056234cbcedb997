"""Shared-prefix passes (engines/prefix_sharing.py) give the padded pass's log-probs, values and gradients."""

import copy
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import REPO, run_cli
from distflow.config import ConfigError, load_config
from distflow.engines.critic import ValueModel, response_values
from distflow.engines.logprobs import batch_logprobs, response_logprobs
from distflow.engines.parallelize import checkpoint_blocks
from distflow.engines.prefix_sharing import distinct_prompts, shared_prefix_outputs
from distflow.engines.sequences import left_pad, response_mask_from_ids
from distflow.data.batch import Batch
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer

EOS, PAD = 2, 0


def _groups(seed: int = 0, prompts: int = 5, n: int = 4, response_width: int = 7):
    """Groups of n samples of prompts of 2-9 tokens (left-padded), the rows shuffled and one prompt
    alone; responses ending at an EOS at different columns or running to the end."""
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(3, 21, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
                for _ in range(prompts)]
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


def test_logprobs_entropies_loss_and_gradients_equal_the_padded_pass():
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups()
    valid = response_mask.bool()
    results = {}
    for shared in (False, True):
        model.zero_grad()
        logp, entropy = response_logprobs(model, ids, mask, response_mask.shape[1], temperature=0.7,
                                          with_entropy=True, entropy_grad=True, shared_prefix=shared)
        loss = ((logp + 0.1 * entropy) * response_mask).sum() / response_mask.sum()
        loss.backward()
        results[shared] = (logp[valid], entropy[valid], loss, [p.grad.clone() for p in model.parameters()])
    (logp_a, ent_a, loss_a, grads_a), (logp_b, ent_b, loss_b, grads_b) = results[False], results[True]
    assert (logp_a - logp_b).abs().max() <= 1e-6
    assert (ent_a - ent_b).abs().max() <= 1e-6
    assert abs(loss_a.item() - loss_b.item()) <= 1e-6
    assert all(g.abs().max() > 0 for g in grads_a)  # every parameter gets a gradient, prompt-only rows too
    for grad_a, grad_b in zip(grads_a, grads_b):
        assert (grad_a - grad_b).abs().max() <= 1e-6 * max(1.0, grad_a.abs().max().item())


def test_each_distinct_prompt_goes_through_the_model_once():
    model = build_tiny_model(build_char_tokenizer(), seed=3)
    ids, mask, response_mask = _groups(prompts=5, n=4)  # 4 groups of 4 and one prompt alone: 17 rows, 5 prompts
    calls = []

    def forward(ids, mask, positions, cache, last_only):
        calls.append((tuple(ids.shape), cache is not None, last_only))
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=cache is not None).logits

    shared_prefix_outputs(forward, model.config, ids, mask, response_mask.shape[1])
    width = ids.shape[1] - response_mask.shape[1]
    assert calls == [((5, width), True, True), ((17, response_mask.shape[1]), True, False)]
    calls.clear()
    # rows of three different prompts: nothing to share, one padded pass
    index = distinct_prompts(ids, mask, response_mask.shape[1])[2]
    lone = [int((index == u).nonzero()[0]) for u in range(3)]
    shared_prefix_outputs(forward, model.config, ids[lone], mask[lone], response_mask.shape[1])
    assert calls == [((3, ids.shape[1]), False, False)]


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
    for grad_a, grad_b in zip(grads_a, grads_b):
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
    for grad_a, grad_b in zip(grads[False], grads[True]):
        assert (grad_a - grad_b).abs().max() <= 1e-6 * max(1.0, grad_a.abs().max().item())


def test_a_model_with_sliding_window_layers_runs_the_padded_pass_and_says_so():
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    ids, mask, response_mask = _groups(seed=4)
    padded = response_logprobs(model, ids, mask, response_mask.shape[1])[0]
    with pytest.warns(UserWarning, match="DynamicSlidingWindowLayer.*run padded"):
        shared = response_logprobs(model, ids, mask, response_mask.shape[1], shared_prefix=True)[0]
    assert torch.equal(padded, shared)


def test_auto_shares_prefixes_unless_the_passes_are_packed():
    assert load_config(None, []).trainer.shared_prefix is True
    assert load_config(None, ["trainer.padding_free=true"]).trainer.shared_prefix is False
    assert load_config(None, ["trainer.shared_prefix=false"]).trainer.shared_prefix is False
    with pytest.raises(ConfigError, match="trainer.shared_prefix=true and trainer.padding_free=true"):
        load_config(None, ["trainer.shared_prefix=true", "trainer.padding_free=true"])


@pytest.mark.slow  # two 2-rank CLI runs (~75 s); tests/test_fsdp2.py trains 2 ranks with it in the default suite
def test_a_cli_run_with_shared_prefix_logs_what_the_padded_run_logs(tmp_path, cache_dir):
    """The real CLI on 2 ranks, 3 steps: the same rewards, and training metrics equal to float rounding."""
    rows = {}
    for shared in ("false", "true"):  # true: the default
        result = run_cli("train", str(REPO / "examples/arith_grpo.yaml"), f"trainer.shared_prefix={shared}",
                         "trainer.total_steps=3", "trainer.prompts_per_step=4", "rollout.num_samples=4",
                         "trainer.eval_every=0", "trainer.progress_bar=false", "checkpoint.every=0",
                         "checkpoint.at_end=false", f"warmstart.cache_dir={cache_dir}", f"trainer.output_dir={tmp_path}",
                         f"trainer.run_name=shared_{shared}", "--nproc", "2", cwd=tmp_path, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = (tmp_path / f"shared_{shared}" / "metrics.jsonl").read_text().splitlines()
        rows[shared] = [json.loads(line) for line in lines if json.loads(line)["step"] >= 1]
    assert len(rows["true"]) == len(rows["false"]) == 3
    for want, got in zip(rows["false"], rows["true"]):
        assert got["reward/mean"] == want["reward/mean"] and got["tokens/generated"] == want["tokens/generated"]
        for key in ("train/pg_loss", "train/grad_norm", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
