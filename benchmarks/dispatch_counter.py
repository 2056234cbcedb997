"""What a GPU would pay the host for, counted on a CPU: kernel launches and host-device syncs.

Used by benchmarks/host_costs.py in the project venv and by benchmarks/trl_count_worker.py in
.venv-bench, so it imports torch and the standard library only.

    with HostCostCounter() as counter:          # counts this thread's work while open
        with counter.scope("rollout"):
            generate(...)
    counter.totals("rollout")                   # {"ops": 2509, "views": 700, "syncs": 41, ...}

What is counted, per scope (nested scopes count into the innermost):

ops        every aten operator on a device tensor that reaches the dispatcher's Python key,
           through a `TorchDispatchMode`: after autograd and composite decomposition, so what a
           backend runs, each a kernel launch on a GPU. `views` (of them: views and other
           metadata ops, which launch nothing) and `host_ops` (ops on host tensors only, see
           below: no launch either) are counted apart. Ops inside another op (a kernel calling
           `nonzero` itself) are not seen, nor the kernels of a compiled graph.
syncs      operations after which a GPU's host waits for the device:
           - dispatched: `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`, `if t.any():`),
             `nonzero` (`torch.where(c)`), `masked_select`, `index`/`index_put_` with a bool
             or uint8 index (`x[mask]`, `x[mask] = v`), `unique*`, `repeat_interleave` with a
             tensor of repeats and no `output_size`, `equal`, `allclose`, `bincount`, and
             blocking copies between devices (only on a GPU run);
           - host reads a CPU run does not dispatch: `Tensor.tolist()`, `.numpy()` (and numpy's
             `__array__`), `.cpu()`, `.to("cpu")`, counted by wrapping those methods while the
             counter is open;
           - host-to-device copies of more than one value (`from_host`, below): a blocking copy
             from pageable memory synchronises the stream too.
           A tensor known to live on the host in a GPU run too costs no sync: made by `.cpu()` or
           `.to("cpu")`, by `torch.tensor`/`as_tensor` from Python data without a device (or with
           "cpu", the string), by `torch.from_numpy`, or computed from such tensors only.
           A tensor made by a factory op (`torch.full`, `zeros`, `arange`: their device argument
           is the host's or the device's, this run cannot tell) is `fresh`: reading it counts a
           sync, moving it `.to(device)` counts nothing, and once filled from a host tensor
           (`copy_`, into it or into a view of it: TRL's and distflow's padding build host
           batches so) it is a host tensor. Everything else counts as a device tensor.
           Checked against CUDA's own detector (torch.cuda.set_sync_debug_mode) on an H200: each
           case in tests/test_host_costs.py syncs there as counted here, `repeat_interleave`
           twice; `x[mask] = scalar` does not sync (CUDA runs it as masked_fill_).
from_host  (of `syncs`) host-to-device copies of non-scalar host tensors: `torch.tensor`/`as_tensor`
           of Python data given a device, `.to(device)` of a host tensor, `copy_` of a host tensor
           into a device one.

`as_on_cuda=True` (the default) makes torch's optimizers take their foreach implementation on
the CPU too, as they do on CUDA (else AdamW loops over the parameters here, ~15 ops each).
Only the thread that opened the counter is counted (a dispatch mode is thread-local; the
wrappers check the thread): background threads (a prefetcher) are not.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ALWAYS_SYNC = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
        "aten.unique_dim_consecutive",
        "aten.equal",
        "aten.allclose",
        "aten.bincount",
    }
)
BOOL_INDEXED = frozenset({"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"})
COPIES = frozenset({"aten._to_copy", "aten.copy_"})
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
HOST, FRESH, DEVICE = "host", "fresh", "device"
"""Where a tensor would live in a GPU run: on the host; made by a factory op, or from such tensors
and host ones only, whose device this run cannot tell; on the device (everything else)."""


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether this dispatched op makes a GPU's host wait for the device."""
    if name in ALWAYS_SYNC:
        return True
    if name in BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if name != "aten.index" and len(indices) == 1 and args[2].numel() == 1:
            return False  # `x[mask] = scalar`: CUDA's index_put_ runs it as masked_fill_
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if name == "aten.repeat_interleave":
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and len(args) < 2
    if name in COPIES:
        return _blocking_transfer(name, args, kwargs)
    return False


