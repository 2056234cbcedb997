"""Per-rank random-generator state (Python, NumPy, torch CPU and CUDA) for resuming.

Every rank draws its own samples, so every rank has its own state; a checkpoint keeps
one file per saving rank. Resuming at the world size it was saved with restores each
rank exactly. At another world size, a rank whose number existed at save time gets that
rank's state back and a rank beyond the old world size gets generators reseeded from
(seed, step, rank) — deterministic, and distinct from every other rank's stream.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from distflow.seeding import derive_seed

RngState = dict  # {"python": ..., "numpy": ..., "torch": ByteTensor, "cuda": ByteTensor | None}


def capture_rng(device: torch.device) -> RngState:
    """The current state of every generator this process draws from (tensors and plain values only)."""
    version, internal, gauss = random.getstate()
    _, key, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "python": (version, internal, gauss),
        # int64, not uint32: the state must load with torch.load(weights_only=True)
        "numpy": {
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng(state: RngState, device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            numpy_state["key"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def restore_rng(state: RngState | None, *, seed: int, step: int, rank: int, device: torch.device) -> bool:
    """Restore `state` (this rank's, from `load_checkpoint`), or reseed when there is none.

    Returns whether a saved state was restored. The reseed draws from
    `derive_seed(seed, "resume-rng", step, rank)`, so it is the same on every resume of
    the same step and differs between ranks.

    >>> cpu = torch.device("cpu")
    >>> restore_rng(None, seed=0, step=5, rank=1, device=cpu)
    False
    >>> a = torch.rand(1)
    >>> _ = restore_rng(None, seed=0, step=5, rank=1, device=cpu)
    >>> bool(torch.equal(a, torch.rand(1)))
    True
    """
    if state is not None:
        set_rng(state, device)
        return True
    derived = derive_seed(seed, "resume-rng", step, rank)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # also seeds every CUDA device
    return False
