"""The double buffer hands out the loader's batches in order, one step ahead, and reports
the state of the batch last handed out (what a checkpoint records)."""

import threading
import weakref

import torch

from distflow.data.batch import Batch
from distflow.data.loader import PromptLoader
from distflow.data.prefetch import Prefetcher


def make_loader():
    rows = [{"prompt": f"p{i}"} for i in range(20)]
    return PromptLoader(
        rows.__getitem__,
        20,
        prompts_per_step=4,
        seed=0,
        rank=0,
        world_size=1,
        tokenize=lambda prompts: [[len(p)] for p in prompts],
    )


def test_same_batches_and_states_with_and_without_prefetch():
    runs = {}
    for enabled in (True, False):
        loader = make_loader()
        prefetcher = Prefetcher(loader.next_batch, loader.state_dict, enabled=enabled)
        runs[enabled] = []
        for _ in range(7):  # crosses an epoch boundary (5 steps per epoch)
            batch, _ = prefetcher.next()
            runs[enabled].append((batch["uid"], batch["prompt_ids"], dict(prefetcher.state)))
        prefetcher.close()
    assert runs[True] == runs[False]
    assert (runs[True][0][2]["epoch"], runs[True][0][2]["cursor"]) == (0, 4)
    assert (runs[True][5][2]["epoch"], runs[True][5][2]["cursor"]) == (1, 4)


def test_the_next_batch_is_prepared_in_the_background_and_the_old_one_released_there():
    loader = make_loader()
    threads = []

    def produce():
        threads.append(threading.current_thread().name)
        return Batch({"x": torch.zeros(4)}, loader.next_batch().meta)

    prefetcher = Prefetcher(produce, loader.state_dict, enabled=True)
    first, _ = prefetcher.next()
    gone = weakref.ref(first.tensors["x"])
    first_uids = first["uid"]
    second, _ = prefetcher.next(release=first)
    del first
    prefetcher.close()  # waits for the worker, which dropped the released batch
    assert gone() is None
    assert second["uid"] != first_uids
    assert all(name.startswith("distflow-prefetch") for name in threads) and len(threads) >= 2
