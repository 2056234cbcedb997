"""How the policy's weights reach a vLLM engine's model, in the rank's process or in the engine's child.

    in-process engine (colocated, synchronous)          engine in a child process (otherwise)
    ┌ rank ──────────────────────────────────┐          ┌ rank ─────────────────────────────────────┐
    │ named tensors (the policy's own)       │          │ named tensors ──copy──► SharedWeights     │
    │   │ collective_rpc: the tensors        │          │   (one file in /dev/shm, every tensor     │
    │   ▼ themselves (nothing is copied)     │          │    at an offset; unlinked after the first │
    │ load_policy_weights (this class, mixed │          │    push, both sides keep their mapping)   │
    │   into vLLM's worker)                  │          │ collective_rpc: (path, size, layout) only │
    │   reload_weights + re-tie the LM head  │          └──────────────────────┬────────────────────┘
    └────────────────────────────────────────┘                                 ▼
                                                        ┌ vLLM worker process (the engine's child) ─┐
                                                        │ load_shared_policy_weights: views of the  │
                                                        │ mapped file ──► load_policy_weights       │
                                                        │ watch_owner: the rank gone (even by       │
                                                        │ kill -9) → SIGTERM to the engine core     │
                                                        └───────────────────────────────────────────┘

Invariants. `PolicyWeights` is vLLM's `worker_extension_cls` (its methods are mixed into vLLM's worker
and reached through `LLM.collective_rpc`), so both engines load through one method,
`load_policy_weights`: vLLM's in-place `reload_weights` with checkpoint names, then the tied LM head
re-pointed at the embedding. A child engine's rpc cannot carry tensors (its messages are msgpack:
a tensor in plain args arrives as a list), hence the file: the rank writes every tensor into it before
each push (a GPU tensor is copied to the CPU on the way), and the worker reads views of it, no second
copy. The layout is fixed by the first push; a later push with other names or shapes is an error.
vLLM's engine core does not notice its parent's death (only its own workers do), so the worker
watches the rank that owns the engine and ends the engine core when it goes.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import weakref

import torch

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes in the file (a dtype view needs its own alignment)."""


def weights_layout(named: list[tuple[str, torch.Tensor]]) -> tuple[int, list[list]]:
    """(total bytes, [[name, dtype, shape, offset], ...]) of `named` laid end to end, each aligned.

    >>> weights_layout([("a", torch.zeros(3)), ("b", torch.zeros(2, 2, dtype=torch.bfloat16))])
    (72, [['a', 'float32', [3], 0], ['b', 'bfloat16', [2, 2], 64]])
    """
    layout, offset = [], 0
    for name, tensor in named:
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += math.ceil(tensor.numel() * tensor.element_size() / ALIGN) * ALIGN
    last = named[-1][1] if named else None
    total = layout[-1][3] + last.numel() * last.element_size() if last is not None else 0
    return total, layout


def shared_views(buffer_N: torch.Tensor, layout: list[list]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor of `layout` in the byte buffer `buffer_N` (no copy)."""
    views = []
    for name, dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        views.append((name, buffer_N[offset : offset + num_bytes].view(dtype).view(shape)))
    return views


def map_file(path: str, total: int) -> torch.Tensor:
    """The `total` bytes of the file at `path`, mapped shared (writes are seen by every process mapping it)."""
    if not os.path.exists(path) or os.path.getsize(path) != total:
        raise FileNotFoundError(f"the shared weights file {path} of {total} bytes is gone or of another size")
    return torch.from_file(path, shared=True, size=total, dtype=torch.uint8)


def _shm_root() -> str:
    """Where the file lives: /dev/shm (memory) where there is one, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedWeights:
    """The rank's side: one file holding the named tensors at fixed offsets, written before each push."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.total, self.layout = weights_layout(named)
        rank = os.environ.get("RANK", "0")
        self.dir = tempfile.mkdtemp(prefix=f"distflow-vllm-rank{rank}-pid{os.getpid()}-", dir=_shm_root())
        self.path = os.path.join(self.dir, "weights")
        self._remove = weakref.finalize(self, shutil.rmtree, self.dir, True)  # also at exit, and on an error
        with open(self.path, "wb") as f:
            f.truncate(self.total)
        self.buffer_N = map_file(self.path, self.total)

    @property
    def handle(self) -> tuple[str, int, list[list]]:
        """What the worker needs to map the file and find each tensor (msgpack-able)."""
        return self.path, self.total, self.layout

    def write(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy `named` (same names, dtypes and shapes as the layout) into the file."""
        got = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in named]
        if got != [entry[:3] for entry in self.layout]:
            raise ValueError("the pushed weights' names, dtypes or shapes differ from the engine's first push")
        for (_, view), (_, tensor) in zip(shared_views(self.buffer_N, self.layout), named, strict=True):
            view.copy_(tensor.detach())

    def unlink(self) -> None:
        """Remove the file and its directory; this process's mapping (and a worker's) stays valid."""
        self._remove()


