"""Applies data parallelism to a model from the outside (the model file stays plain).

    parallel.strategy=ddp    every train rank: a full replica ──► DDP all-reduces the gradients
                             (after the last micro-batch only: `gradient_sync`)
    parallel.strategy=fsdp2  every train rank: 1/S of each parameter (a DTensor shard)
        forward/backward of decoder block i:  all-gather block i's shards ──► compute ──► free
                                              (`parallel.fsdp.reshard_after_forward`)
        last micro-batch's backward:          reduce-scatter the gradients (averaged, like DDP)
        HSDP (parallel.fsdp.shard_size = S < N): mesh [N/S replicas, S shards]; shards all-gather
                                              within a row, gradients reduce over the whole mesh

Invariants. Under ddp only the backward of the last micro-batch communicates (buffers are not
broadcast at each forward), so ranks may run different numbers of forward calls. Under fsdp2
every forward is a collective of the train group, so the train ranks
run the same number of forward/backward passes in an update (`TrainableEngine` pads a short
share with zero-loss passes, and shared-prefix passes run in lockstep: the same forward calls
whatever the rows) and every inference pass (generation, log-probs, values,
evaluation) runs inside `gathered(model)`: entered by every train rank
together, it all-gathers the whole model once and leaves each rank free to run its own
number of forwards (the rollout engines decode through `unsharded_view`: the same tensors, without
FSDP's hooks). Its cost is a full copy of the parameters (in `parallel.param_dtype`) on
every rank while inside, as DDP holds at all times; sharding still saves the gradients, the
optimizer state and the float32 master weights. The disaggregated weight sync needs no gathering:
each train rank sends its own (float32) shard (sync/weight_shares.py). A world of one has
nothing to shard: both strategies leave the model plain there, except fsdp2 computing below
float32 (`parallel.param_dtype`), which shards over a one-rank group to keep a float32 master
copy beside its compute dtype (`shards`).

Below float32 without sharding (ddp, a rollout-only rank's copy), the model keeps float32
parameters and computes in `parallel.param_dtype` under `torch.autocast`: `autocast(model)`
around an optimizer step's forwards (its losses and backwards paused), and `gathered(model)` around
every inference pass, so that a step casts the weights once, not once per micro-batch (or per
block recomputed by activation checkpointing), and a rollout once (autocast's cache lives as long
as the outermost region), not once per decoded token (`graphed`, whose CUDA graphs cannot use that
cache, casts its linear layers' weights once a rollout itself: `rollout.cast_weights`).
Autocast is per thread: the agent endpoint's backend thread enters its own.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as checkpoint_activations
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map_only

from distflow.comm import Comm, join_group_of_one
from distflow.config import ConfigError
from distflow.config.parallel import ParallelConfig, bf16_kernels
from distflow.training import attention
from distflow.training.float32_head import Float32Head, float32_head_group
from distflow.training.heap import return_freed_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MESHES: dict[tuple, DeviceMesh] = {}
"""One device mesh per (train ranks, shard size): the policy, critic and reference share it
(making a 2-D mesh creates process groups, which every rank must do the same number of times)."""

_DDP_PARAMETERS = inspect.signature(DistributedDataParallel).parameters


def parallelize(model: torch.nn.Module, comm: Comm, parallel: ParallelConfig | None = None) -> torch.nn.Module:
    """The module that training forwards through: DDP's wrapper, or `model` itself, sharded in place
    (fsdp2). Activation checkpointing (if asked) wraps the decoder blocks first. A model sharded
    already (sharded loading shards before it allocates) is returned as it is."""
    parallel = parallel or ParallelConfig()
    compute_in(model, resolve_dtypes(parallel, comm.device)[0])
    if is_sharded(model):
        return model
    if parallel.activation_checkpointing:
        checkpoint_blocks(model)
    if shards(parallel, comm):
        return shard(model, comm, parallel)
    if not comm.distributed:
        return model
    device_ids = [comm.device.index] if comm.device.type == "cuda" else None
    # No buffer sync at forward: a DDP forward is then no collective, so ranks may make different
    # numbers of forward calls (shared-prefix passes split responses by length, per rank). A causal
    # LM's buffers are constants every rank computes alike at build time (rotary frequencies).
    # torch >= 2.13 calls it forward_sync_buffers (and deprecates broadcast_buffers, warning per wrap).
    no_forward_sync = (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_PARAMETERS else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(model, device_ids=device_ids, process_group=comm.group, **no_forward_sync)


def frozen_copy(model: torch.nn.Module, comm: Comm, parallel: ParallelConfig) -> torch.nn.Module:
    """A frozen copy of `model` (the reference policy), sharded like the policy under fsdp2 (with no
    optimizer: it only runs forwards, inside `gathered`). `model` must not be sharded yet."""
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    compute_in(frozen, resolve_dtypes(parallel, comm.device)[0])
    if shards(parallel, comm):
        shard(frozen, comm, parallel)
    return frozen


def shard(model: torch.nn.Module, comm: Comm, parallel: ParallelConfig) -> torch.nn.Module:
    """`fully_shard` each decoder block, a float32 head's group (`parallel.fp32_lm_head`), then the root (the rest)."""
    param_dtype, reduce_dtype = resolve_dtypes(parallel, comm.device)
    reshard = parallel.fsdp.reshard_after_forward
    options = dict(mesh=device_mesh(comm, parallel.fsdp.shard_size), reshard_after_forward=reshard)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in decoder_blocks(model):
        fully_shard(block, **options, mp_policy=policy)
    if head := float32_head_group(model, param_dtype):  # gathered in float32 (training/float32_head.py)
        fully_shard(head, **options, mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    fully_shard(model, **options, mp_policy=policy)
    model._distflow_reshard_after_forward = reshard  # restored after `gathered`
    return model


def shards(parallel: ParallelConfig, comm: Comm) -> bool:
    """Whether models are `fully_shard`ed: fsdp2 on several ranks, and on one rank when it computes
    below float32 (over a one-rank mesh, the shard the whole model), since FSDP2's mixed precision
    is what keeps the float32 master copy and casts for compute; the plain model would silently
    compute in float32."""
    if parallel.strategy != "fsdp2":
        return False
    return comm.distributed or resolve_dtypes(parallel, comm.device)[0] != torch.float32


def resolve_dtypes(parallel: ParallelConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype): `auto` is bfloat16 compute with float32 reduction on a CUDA device
    with bfloat16 kernels, float32 otherwise (`ParallelConfig.compute_dtype`)."""
    param = parallel.compute_dtype(bf16_device=bf16_kernels(device))
    reduce = "float32" if parallel.reduce_dtype == "auto" else parallel.reduce_dtype
    return DTYPES[param], DTYPES[reduce]


def compute_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Mark `model` to compute in `dtype` (`autocast`, `gathered`; float32: in its weights' dtype). On
    a CPU, at every dtype, its attention takes torch's fastest path there, in float32
    (training/attention.py)."""
    model._distflow_compute_dtype = dtype
    attention.use_for(model)


@contextlib.contextmanager
def autocast(
    model: torch.nn.Module | None, *, inference: bool = False
) -> Iterator[Callable[[], contextlib.AbstractContextManager]]:
    """Within it, this thread computes `model`'s forwards in its compute dtype (`compute_in`) over its
    float32 parameters: `torch.autocast`, whose cache casts each weight once per outermost region.
    Nothing for a float32 model, or a sharded one (FSDP2's mixed precision casts its parameters).

    It yields `paused`: `with paused():` computes in the tensors' own dtypes (a loss, a backward) and
    keeps the cache, so that one region can span every micro-batch of an optimizer step.

    autocast caches only the casts of weights that require a gradient. `inference` (every forward
    within runs without one: `gathered`'s passes) lets a frozen model's weights (a rollout-only
    rank's copy, LoRA's base) require one for the region, so that they too are cast once, not at
    every decoded token. A training region (forwards that need gradients: those weights must not get
    one) holds its frozen Linear weights in the compute dtype instead (`_frozen_linears_in`)."""
    model = getattr(model, "parameters_owner", model)
    dtype = getattr(model, "_distflow_compute_dtype", torch.float32)
    if model is None or dtype == torch.float32 or is_sharded(model):
        yield contextlib.nullcontext
        return
    device_type = next(model.parameters()).device.type
    frozen = [p for p in model.parameters() if inference and not p.requires_grad and p.is_floating_point()]
    for param in frozen:
        param.requires_grad_(True)
    try:
        with (
            contextlib.nullcontext() if inference else _frozen_linears_in(model, dtype),
            torch.autocast(device_type=device_type, dtype=dtype),
        ):
            # a nested disabled region keeps the cache: torch clears it when the outermost one exits
            yield functools.partial(torch.autocast, device_type=device_type, enabled=False)
    finally:
        for param in frozen:
            param.requires_grad_(False)


@contextlib.contextmanager
def _frozen_linears_in(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within it, `model`'s Linear layers hold their float32 weights (and biases) that require no gradient
    (LoRA's base) cast to `dtype`: what autocast would cast them to at every use, cast once. The Linear
    gets a cast copy and the parameter stays as it is, so a module that shares it (a tied embedding,
    which computes in its parameter's dtype) still reads float32, as does a float32 head
    (`parallel.fp32_lm_head`). The Linears hold their own again when it exits."""
    held = [
        (module, name, param)
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and not isinstance(module, Float32Head)
        for name, param in module.named_parameters(recurse=False)
        if not param.requires_grad and param.dtype == torch.float32
    ]
    cast: dict[int, torch.nn.Parameter] = {}  # one copy of a weight that several Linears share
    for module, name, param in held:
        if id(param) not in cast:
            cast[id(param)] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=False)
        module._parameters[name] = cast[id(param)]
    try:
        yield
    finally:
        for module, name, param in held:
            module._parameters[name] = param


def device_mesh(comm: Comm, shard_size: int) -> DeviceMesh:
    """The train group as a 1-D mesh, or as [replicas, shard_size] (HSDP, the world only)."""
    ranks = comm.global_ranks or tuple(range(comm.world_size))
    shard_size = shard_size or comm.world_size
    key = (ranks, shard_size, comm.device.type)
    if not comm.distributed:  # one process sharding alone
        join_group_of_one(comm.device)
    if key not in _MESHES:
        if shard_size == comm.world_size:
            group = comm.group if comm.group is not None else dist.group.WORLD
            _MESHES[key] = DeviceMesh.from_group(group, comm.device.type)
        else:
            if comm.group is not None:  # checked before launch (planner): this cannot happen
                raise AssertionError("HSDP needs the train group to be the world")
            _MESHES[key] = init_device_mesh(
                comm.device.type, (comm.world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
            )
    return _MESHES[key]


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a model: the classes its `_no_split_modules` names (any Hugging Face
    model, including a backbone inside another module), else the longest ModuleList of one class."""
    names = set()
    for module in model.modules():
        names |= set(getattr(module, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [
            m
            for m in model.modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(child) for child in m}) == 1
        ]
        blocks = list(max(lists, key=len)) if lists else []
    if not blocks:
        raise ConfigError(
            f"found no decoder blocks in {type(model).__name__} (no `_no_split_modules` classes, "
            "no ModuleList of repeated layers): parallel.activation_checkpointing needs them"
        )
    return blocks


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Make each decoder block recompute its activations in the backward (torch's composable
    `checkpoint`: hooks on the block, not a wrapper module, so parameter names do not change and
    checkpoints, the weight sync and `fully_shard` see the same model)."""
    for block in decoder_blocks(model):
        checkpoint_activations(block)


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def gradient_sync(wrapped: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
    """Within it, backward reduces gradients across ranks only if `enabled` (accumulate locally otherwise)."""
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if isinstance(wrapped, DistributedDataParallel) and not enabled:
        return wrapped.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients to `max_norm` in total; returns their norm before clipping, a plain tensor
    (over sharded gradients the norm is computed from every rank's shards: a collective)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


@contextlib.contextmanager
def gathered(model: torch.nn.Module | None) -> Iterator[None]:
    """Within it, an fsdp2 model holds its whole parameters on every rank, so each rank may run any
    number of forward passes alone (generation, log-probs). Collective over the train group: every
    train rank enters it together. The memory cost: a full copy of the parameters per rank.
    A model that is not sharded (ddp, one rank, a rollout-only rank's copy) is left as it is, computing
    in its compute dtype (`autocast`); a view
    of another module's parameters (the LoRA reference, training/lora.py) gathers that module."""
    model = getattr(model, "parameters_owner", model)
    if model is None or not is_sharded(model):
        with autocast(model, inference=True), _checkpointing_passed(model):
            yield
        return
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return_freed_memory()  # what the update freed, before the whole copy is gathered (training/heap.py)
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        with _checkpointing_passed(model):
            yield
    finally:
        for module in modules:
            module.reshard()
        return_freed_memory()  # the gathered copy, which glibc would keep resident
        model.set_reshard_after_forward(_reshard_after_forward(model))


@contextlib.contextmanager
def _checkpointing_passed(model: torch.nn.Module | None) -> Iterator[None]:
    """Within it, the blocks' activation checkpointing (`checkpoint_blocks`) is off: an inference pass keeps
    no activations to recompute, and its hooks would stash the RNG states and open a checkpoint at every
    block of every decoded token: host work for nothing. The values computed are the same. What was on
    before is on again after, also when nested."""
    states = [] if model is None else [checkpoint_activations.state(m) for m in model.modules()]
    states = [state for state in states if state is not None]
    before = [state.enable_hook for state in states]
    for state in states:
        state.enable_hook = False
    try:
        yield
    finally:
        for state, enabled in zip(states, before, strict=True):
            state.enable_hook = enabled


def unsharded_view(model: torch.nn.Module) -> torch.nn.Module:
    """Inside `gathered`, an fsdp2 model as a plain module: the same classes and the same tensors (FSDP's
    gathered parameters: no copy, no memory), without FSDP's forward hooks. Any other model is returned
    as it is. The rollout engines decode through it (`rollout.generation.generate`): FSDP's hooks cost
    host time at every block of every decoded token, and a CUDA graph (`graphed`) cannot capture them.
    Each block still casts its floating inputs to the compute dtype first, as FSDP's mixed precision
    does, so the view computes what the model computes, bit for bit. One view per model, its tensors
    taken afresh at each call (gathering may place the parameters elsewhere)."""
    if not is_sharded(model):
        return model
    view = _VIEWS.get(model)
    if view is None:
        # FSDP casts each sharded module's floating inputs to param_dtype, the compute dtype (`compute_in`)
        view = _VIEWS[model] = module_view(model, getattr(model, "_distflow_compute_dtype", None))
    for original, mine in zip(model.modules(), view.modules(), strict=True):
        mine._parameters, mine._buffers = dict(original._parameters), dict(original._buffers)
    if any(isinstance(param, DTensor) for param in view.parameters()):
        raise RuntimeError("unsharded_view(model) is for inside `with gathered(model):`, where the model is whole")
    return view


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_view(module: torch.nn.Module, dtype: torch.dtype | None = None, made: dict | None = None) -> torch.nn.Module:
    """`module` again as its own class (FSDP's `FSDP<class>` undone), sharing its attributes, with module and
    hook dicts of its own: FSDP's hooks replaced by a cast of its floating inputs to `dtype` where it was
    sharded; its children likewise (a module that occurs twice in the tree has one view). Its parameters
    are the module's until its user fills them in (`unsharded_view`, `rollout.cast_weights.cast_view`)."""
    made = {} if made is None else made
    if id(module) in made:
        return made[id(module)]
    view = made[id(module)] = object.__new__(next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)))
    view.__dict__.update(module.__dict__)
    for flags in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(view, flags, collections.OrderedDict(getattr(module, flags)))  # its own: the hooks differ
    view._modules = {
        name: None if child is None else module_view(child, dtype, made) for name, child in module._modules.items()
    }
    view._parameters = dict(module._parameters)
    view._forward_pre_hooks = _without_fsdp(module._forward_pre_hooks)
    view._forward_hooks = _without_fsdp(module._forward_hooks)
    if isinstance(module, FSDPModule) and dtype is not None:
        view.register_forward_pre_hook(functools.partial(_cast_inputs, dtype), prepend=True, with_kwargs=True)
    return view


def _without_fsdp(hooks: dict) -> collections.OrderedDict:
    """The hooks FSDP did not register (its own are defined in torch.distributed.fsdp)."""
    return collections.OrderedDict(
        (key, hook) for key, hook in hooks.items() if not getattr(hook, "__module__", "").startswith(_FSDP_MODULE)
    )


_FSDP_MODULE = FSDPModule.__module__.split("._")[0]  # torch.distributed.fsdp


def _cast_inputs(dtype: torch.dtype, module, args, kwargs):
    """A block's floating inputs in `dtype`, as FSDP's mixed precision gives them (`cast_forward_inputs`)."""
    return tree_map_only(torch.Tensor, lambda x: x.to(dtype) if x.is_floating_point() else x, (args, kwargs))


def _reshard_after_forward(model: torch.nn.Module) -> bool:
    return getattr(model, "_distflow_reshard_after_forward", True)


def full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter, in `named_parameters` order. A sharded parameter is
    all-gathered (DTensor.full_tensor, a new tensor), so under fsdp2 every train rank iterates this
    together; any other is returned detached (a view: clone it to keep it past the next step)."""
    for name, param in model.named_parameters():
        yield name, param.full_tensor() if isinstance(param, DTensor) else param.detach()
