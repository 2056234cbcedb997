"""Redistribution between layouts on real gloo ranks: every sample arrives exactly once,
bit-identical, with its uid and group, and no rank receives more than its share."""

import pytest
import torch

from distflow.data.batch import Batch
from distflow.data.redistribute import redistribute
from distflow.layout import Layout

GROUP = 4  # samples per prompt group


def sample_rows(uid: int) -> dict:
    """Everything about sample `uid`, derived from the uid alone."""
    g = torch.Generator().manual_seed(uid)
    length = int(torch.randint(1, 12, (), generator=g))
    ids = torch.zeros(12, dtype=torch.long)
    ids[12 - length :] = torch.randint(3, 1000, (length,), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "logp": torch.randn(5, generator=g),
        "reward": torch.rand((), generator=g).half(),
        "group": torch.tensor(uid // GROUP),
        "flag": torch.rand((), generator=g) > 0.5,
        "prompt": f"prompt {uid // GROUP} ✓",
        "sample": {"answer": uid, "nested": [uid, "x" * (uid % 7)]},
    }


def make_batch(uids: list[int]) -> Batch:
    rows = [sample_rows(u) for u in uids]
    tensors = {
        k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "logp", "reward", "group", "flag")
    }
    return Batch(
        tensors, {"uid": list(uids), "prompt": [r["prompt"] for r in rows], "sample": [r["sample"] for r in rows]}
    )


def move(comm, src: Layout, dst: Layout, per_replica: int, keep_groups: bool):
    replica = src.replica_of(comm.rank)
    if replica is None:
        batch = Batch()
    else:  # the ranks of a replica hold the same samples
        batch = make_batch([replica * per_replica + p for p in range(per_replica)][::-1])
        if src.member_of(comm.rank) == 1:  # equal values, different object sharing: pickles differ in length
            batch.meta["sample"] = [dict(s, again=list(s["nested"])) for s in batch.meta["sample"]]
        else:
            batch.meta["sample"] = [dict(s, again=s["nested"]) for s in batch.meta["sample"]]
    out, stats = redistribute(batch, src, dst, comm, keep_groups=keep_groups)
    return {"uid": out.meta.get("uid", []), "batch": out, "stats": stats}


CASES = [  # world, src, dst, samples per source replica, keep groups
    (2, Layout((0, 1), 2), Layout((0, 1)), 16, True),  # rollout replica of 2 → train DP 2
    (4, Layout((0, 1, 2, 3), 2), Layout((0, 1, 2, 3)), 16, True),
    (4, Layout((0, 1)), Layout((2, 3)), 8, False),  # disjoint: rollout ranks → train ranks
    (3, Layout((0,)), Layout((1, 2)), 8, True),
    (2, Layout((0, 1)), Layout((0, 1), 2), 6, False),  # DP 2 → one replica of 2 ranks
]


@pytest.mark.parametrize("world,src,dst,per_replica,keep_groups", CASES)
def test_every_sample_arrives_once_bit_identical(world, src, dst, per_replica, keep_groups):
    from distflow.runtime.launcher import run_local

    results = run_local(move, world, src, dst, per_replica, keep_groups)
    total = src.dp_size * per_replica
    seen = []
    for d in range(dst.dp_size):
        members = dst.replica(d)
        leader = results[members[0]]
        assert len(leader["uid"]) == total // dst.dp_size  # exactly its share
        for m in members[1:]:  # every rank of a replica holds the same samples
            assert results[m]["uid"] == leader["uid"]
        seen.extend(leader["uid"])
        batch = leader["batch"]
        assert leader["uid"] == sorted(leader["uid"])  # ordered by uid, whatever the source
        for i, uid in enumerate(leader["uid"]):
            expected = sample_rows(uid)
            for name, tensor in batch.tensors.items():
                assert torch.equal(tensor[i], expected[name]), (name, uid)
            assert batch["prompt"][i] == expected["prompt"]
            assert batch["sample"][i] == dict(expected["sample"], again=expected["sample"]["nested"])
        if keep_groups:
            groups = batch["group"].tolist()
            assert all(groups.count(g) == GROUP for g in set(groups))  # whole groups only
    assert sorted(seen) == list(range(total))
    for rank in range(world):
        if rank not in dst:
            assert results[rank]["uid"] == [] and not results[rank]["batch"].fields()
    sent = sum(r["stats"].bytes_sent for r in results)
    received = sum(r["stats"].bytes_received for r in results)
    assert sent == received
    assert all(r["stats"].imbalance_after <= r["stats"].imbalance_before + 1e-9 or keep_groups for r in results)


