"""A model as its decode step reads it under autocast, with each linear layer's weights cast once a rollout.

    model (float32 weights) ──cast_view(model, bf16)──▶ view: the same modules' classes and attributes,
                                                          each nn.Linear's weight and bias a bf16 copy
                                                          (refreshed from the weights at every call),
                                                          every other parameter the model's own

Under autocast a linear layer casts its float32 weight to the compute dtype at every call. Eagerly,
autocast's cache makes that one cast per weight a region (`training.parallelize.autocast`); a CUDA
graph cannot use the cache (`rollout.graphed`), so a captured decode step would cast every weight at
every token: for a model whose decode reads its weights from memory, three times the traffic of the
bf16 weights alone (read float32, write bf16, read bf16). The view's copies are those casts, made once
a rollout: the same values autocast makes (a bf16 input passes autocast unchanged), so the view decodes
what the model decodes, bit for bit. The copies stay between rollouts, where a graph finds them (the
memory of one compute-dtype copy of the linear weights, which autocast's cache also holds during an
eager rollout). Embeddings and norms keep the model's own float32 parameters, as autocast leaves them.
"""

from __future__ import annotations

import weakref

import torch

from distflow.training.parallelize import module_view

_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model → {dtype: its view}: a view lives as long as its model, and holds no reference to it."""


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on this device's type in this thread, None where it is off."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def cast_view(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` with each nn.Linear's float32 weight and bias read from a copy in `dtype`, made now, and every
    other attribute the model's as they are now; the model itself where it has no such layer. One view (and
    one set of copies) per model and dtype."""
    views = _VIEWS.setdefault(model, {})
    modules = list(model.modules())
    if dtype not in views or [type(m) for m in views[dtype][0].modules()] != [type(m) for m in modules]:
        if not any(_cast_names(module) for module in modules):
            return model
        views[dtype] = (module_view(model), {})  # new, or the model's modules changed (adapters added)
    view, copies = views[dtype]
    with torch.no_grad():
        for original, mine in zip(modules, view.modules(), strict=True):
            children = mine._modules
            mine.__dict__.update(original.__dict__)  # its attributes now: `training`, an adapter switched off
            mine._modules, mine._parameters = children, dict(original._parameters)  # its parameters now
            for name in _cast_names(original):
                param = original._parameters[name]
                copy = copies.get((id(mine), name))
                if copy is None or copy.shape != param.shape or copy.device != param.device:
                    copy = copies[id(mine), name] = torch.empty_like(param, dtype=dtype, requires_grad=False)
                copy.copy_(param)  # autocast's cast: round to nearest even
                mine._parameters[name] = copy
    return view


def _cast_names(module: torch.nn.Module) -> list[str]:
    """The parameters of `module` that autocast casts at each call and the view holds cast: a plain linear
    layer's float32 weight and bias (a subclass may read them otherwise than through F.linear)."""
    if type(module) is not torch.nn.Linear:
        return []
    return [name for name, p in module._parameters.items() if p is not None and p.dtype == torch.float32]