def _blocking_transfer(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy between the host and a device that is not `non_blocking` (GPU runs only)."""
    if kwargs.get("non_blocking") or (name == "aten.copy_" and len(args) > 2 and args[2]):
        return False
    if name == "aten.copy_":
        devices = {args[0].device.type, args[1].device.type}
    else:
        devices = {args[0].device.type, torch.device(kwargs.get("device") or args[0].device).type}
    return len(devices) > 1 and "cpu" in devices


class HostCostCounter(TorchDispatchMode):
    """Counts ops, syncs and host-made tensors per scope (see the module docstring)."""

    def __init__(self, *, as_on_cuda: bool = True) -> None:
        super().__init__()
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.syncs: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sync_sites: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.views: collections.Counter = collections.Counter()
        self.host_ops: collections.Counter = collections.Counter()
        self.from_host: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.as_on_cuda = as_on_cuda
        self._scopes = [""]
        self.seen: dict[str, None] = {}  # every scope opened, in order (also those that counted nothing)
        self._placed: dict[int, tuple[weakref.ref, str]] = {}  # id -> (tensor, HOST or FRESH)
        self._paused = 0
        self._thread = threading.get_ident()
        self._patches = contextlib.ExitStack()

    # --- scopes and results -----------------------------------------------------------

    @contextlib.contextmanager
    def scope(self, name: str):
        """Count what runs inside into `name` (the innermost open scope wins)."""
        self._scopes.append(name)
        self.seen.setdefault(name)
        try:
            yield self
        finally:
            self._scopes.pop()

    @property
    def current_scope(self) -> str:
        """The innermost open scope, which what runs now counts into."""
        return self._scopes[-1]

    def totals(self, scope: str) -> dict[str, int]:
        return {
            "ops": sum(self.ops[scope].values()),
            "views": self.views[scope],
            "host_ops": self.host_ops[scope],
            "syncs": sum(self.syncs[scope].values()),
            "from_host": sum(self.from_host[scope].values()),
        }

    def top_ops(self, scope: str, n: int = 10) -> list[tuple[str, int]]:
        return self.ops[scope].most_common(n)

    def top_syncs(self, scope: str, n: int = 10) -> list[tuple[str, int]]:
        return self.syncs[scope].most_common(n)

    def top_sync_sites(self, scope: str, n: int = 10) -> list[tuple[str, int]]:
        """The lines that synced most: "what @ file:line (function)", the innermost frame outside torch."""
        return self.sync_sites[scope].most_common(n)

    # --- host-resident tensors ----------------------------------------------------------

    def _place(self, t: torch.Tensor) -> str:
        """HOST, FRESH or DEVICE: where `t` would live in a GPU run, as far as this run can tell."""
        ref, where = self._placed.get(id(t), (None, DEVICE))
        return where if ref is not None and ref() is t else DEVICE

    def _on_host(self, t: torch.Tensor) -> bool:
        return self._place(t) == HOST

    def _mark(self, t, where: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        key = id(t)
        if where == DEVICE:
            self._placed.pop(key, None)
        else:
            self._placed[key] = (weakref.ref(t, lambda _, key=key: self._placed.pop(key, None)), where)

    def _mark_host(self, t) -> None:
        self._mark(t, HOST)

    def _sync(self, what: str) -> None:
        scope = self._scopes[-1]
        self.syncs[scope][what] += 1
        self.sync_sites[scope][f"{what} @ {_caller()}"] += 1

    def _h2d(self, t: torch.Tensor, what: str) -> None:
        """A host-to-device copy: blocking (a stream sync) unless of one scalar, which CUDA fills, or
        of nothing."""
        if t.dim() > 0 and t.numel() > 0:
            self.from_host[self._scopes[-1]][what] += 1
            self._sync(what)

    def _counting(self) -> bool:
        return not self._paused and threading.get_ident() == self._thread

    # --- the dispatch mode ----------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = str(func.overloadpacket)
        scope = self._scopes[-1]
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        places = {self._place(t) for t in inputs}
        if not inputs:  # a factory op: its device argument may be the host's or the device's
            made = HOST if name == "aten.lift_fresh" else FRESH
        else:
            made = HOST if places == {HOST} else FRESH if places <= {HOST, FRESH} else DEVICE
        if name == "aten.copy_" and self._place(args[0]) == FRESH and self._on_host(args[1]):
            made = HOST  # a made tensor filled from host data: a host batch being built
            if args[0]._base is not None and self._place(args[0]._base) == FRESH:
                self._mark(args[0]._base, HOST)
        if made == HOST:
            self.host_ops[scope] += 1
        elif func.namespace != "profiler":  # record_function's markers launch nothing
            self.ops[scope][name] += 1
            self.views[scope] += func.is_view
        if name == "aten.copy_" and self._place(args[0]) == DEVICE and self._on_host(args[1]):
            self._h2d(args[1], "aten.copy_(host->device)")
        elif name == "aten.copy_" and self._on_host(args[0]) and self._place(args[1]) != HOST:
            self._sync("aten.copy_(device->host)")
        elif made != HOST and _is_sync(name, args, kwargs):
            self._sync(name)
        out = func(*args, **kwargs)
        if made != DEVICE:
            for t in tree_flatten(out)[0]:
                self._mark(t, made)
        return out

    def __enter__(self):
        super().__enter__()
        self._patches.__enter__()
        for method in ("tolist", "numpy"):
            self._patches.enter_context(_patched(torch.Tensor, method, self._host_read(method)))
        self._patches.enter_context(_patched(torch.Tensor, "cpu", self._moved(torch.Tensor.cpu, lambda *a, **k: "cpu")))
        self._patches.enter_context(_patched(torch.Tensor, "to", self._moved(torch.Tensor.to, _target_device)))
        for function in ("tensor", "as_tensor"):
            self._patches.enter_context(_patched(torch, function, self._host_made(getattr(torch, function))))
        self._patches.enter_context(_patched(torch, "from_numpy", self._host_made(torch.from_numpy)))
        if self.as_on_cuda:
            # torch.optim.optimizer picks foreach only for these device types; CUDA is one.
            import torch.optim.optimizer as optimizer

            devices = optimizer._get_foreach_kernels_supported_devices
            self._patches.enter_context(
                _patched(optimizer, "_get_foreach_kernels_supported_devices", lambda: [*devices(), "cpu"])
            )
        return self

    def __exit__(self, *exc):
        self._patches.__exit__(*exc)
        return super().__exit__(*exc)

    def _host_read(self, method: str):
        """`Tensor.<method>` counting one sync when it reads a device tensor to the host."""
        original = getattr(torch.Tensor, method)

        def read(t, *args, **kwargs):
            if not self._counting():
                return original(t, *args, **kwargs)
            if not self._on_host(t):
                self._sync(f"Tensor.{method}")
            self._paused += 1  # a GPU run's own copy to the host (`_to_copy`) is this same sync
            try:
                return original(t, *args, **kwargs)
            finally:
                self._paused -= 1

        return read

    def _moved(self, original, target_of):
        """`Tensor.cpu`/`Tensor.to`: to "cpu" (the string) is a read to the host, one sync from a
        device tensor; to any other device (a torch.device: the run's) makes a device tensor,
        a host-to-device copy from a host one. A CPU run returns the tensor itself where a GPU
        run makes a new one: here a new tensor object over the same data."""

        def move(t, *args, **kwargs):
            target = target_of(*args, **kwargs)
            if target is None or not self._counting():
                return original(t, *args, **kwargs)
            to_host, place = target == "cpu", self._place(t)
            if to_host and place != HOST:
                self._sync(f"Tensor.{original.__name__}(cpu)")
            elif not to_host and place == HOST:
                self._h2d(t, f"Tensor.{original.__name__}(device)")
            self._paused += 1
            try:
                out = original(t, *args, **kwargs)
                if out is t and (place == HOST) != to_host:
                    out = _alias(t)
            finally:
                self._paused -= 1
            self._mark(out, HOST if to_host else DEVICE)
            return out

        return move

    def _host_made(self, original):
        """`torch.tensor`-like: from Python or numpy data without a device (or on "cpu", the string), a
        host tensor in a GPU run too; given another device, a host-to-device copy."""

        def make(data, *args, **kwargs):
            out = original(data, *args, **kwargs)
            if self._counting() and not isinstance(data, torch.Tensor):
                if kwargs.get("device") in (None, "cpu"):
                    self._mark_host(out)
                else:
                    self._h2d(out, f"torch.{original.__name__}(device=)")
                    self._mark(out, DEVICE)
            return out

        return make


def _caller() -> str:
    """The innermost frame outside torch and this file: the line that asked for the sync."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(TORCH_DIR) and path != __file__:
            short = os.sep.join(path.split(os.sep)[-2:])
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _target_device(*args, **kwargs):
    """The device `Tensor.to` moves to: "cpu" if named by that string, a torch.device (or another
    device string) otherwise, None when it only changes the dtype."""
    for value in (kwargs.get("device"), *args):
        if isinstance(value, str):
            return "cpu" if value == "cpu" else torch.device(value)
        if isinstance(value, torch.device):
            return value
    return None


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object over `t`'s data (what `.cpu()` of a CPU tensor would be on a GPU, but
    sharing memory, as the CPU run's `.cpu()` itself does)."""
    try:
        return t.view_as(t)
    except RuntimeError:  # sparse and other layouts without views
        return t


@contextlib.contextmanager
def _patched(owner, name: str, value):
    """`owner.name = value` while open; then the attribute as it was (inherited ones inherited again)."""
    own = name in vars(owner)
    before = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, before)
        else:
            delattr(owner, name)