def test_disjoint_move_sends_everything_and_keeps_nothing_local():
    from distflow.runtime.launcher import run_local

    results = run_local(move, 4, Layout((0, 1)), Layout((2, 3)), 8, False)
    assert all(r["stats"].bytes_local == 0 for r in results)
    assert results[0]["stats"].bytes_sent > 0 and results[2]["stats"].bytes_received > 0
    assert results[0]["stats"].bytes_received == 0 and results[2]["stats"].bytes_sent == 0


def test_replica_to_data_parallel_on_one_world_moves_nothing_with_a_single_rank():
    from distflow.comm import Comm

    comm = Comm(0, 1, 0, 1, torch.device("cpu"))
    result = move(comm, Layout((0,)), Layout((0,)), 8, True)
    assert result["uid"] == list(range(8)) and result["stats"].bytes_sent == 0


# The move plan alone: gathered rows in, who sends what to whom out (no processes).


def gathered_rows(src: Layout, world: int, per_replica: int, meta_bytes=lambda rank, uid: 10):
    """counts and rows as every rank would gather them: replica r holds uids r*per_replica + p."""
    counts, rows = [0] * world, [[[0, 0, 0, 0]] * per_replica for _ in range(world)]
    for rank in src.ranks:
        uids = [src.replica_of(rank) * per_replica + p for p in range(per_replica)]
        counts[rank] = per_replica
        rows[rank] = [[u, u // GROUP, 1 + u % 5, meta_bytes(rank, u)] for u in uids]
    return counts, rows


def test_plan_disjoint_move_gives_each_destination_its_share_from_the_holders():
    from distflow.data.move_plan import plan_move

    src, dst = Layout((0, 1)), Layout((2, 3))
    counts, rows = gathered_rows(src, 4, 8)
    plan = plan_move(counts, rows, 100, src, dst, keep_groups=False)
    received = {q: sorted(u for s in range(4) for u in plan.uids(s, q)) for q in range(4)}
    assert len(received[2]) == len(received[3]) == 8 and not received[0] and not received[1]
    assert sorted(received[2] + received[3]) == list(range(16))
    assert all(s in (0, 1) for s, _ in plan.pairs)  # only the holders send
    assert plan.send_sizes(0)[:2] == [0, 0] and sum(plan.send_sizes(0)) == plan.chunk_bytes(0, 2) + plan.chunk_bytes(
        0, 3
    )
    assert sum(plan.recv_sizes(2)) == 8 * (100 + 10)
    assert [plan.send_sizes(s)[q] for s in range(4) for q in range(4)] == [
        plan.recv_sizes(q)[s] for s in range(4) for q in range(4)
    ]


def test_plan_replica_to_data_parallel_uses_the_copy_already_on_the_destination():
    from distflow.data.move_plan import plan_move

    src, dst = Layout((0, 1, 2, 3), 2), Layout((0, 1, 2, 3))
    counts, rows = gathered_rows(src, 4, 8, meta_bytes=lambda rank, uid: 10 + rank % 2)  # pickles differ per member
    plan = plan_move(counts, rows, 100, src, dst, keep_groups=True)
    for q in range(4):
        uids = [u for s in range(4) for u in plan.uids(s, q)]
        assert len(uids) == 4 and len({u // GROUP for u in uids}) == 1  # its share, one whole group
    for (sender, receiver), index in plan.pairs.items():
        holders = src.replica(plan.items[index[0]][0])
        assert sender == receiver if receiver in holders else sender in holders
        assert plan.meta_sizes(sender, receiver) == [10 + sender % 2] * len(index)  # the sender's own pickles


def test_plan_senders_of_one_replica_share_the_bytes():
    from distflow.data.move_plan import plan_move

    src, dst = Layout((0, 1), 2), Layout((2, 3))
    counts, rows = gathered_rows(src, 4, 16)
    plan = plan_move(counts, rows, 100, src, dst, keep_groups=False)
    sent = [sum(plan.send_sizes(s)) for s in (0, 1)]
    assert sent[0] == sent[1] == 8 * 110
    assert sum(plan.send_sizes(2)) == sum(plan.send_sizes(3)) == 0


def test_plan_rejects_replica_members_holding_different_samples():
    from distflow.data.move_plan import plan_move

    src, dst = Layout((0, 1), 2), Layout((0, 1))
    counts, rows = gathered_rows(src, 2, 4)
    rows[1][2] = [99, 99, 3, 10]
    with pytest.raises(RuntimeError, match=r"ranks 0 and 1 of one replica hold different samples .*item 2"):
        plan_move(counts, rows, 100, src, dst, keep_groups=False)
