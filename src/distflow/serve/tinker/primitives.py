"""The training primitives, each a function of (served state, request) -> result.

Nothing here reads the clock, a thread or the network: the same state and the same requests in the
same order give the same results, which is what ranks serving one model in lockstep would need
(docs/features/tinker.md says what else that needs; today one process serves everything).

    create_model       a training model (LoRA of the request's rank, or rank 0: every weight)
    forward_backward   per datum: logits -> log-probs of its targets -> the named loss (losses.py),
                       summed; with backward, gradients accumulate until optim_step
    optim_step         AdamW with the request's settings (Tinker's AdamParams) over what accumulated
"""

from __future__ import annotations

import math

import torch

from distflow.serve.tinker import losses
from distflow.serve.tinker.state import ServedState, ServeError, TrainingModel, new_training_model
from distflow.serve.tinker.wire import FwdBwdRequest, FwdBwdResult, WireError
from distflow.training.token_logprobs import token_logprobs


def create_model(state: ServedState, body: dict) -> dict:
    session_id = state.check_session(body.get("session_id"))
    state.check_base_model(body.get("base_model"))
    lora = body.get("lora_config")
    rank = lora.get("rank", 0) if isinstance(lora, dict) else 0
    seed = lora.get("seed") if isinstance(lora, dict) else None
    if seed is not None and not isinstance(seed, int):
        raise ServeError(f"lora_config.seed must be an integer (got {seed!r})")
    optimizer = body.get("optimizer_config") or {"type": "adamw"}
    if optimizer.get("type") != "adamw":
        raise ServeError(f"optimizer {optimizer.get('type')!r} is not served (only adamw)")
    model_id = f"{session_id}:train:{body.get('model_seq_id')}"
    if model_id in state.models:
        raise ServeError(f"model {model_id!r} exists already (model_seq_id is reused)", status=400)
    state.models[model_id] = new_training_model(state, model_id, rank, state.seed if seed is None else seed)
    return {"model_id": model_id, "type": "create_model"}


def finish_session(state: ServedState, session_id: str) -> dict:
    """The SDK's ServiceClient.close: the session's models and samplers are dropped (their memory freed)."""
    state.check_session(session_id)
    state.sessions.discard(session_id)
    for table in (state.models, state.samplers):
        for key in [k for k in table if k.startswith(f"{session_id}:")]:
            del table[key]
    return {}


def get_info(state: ServedState, body: dict) -> dict:
    model = state.model(body.get("model_id"))
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {
            "arch": type(state.base).__name__,
            "model_name": state.base_model,
            "tokenizer_id": state.tokenizer_dir or None,
        },
        "is_lora": model.lora_rank > 0,
        "lora_rank": model.lora_rank or None,
        "model_name": state.base_model,
    }


def datum_logprobs(module: torch.nn.Module, tokens: list[int], targets_T: torch.Tensor) -> torch.Tensor:
    """logp_T: each position's target log-prob under the module (temperature 1), float32."""
    ids = torch.tensor([tokens], dtype=torch.long)
    logits = module(input_ids=ids).logits
    logp, _ = token_logprobs(logits, targets_T.reshape(1, -1).long())
    return logp.squeeze(0)


def _check_datum(state: ServedState, request: FwdBwdRequest, tokens: list[int], inputs: dict) -> torch.Tensor:
    vocab = state.base.config.vocab_size
    if not tokens:
        raise WireError("a datum has no input tokens")
    if len(tokens) > state.max_context:
        raise WireError(f"a datum of {len(tokens)} tokens is longer than the model's {state.max_context}")
    if "target_tokens" not in inputs:
        raise WireError("every datum needs loss_fn_inputs['target_tokens']")
    targets_T = inputs["target_tokens"].reshape(-1).long()
    if len(targets_T) != len(tokens):
        raise WireError(f"{len(targets_T)} target_tokens for {len(tokens)} input tokens (one per position)")
    if min(tokens) < 0 or max(tokens) >= vocab or targets_T.min() < 0 or targets_T.max() >= vocab:
        raise WireError(f"a token id is outside the vocabulary [0, {vocab})")
    losses.token_loss(request.loss_fn)(torch.zeros(len(tokens)), inputs, request.config)  # its inputs' checks
    return targets_T


def forward_backward(state: ServedState, request: FwdBwdRequest) -> FwdBwdResult:
    """The named loss of every datum, summed (`loss:sum`); unless `forward_only`, its gradient added to
    the model's. A datum is one forward pass of its own (no padding, so its values do not depend on its
    batch-mates). Everything is checked before the first backward: a refused request changes nothing."""
    model = state.model(request.model_id)
    loss_fn = losses.token_loss(request.loss_fn)
    if not request.data:
        raise WireError("forward_backward got no data")
    targets = [_check_datum(state, request, d.tokens, d.inputs) for d in request.data]
    outputs, total = [], 0.0
    for datum, targets_T in zip(request.data, targets, strict=True):
        with torch.set_grad_enabled(not request.forward_only):
            logp_T = datum_logprobs(model.module, datum.tokens, targets_T)
            loss_T, extra = loss_fn(logp_T, datum.inputs, request.config)
            loss = losses.summed(loss_T)
        if not request.forward_only:
            loss.backward()
        total += float(loss.detach())
        outputs.append({"logprobs": logp_T.detach().numpy(), **{k: v.numpy() for k, v in extra.items()}})
    if not request.forward_only:
        model.num_pending_backward += 1
    return FwdBwdResult(outputs=outputs, metrics={"loss:sum": total})


ADAM_FIELDS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
"""Tinker's AdamParams and its defaults (tinker/types/optimizer.py)."""


def adam_params(body: dict) -> dict[str, float]:
    params = body.get("adam_params", body.get("optim_params"))
    if not isinstance(params, dict):
        raise ServeError("optim_step needs adam_params (only the adamw optimizer is served)")
    unknown = sorted(set(params) - set(ADAM_FIELDS) - {"type"})
    if unknown or params.get("type", "adamw") != "adamw":
        raise ServeError(f"optim_step: unknown adam_params {unknown or [params.get('type')]}")
    values = {**ADAM_DEFAULTS, **{k: v for k, v in params.items() if k != "type"}}
    if not all(isinstance(v, int | float) and math.isfinite(v) for v in values.values()):
        raise ServeError("optim_step: adam_params must be finite numbers")
    return {k: float(v) for k, v in values.items()}


def optim_step(state: ServedState, body: dict) -> dict:
    """One AdamW step (torch.optim.AdamW, as Tinker's) over the gradients accumulated since the last."""
    model = state.model(body.get("model_id"))
    params = adam_params(body)
    if model.num_pending_backward == 0:
        raise ServeError(
            f"optim_step on {model.model_id!r} before any forward_backward: there are no gradients to step on; "
            "call forward_backward first"
        )
    return {"metrics": step(model, params)}


def step(model: TrainingModel, params: dict[str, float]) -> dict[str, float]:
    trained = [p for group in model.optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in trained if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    if params["grad_clip_norm"] > 0:
        torch.nn.utils.clip_grad_norm_(trained, params["grad_clip_norm"])
    for group in model.optimizer.param_groups:
        group.update(
            lr=params["learning_rate"],
            betas=(params["beta1"], params["beta2"]),
            eps=params["eps"],
            weight_decay=params["weight_decay"],
        )
    model.optimizer.step()
    model.optimizer.zero_grad(set_to_none=True)
    model.num_pending_backward = 0
    model.num_steps += 1
    return {"grad_norm": norm, "learning_rate": params["learning_rate"], "step": float(model.num_steps)}
