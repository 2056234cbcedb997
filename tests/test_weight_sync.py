"""Disaggregated weight sync (sync/weight_sync.py, weight_shares.py): the byte partition is
deterministic and balanced; after a sync every rollout rank's parameters equal the train
ranks' bitwise, for 1-3 train ranks and 1-2 rollout ranks, DDP-style and FSDP2 shards."""

import math

import pytest
import torch

from distflow.runtime.launcher import run_local
from distflow.sync.weight_shares import Piece, ReplicatedShares, parameter_specs, partition_rows, row_view
from distflow.sync.weight_sync import SyncBytes, WeightSync, _check_coverage, _unpack

LAYOUTS = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (3, 2)]  # (train ranks, rollout ranks)
BUCKET_BYTES = 200  # several buckets per share, and shares with different numbers of them


class Net(torch.nn.Module):
    """Uneven shapes: a table larger than any share at 2-3 ranks (split along dim 0), a scalar,
    a float64 matrix (its own bucket), a 1-D bias. FSDP2 has no 0-dim parameters: `scale_shape=(1,)`."""

    def __init__(self, scale_shape: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(41, 3))
        self.proj = torch.nn.Linear(7, 5)
        self.scale = torch.nn.Parameter(torch.randn(scale_shape))
        self.wide = torch.nn.Parameter(torch.randn(4, 2, dtype=torch.float64))
        self.out = torch.nn.Linear(5, 1)


def _bytes(pieces) -> int:
    return sum(piece.num_bytes for piece in pieces)


def _specs(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float64)
    shapes = [(), (1,), (3, 5), (97, 8), (2, 3, 4), (1000, 16), (5,)]
    order = torch.randperm(len(shapes), generator=g).tolist()
    return [(f"p{i}", shapes[i], dtypes[i % 3]) for i in order]


@pytest.mark.parametrize("num_shares", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", [0, 1])
def test_partition_covers_every_row_once_and_is_balanced(num_shares, seed):
    specs = _specs(seed)
    shares = partition_rows(specs, num_shares)
    assert shares == partition_rows(list(specs), num_shares)  # deterministic
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    max_row = max(math.prod(shape[1:]) * dtype.itemsize for _, shape, dtype in specs)
    for share in shares:
        assert abs(_bytes(share) - total / num_shares) <= max_row
    for name, shape, _ in specs:  # in model order, each row exactly once
        ranges = [(p.start, p.stop) for share in shares for p in share if p.name == name]
        rows = shape[0] if shape else 1
        assert [r for pair in ranges for r in pair] == sorted(r for pair in ranges for r in pair)
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    if num_shares > 1:  # the (1000, 16) table holds most bytes: it is split along dim 0
        assert sum(1 for share in shares for p in share if p.name == "p5") > 1


def test_partition_example_and_replicated_source():
    shares = partition_rows([("a", (6, 2), torch.float32), ("b", (2,), torch.float32)], 2)
    assert [[(p.name, p.start, p.stop) for p in share] for share in shares] == [
        [("a", 0, 3)],
        [("a", 3, 6), ("b", 0, 2)],
    ]
    torch.manual_seed(0)
    net = Net()
    owned = ReplicatedShares(1, 3).owned(net)
    assert [piece for piece, _ in owned] == partition_rows(parameter_specs(net), 3)[1]
    for piece, tensor in owned:
        full = dict(net.named_parameters())[piece.name].detach()
        assert torch.equal(tensor.reshape(-1), row_view(full)[piece.start : piece.stop].reshape(-1))


def test_coverage_check_names_what_is_wrong():
    net = Net()
    full = partition_rows(parameter_specs(net), 2)
    _check_coverage(full, net)
    with pytest.raises(ValueError, match="table"):  # a gap: rows 0..5 of the table missing
        _check_coverage(
            [[p for p in full[0] if p.name != "table"] + [Piece("table", 5, 41, (3,), torch.float32)], full[1]], net
        )
    with pytest.raises(ValueError, match="float64"):
        _check_coverage([[Piece("wide", 0, 4, (2,), torch.float32)]], net)
    with pytest.raises(ValueError, match="does not have"):
        _check_coverage([[Piece("nope", 0, 1, (), torch.float32)]], net)


def test_received_weights_are_written_in_place():
    """A bucket lands in the rollout model's own tensors (their addresses kept: graphed replays reads of them)."""
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 1))
    pieces = partition_rows(parameter_specs(net), 1)[0]
    addresses = [p.data_ptr() for p in net.parameters()]
    buffer = torch.cat([p.detach().flatten() for p in net.parameters()]) + 1.0
    _unpack(buffer, pieces, dict(net.named_parameters()))
    assert [p.data_ptr() for p in net.parameters()] == addresses
    assert torch.equal(torch.cat([p.detach().flatten() for p in net.parameters()]), buffer)


