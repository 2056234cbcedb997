import pytest
import torch

from distflow.data.batch import Batch
from distflow.data.loader import PromptLoader

ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)]


def loader(rank, world, per_step=4, seed=0):
    return PromptLoader(lambda i: ROWS[i], len(ROWS), prompts_per_step=per_step, seed=seed, rank=rank, world_size=world)


def test_step_multiset_does_not_depend_on_world_size():
    single = loader(0, 1)
    pair = [loader(0, 2), loader(1, 2)]
    for _ in range(6):  # crosses two epoch boundaries (10 rows, 4 per step)
        whole = single.next_batch()
        halves = [half.next_batch() for half in pair]
        assert whole["uid"] == halves[0]["uid"] + halves[1]["uid"]
        assert whole["prompt"] == halves[0]["prompt"] + halves[1]["prompt"]
        assert len(halves[0]) == len(halves[1]) == 2


def test_each_rank_reads_only_its_rows():
    read = []
    ld = PromptLoader(lambda i: read.append(i) or ROWS[i], len(ROWS), prompts_per_step=4, seed=0, rank=1, world_size=2)
    ld.next_batch()
    assert len(read) == 2


def test_epochs_are_permutations_and_differ():
    ld = loader(0, 1, per_step=5)
    epoch0 = ld.next_batch()["prompt"] + ld.next_batch()["prompt"]
    epoch1 = ld.next_batch()["prompt"] + ld.next_batch()["prompt"]
    assert sorted(epoch0) == sorted(epoch1) == sorted(r["prompt"] for r in ROWS)
    assert epoch0 != epoch1


def test_state_restores_on_another_world_size():
    ref = loader(0, 1)
    for _ in range(3):
        ref.next_batch()
    state = ref.state_dict()
    expected = ref.next_batch()["uid"]
    resumed = [loader(r, 2) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(state)
    assert resumed[0].next_batch()["uid"] + resumed[1].next_batch()["uid"] == expected


def test_indivisible_step_is_rejected():
    with pytest.raises(ValueError, match="not divisible"):
        loader(0, 3)


def test_batch_ops():
    b = Batch({"x": torch.arange(4)}, {"uid": [10, 11, 12, 13]})
    r = b.repeat_interleave(2)
    assert r["x"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and r["uid"][:3] == [10, 10, 11]
    parts = b.split(3)
    assert [p["uid"] for p in parts] == [[10, 11], [12], [13]]
    u = b.updated(y=torch.ones(4), uid=[1, 2, 3, 4])
    assert u.fields() == {"x", "y", "uid"} and b["uid"] == [10, 11, 12, 13]
    assert b.tensor_bytes() == 4 * 8
    with pytest.raises(ValueError, match="disagree"):
        Batch({"x": torch.arange(3)}, {"uid": [1]})
    with pytest.raises(KeyError, match="has no field 'z'"):
        b["z"]
