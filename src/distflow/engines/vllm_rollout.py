"""The `vllm` rollout engine: each rank that rolls out owns an in-process vLLM engine.

    rank r (every rank rolls out: colocated)
    ┌──────────────────────────────────────────────────────────────────────────────────┐
    │ rollout model (the policy's module) ──named tensors──► vLLM model (reload)  │
    │   pushed before a rollout whenever a parameter changed since the last push        │
    │   (an optimizer step, a weight sync, a checkpoint load: tensors' version counters)│
    │ prompts (token ids) ──► LLM.generate, one request per sample, seed = f(key)       │
    │                     ◄── response token ids + each sampled token's log-prob        │
    └──────────────────────────────────────────────────────────────────────────────────┘

Invariants. The engine is made on first use with vLLM's V1 multiprocessing off
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so its model lives in this process and takes the policy's
tensors directly (as TRL's colocate mode does); it starts from dummy weights (`load_format=dummy`)
and gets the policy's before its first generation, so any model the policy holds (a warm-start,
a checkpoint, LoRA merged) is what it samples from, with no model directory read twice. vLLM
builds its process groups over torch's default group, so making the engine is a collective of the
whole world: every rank must make it at the same point, which is why `rollout.engine=vllm` needs
every rank to roll out (config.schema) and synchronous training. A push is local (no collective):
under fsdp2 it runs inside `gathered`, where every rank already holds the whole model.

Samples: each request's seed is derived from the sample's key (the same (seed, uid) key the other
engines draw from), so a sample does not depend on its rank or batch-mates; vLLM's sampler is not
distflow's keyed inverse-CDF sampler, so `vllm` samples differ from `compact`'s, and two vLLM runs
agree up to kernel numerics (a different batch composition can change a float rounding).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Iterator

import torch

SEED_MASK = 2**63 - 1
MAX_MODEL_LEN = 4096
"""The longest sequence an engine accepts (the model's own limit if smaller); the KV cache must hold one."""


def request_seed(key: int) -> int:
    """vLLM's per-request seed for a sample key (non-negative, 63 bits).

    >>> request_seed(5), request_seed(-1) == 2**63 - 1
    (5, True)
    """
    return key & SEED_MASK


def padded_responses(
    token_ids: list[list[int]], logprobs: list[list[float]] | None, *, width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(response ids [B, width] right-padded with `pad_id`, log-probs [B, width] with 0 after each row's
    end) from vLLM's per-request outputs; a row longer than `width` is cut.

    >>> ids, logp = padded_responses([[5, 2], [7]], [[-0.5, -0.25], [-1.0]], width=3, pad_id=0)
    >>> ids.tolist(), logp.tolist()
    ([[5, 2, 0], [7, 0, 0]], [[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0]])
    """
    ids_BR = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    logp_BR = torch.zeros((len(token_ids), width), dtype=torch.float32) if logprobs is not None else None
    for b, row in enumerate(token_ids):
        row = list(row)[:width]
        ids_BR[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        if logp_BR is not None:
            logp_BR[b, : len(row)] = torch.tensor(list(logprobs[b])[: len(row)], dtype=torch.float32)
    return ids_BR, logp_BR


def hf_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of every weight the inference model needs: a DDP wrapper's prefix
    dropped; under LoRA each adapted Linear's merged weight W + scale·B·A, adapters left out."""
    from distflow.engines.lora import is_lora

    model = getattr(model, "module", model)
    if not is_lora(model):
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    prefix = "base_model.model."
    merged = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            merged[f"{name}.base_layer.weight"] = module.base_layer.weight.detach() + delta
    for name, param in model.named_parameters():
        if model.base_model.prefix in name:  # lora_A / lora_B: inside the merged weights
            continue
        tensor = merged.get(name, param.detach())
        yield name.removeprefix(prefix).replace(".base_layer.", "."), tensor


def _version(model: torch.nn.Module) -> tuple:
    """Changes whenever any parameter is written in place or replaced (optimizer steps, syncs, loads)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _retie_lm_head(vllm_model: torch.nn.Module) -> None:
    """Point a tied LM head at the reloaded embedding again and redo its post-load processing:
    vLLM's layerwise reload gets no `lm_head` tensor for a tied model and puts back the head's old
    weight (its documented limit on tied parameters), which would leave the head at the first weights."""
    head = vllm_model.lm_head
    head.weight = vllm_model.model.embed_tokens.weight
    head.quant_method.process_weights_after_loading(head)


class VllmEngine:
    """One rank's vLLM engine for one rollout model, with that model's weights loaded."""

    def __init__(self, model: torch.nn.Module) -> None:
        from vllm import LLM

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: vLLM's CPU default (4) is much for a test box
        inner = getattr(model, "module", model)
        config = inner.get_base_model().config if hasattr(inner, "get_base_model") else inner.config
        dtype = next(inner.parameters()).dtype
        self._dir = tempfile.TemporaryDirectory(prefix="distflow-vllm-")
        config.save_pretrained(self._dir.name)  # the architecture only: weights come from the policy
        max_len = min(getattr(config, "max_position_embeddings", MAX_MODEL_LEN) or MAX_MODEL_LEN, MAX_MODEL_LEN)
        cuda = next(inner.parameters()).device.type == "cuda"
        extra = {"gpu_memory_utilization": 0.3, "enable_sleep_mode": False} if cuda else {}
        self.llm = LLM(
            model=self._dir.name,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=dtype,
            enforce_eager=not cuda,
            max_model_len=max_len,
            seed=0,
            generation_config="vllm",
            logprobs_mode="processed_logprobs",
            **extra,
        )
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self._loaded: tuple | None = None
        self.num_pushes = 0

    def push_if_changed(self, model: torch.nn.Module) -> bool:
        """Load `model`'s weights into the engine if they changed since the last push."""
        version = _version(model)
        if version == self._loaded:
            return False
        weights = [(name, tensor) for name, tensor in hf_named_weights(model)]
        # vLLM's in-place reload (checkpoint names, its own post-load processing: the CPU build repacks
        # linear weights after loading, so a bare `model.load_weights` no longer fits them).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.tied:
            self.llm.apply_model(_retie_lm_head)
        self._loaded = _version(model)
        self.num_pushes += 1
        return True

    def generate(
        self,
        prompt_rows: list[list[int]],
        *,
        samples_per_prompt: int,
        keys: list[int] | None,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        stop_ids: tuple[int, ...],
        logprobs: bool,
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Token ids (and log-probs) of sample k of prompt g at row g·n + k; greedy without `keys`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = samples_per_prompt
        prompts, params = [], []
        for g, row in enumerate(prompt_rows):
            for k in range(n):
                sampled = keys is not None
                params.append(
                    SamplingParams(
                        n=1,
                        max_tokens=max_new_tokens,
                        temperature=temperature if sampled else 0.0,
                        top_p=top_p if sampled else 1.0,
                        seed=request_seed(keys[g * n + k]) if sampled else None,
                        stop_token_ids=list(stop_ids),
                        ignore_eos=True,
                        detokenize=False,
                        logprobs=0 if logprobs else None,
                    )
                )
                prompts.append(TokensPrompt(prompt_token_ids=list(row)))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        token_ids = [list(out.outputs[0].token_ids) for out in outputs]
        if not logprobs:
            return token_ids, None
        logps = [
            [step[tok].logprob for tok, step in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)]
            for out in outputs
        ]
        return token_ids, logps


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(model: torch.nn.Module) -> VllmEngine:
    """This rank's engine for `model` (made on first use; see the module docstring), its weights current."""
    if model not in _ENGINES:
        _ENGINES[model] = VllmEngine(model)
    engine = _ENGINES[model]
    engine.push_if_changed(model)
    return engine


def vllm_responses(
    model: torch.nn.Module,
    prompt_ids_GP: torch.Tensor,
    prompt_mask_GP: torch.Tensor,
    keys_B: torch.Tensor | None,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: tuple[int, ...],
    pad_id: int,
    logprobs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`engines.generation`'s contract for `vllm`: response ids [G·n, max_new_tokens] (right-padded) and,
    with `logprobs`, each sampled token's log-prob under the engine (temperature applied)."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids_GP.cpu(), prompt_mask_GP.cpu(), strict=True)]
    keys = keys_B.tolist() if keys_B is not None else None
    token_ids, logps = engine_for(model).generate(
        rows,
        samples_per_prompt=n,
        keys=keys,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_ids=stop_ids,
        logprobs=logprobs,
    )
    ids_BR, logp_BR = padded_responses(token_ids, logps, width=max_new_tokens, pad_id=pad_id)
    device = prompt_ids_GP.device
    return ids_BR.to(device), logp_BR.to(device) if logp_BR is not None else None