def _sync_layouts(comm) -> list:
    """Every layout of LAYOUTS on one world of 5: train ranks 0..T-1, rollout ranks T..T+R-1."""
    out = []
    for num_train, num_rollout in LAYOUTS:
        senders, receivers = tuple(range(num_train)), tuple(range(num_train, num_train + num_rollout))
        torch.manual_seed(0 if comm.rank in senders else 100 + comm.rank)  # rollout ranks start elsewhere
        net = Net()
        sync = WeightSync(comm, senders, receivers, net, bucket_bytes=BUCKET_BYTES)
        if comm.rank in senders:  # "an update": identical on every train rank, as DDP keeps them
            with torch.no_grad():
                for p in net.parameters():
                    p.mul_(1.5).add_(0.25)
        moved = sync.sync(net)
        out.append((moved, sync.num_rounds, {k: v.detach().clone() for k, v in net.state_dict().items()}))
    return out


def test_rollout_ranks_get_the_train_ranks_weights_bitwise():
    results = run_local(_sync_layouts, 5)
    torch.manual_seed(0)
    net = Net()
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    for layout, (num_train, num_rollout) in enumerate(LAYOUTS):
        train = [results[r][layout] for r in range(num_train)]
        rollout = [results[r][layout] for r in range(num_train, num_train + num_rollout)]
        assert train[0][1] > 1  # several rounds of buckets
        expected = train[0][2]
        for _, _, state in train + rollout:
            assert state.keys() == expected.keys()
            assert all(torch.equal(state[k], expected[k]) and state[k].dtype == expected[k].dtype for k in state)
        assert not torch.equal(expected["table"], net.table.detach())  # the update did change them
        assert all(moved == SyncBytes(0, model_bytes) for moved, _, _ in rollout)
        sent = [moved.sent for moved, _, _ in train]
        assert sum(sent) == model_bytes * num_rollout
        assert max(sent) <= (model_bytes / num_train + 7 * 4) * num_rollout  # within a row (proj's) of an even split


def _sync_fsdp2(comm) -> dict:
    """Ranks 0-1 train with FSDP2 (fully_shard over their own mesh), rank 2 rolls out."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    train = comm.subgroup((0, 1))
    torch.manual_seed(0 if train is not None else 7)
    net = Net(scale_shape=(1,))
    if train is not None:
        mesh = DeviceMesh.from_group(train.group, "cpu")
        fully_shard(net.proj, mesh=mesh)
        fully_shard(net, mesh=mesh)
        with torch.no_grad():  # "an update", shard by shard
            for p in net.parameters():
                p.to_local().mul_(1.5).add_(0.25)
    sync = WeightSync(comm, (0, 1), (2,), net, bucket_bytes=BUCKET_BYTES)
    moved = sync.sync(net)
    if train is not None:
        state = {k: v.full_tensor().detach().clone() for k, v in net.named_parameters()}
        local = {k: tuple(v.to_local().shape) for k, v in net.named_parameters()}
    else:
        state, local = {k: v.detach().clone() for k, v in net.named_parameters()}, {}
    return {"moved": moved, "state": state, "local": local, "source": type(sync.source).__name__}


def test_fsdp2_shards_reach_the_rollout_rank_bitwise():
    trained, other, rollout = run_local(_sync_fsdp2, 3)
    assert trained["source"] == other["source"] == "ShardedShares"
    assert trained["local"]["table"] == (21, 3) and other["local"]["table"] == (20, 3)  # torch.chunk's split
    assert other["local"]["out.weight"] == (0, 5)  # one row over two ranks: rank 1's shard is empty
    for name, full in trained["state"].items():
        assert torch.equal(other["state"][name], full)
        assert torch.equal(rollout["state"][name], full), name
    model_bytes = sum(t.numel() * t.element_size() for t in trained["state"].values())
    assert trained["moved"].sent + other["moved"].sent == model_bytes
    assert rollout["moved"] == SyncBytes(0, model_bytes)
