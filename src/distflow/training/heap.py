"""Freed host memory given back to the operating system (glibc's `malloc_trim`), where it would stay resident.

glibc keeps freed blocks below its mmap threshold in the process's heap, and the threshold rises to 32 MiB
after the first large block is freed, so a model's parameters freed on the CPU (an fsdp2 model resharded
after `parallelize.gathered`: each parameter a few MiB) stay in the rank's resident memory. Measured on
SmolLM2-135M under fsdp2 on 2 ranks: gathering added 0.66 GiB per rank, resharding returned 0.11 GiB of
it, `malloc_trim(0)` the rest (docs/features/memory.md). Without the trim the copy that sharding frees
stays resident, and the next phase's allocations land beside it. Elsewhere (musl, macOS) there is no
`malloc_trim`, and nothing is done.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS; whether this C library can (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