class PolicyWeights:
    """vLLM's `worker_extension_cls`: methods mixed into vLLM's worker (`self` is the worker), called
    through `LLM.collective_rpc`. No attributes but methods: vLLM refuses names its worker already has."""

    def load_policy_weights(self, named: list[tuple[str, torch.Tensor]], tied: bool) -> None:
        """Load (checkpoint name, tensor) pairs in place; re-point a tied LM head at the embedding."""
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        if tied:
            retie_lm_head(self.model_runner.model)

    def load_shared_policy_weights(self, handle: tuple[str, int, list[list]], tied: bool) -> None:
        """Load the tensors of a `SharedWeights` file: mapped on the first push, the mapping kept (the
        rank unlinks the file after it)."""
        path, total, layout = handle
        mapped = getattr(self, "_distflow_mapped", None)
        if mapped is None or mapped[0] != path:
            mapped = (path, map_file(path, total))
            self._distflow_mapped = mapped
        self.load_policy_weights(shared_views(mapped[1], layout), tied)

    def watch_owner(self, owner_pid: int) -> None:
        """End this engine when the process that owns it ends, however it ends (a daemon thread)."""
        engine_core = os.getpid() if os.getppid() == owner_pid else os.getppid()
        threading.Thread(
            target=end_when_gone, args=(owner_pid, engine_core), daemon=True, name="distflow-owner-watch"
        ).start()


def retie_lm_head(vllm_model: torch.nn.Module) -> None:
    """Point a tied LM head at the reloaded embedding again and redo its post-load processing:
    vLLM's layerwise reload gets no `lm_head` tensor for a tied model and puts back the head's old
    weight (its documented limit on tied parameters), which would leave the head at the first weights. A
    model whose logits vLLM takes from the embedding itself (its Gemma 2 has no `lm_head`) has none to retie."""
    head = getattr(vllm_model, "lm_head", None)
    if head is None:
        return
    head.weight = vllm_model.model.embed_tokens.weight
    head.quant_method.process_weights_after_loading(head)


def wait_for_exit(pid: int, poll_s: float = 1.0) -> None:
    """Return once process `pid` has ended (a zombie counts as ended)."""
    with contextlib.suppress(ProcessLookupError):
        if hasattr(os, "pidfd_open"):  # Linux >= 5.3: readable when the process ends
            fd = os.pidfd_open(pid)
            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
            return
        while True:  # elsewhere: poll
            os.kill(pid, 0)
            time.sleep(poll_s)


def end_when_gone(owner_pid: int, engine_core_pid: int, grace_s: float = 30.0) -> None:
    """When `owner_pid` ends, SIGTERM the engine core (vLLM's own shutdown: it ends its workers, this
    one included), and SIGKILL it if it is still there after `grace_s`."""
    wait_for_exit(owner_pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(engine_core_pid, signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(engine_core_pid, signal.SIGKILL)
