"""Disaggregated weight sync: every train rank sends its own share of the policy to every rollout rank.

    train ranks t0 .. t{T-1}                          rollout-only ranks r0 .. r{R-1}
    share_i = what t_i owns (weight_shares.py:        each needs the whole model
      DDP: 1/T of the bytes; FSDP2: its shard)

    start-up (once, world all_gather_object): every rank learns every share's pieces
      (name, dim-0 rows, row shape, dtype); rollout ranks check the pieces cover each of
      their parameters exactly once, with the same shapes and dtypes
    sync, round k = 0, 1, ...:   t_i ──bucket k of share_i (≤ 64 MiB, one dtype)──► r_j
      for every (i, j) at once: each rank posts all its sends and receives of the round
      (one batch_isend_irecv), then waits; r_j copies each bucket into its parameters' rows

    bytes per sync: t_i sends R · |share_i| ≈ R · model / T; r_j receives the model once
    (under LoRA "the model" is its adapters: the base weights never change).

Why point-to-point and not one broadcast group per train rank ([t_i] + rollout ranks):
- The same calls on gloo and NCCL (NCCL runs a round in one ncclGroupStart/End) over the
  world group: no new communicators. T broadcast groups would put T communicators on every
  rollout rank (buffers and start-up cost each under NCCL, thousands at scale).
- All T senders push at once; broadcasts over T groups would have to follow one global order
  on every rank (or deadlock), so the rollout ranks would take them one group at a time.
- No ordering hazard: every op of a round is posted before any is waited on, the rounds are
  the same on every rank (the pieces are agreed at start-up), and a (sender, receiver) pair
  exchanges at most one message per round, so messages match by order.
- Exact byte counts: a share crosses the wire once per rollout rank. A broadcast's per-rank
  traffic is the backend's choice (gloo: a binomial tree whose root sends ⌈log2(R+1)⌉
  copies; NCCL: a pipelined ring whose root sends one and whose receivers forward).
- The cost: a sender's bytes grow with R. Where R ≫ T, a relay (each train rank sends its
  share once, to one rollout rank, and the rollout ranks all-gather) would keep them at
  model / T; not built.

Invariants: rollout ranks end with parameters bitwise equal to the train ranks' (raw copies,
no casts); a sender holds one packed bucket at a time, a receiver one bucket per sender.
Synchronous: the next rollout starts after the copy lands, and the caller then tells the
rollout engine of the new weights (`Engines.new_weights`: the weight-sync stage, a resume).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distflow.comm import Comm
from distflow.sync.weight_shares import Piece, ShareSource, row_view, source_for
from distflow.training.lora import synced_parameters

BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class SyncBytes:
    """Payload bytes one rank moved in one sync."""

    sent: int
    received: int


class WeightSync:
    """Made once at start-up by every rank of the world (the piece exchange is collective)."""

    def __init__(
        self,
        world: Comm,
        senders: tuple[int, ...],
        receivers: tuple[int, ...],
        model: torch.nn.Module,
        *,
        source: ShareSource | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        if set(senders) & set(receivers) or not senders:
            raise ValueError(f"weight sync goes from train ranks {senders} to other ranks, got receivers {receivers}")
        self.world, self.senders, self.receivers = world, tuple(senders), tuple(receivers)
        self.source: ShareSource | None = None
        """What this rank sends (train ranks only)."""
        if world.rank in senders:
            self.source = source or source_for(model, senders.index(world.rank), len(senders))
        mine = [piece for piece, _ in self.source.owned(model)] if self.source is not None else []
        shares = world.all_gather_object(mine)
        self.buckets = [_buckets(shares[rank], bucket_bytes) for rank in senders]
        """Per sender, its pieces in buckets: round k moves every sender's k-th bucket."""
        if world.rank in receivers:
            _check_coverage([shares[rank] for rank in senders], model)

    @property
    def num_rounds(self) -> int:
        return max(len(buckets) for buckets in self.buckets)

    def sync(self, model: torch.nn.Module) -> SyncBytes:
        """Train ranks' parameters into `model` on every rollout rank; returns this rank's bytes."""
        rank = self.world.rank
        if rank in self.senders:
            return self._send(model)
        if rank in self.receivers:
            return self._receive(model)
        return SyncBytes(0, 0)

    def _send(self, model: torch.nn.Module) -> SyncBytes:
        owned = self.source.owned(model)
        mine = self.buckets[self.senders.index(self.world.rank)]
        if [piece for piece, _ in owned] != [piece for bucket in mine for piece in bucket]:
            raise RuntimeError("this train rank's share of the weights changed since start-up")
        tensors = iter(tensor for _, tensor in owned)
        sent = 0
        for k in range(self.num_rounds):
            sends = []
            if k < len(mine):
                flat = torch.cat([next(tensors).reshape(-1) for _ in mine[k]])
                sends = [(flat, receiver) for receiver in self.receivers]
                sent += flat.numel() * flat.element_size() * len(self.receivers)
            self.world.exchange(sends, [])
        return SyncBytes(sent, 0)

    def _receive(self, model: torch.nn.Module) -> SyncBytes:
        params = dict(synced_parameters(model))
        received = 0
        for k in range(self.num_rounds):
            recvs = []
            for sender, buckets in zip(self.senders, self.buckets, strict=True):
                if k < len(buckets):
                    numel = sum(piece.numel for piece in buckets[k])
                    buffer = torch.empty(numel, dtype=buckets[k][0].dtype, device=self.world.device)
                    recvs.append((buffer, sender, buckets[k]))
            self.world.exchange([], [(buffer, sender) for buffer, sender, _ in recvs])
            for buffer, _, bucket in recvs:
                _unpack(buffer, bucket, params)
                received += buffer.numel() * buffer.element_size()
        return SyncBytes(0, received)


def _unpack(buffer: torch.Tensor, bucket: list[Piece], params: dict[str, torch.nn.Parameter]) -> None:
    offset = 0
    with torch.no_grad():
        for piece in bucket:
            # In place: the weights keep their addresses (graphed's CUDA graphs replay reads of them); the
            # rollout engine hears of the new weights from the caller (`Engines.new_weights`), not the write.
            rows = row_view(params[piece.name])[piece.start : piece.stop]
            rows.copy_(buffer[offset : offset + piece.numel].view(rows.shape))
            offset += piece.numel


def _buckets(pieces: list[Piece], bucket_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces of one dtype, up to `bucket_bytes` each (a larger piece goes alone)."""
    buckets: list[list[Piece]] = []
    size = 0
    for piece in pieces:
        if not buckets or buckets[-1][0].dtype != piece.dtype or size + piece.num_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(piece)
        size += piece.num_bytes
    return buckets


def _check_coverage(shares: list[list[Piece]], model: torch.nn.Module) -> None:
    """The senders' pieces cover every row of every parameter of `model` exactly once."""
    params = dict(synced_parameters(model))
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in params}
    for piece in (piece for share in shares for piece in share):
        param = params.get(piece.name)
        if param is None:
            raise ValueError(f"weight sync: the train ranks send {piece.name}, which the rollout model does not have")
        if piece.row_shape != tuple(param.shape[1:]) or piece.dtype != param.dtype:
            raise ValueError(
                f"weight sync: {piece.name} is {piece.dtype} rows of {piece.row_shape} on the train "
                f"ranks but {param.dtype} {tuple(param.shape)} on the rollout ranks"
            )
        covered[piece.name].append((piece.start, piece.stop))
    for name, ranges in covered.items():
        num_rows = 0 if params[name].numel() == 0 else row_view(params[name]).shape[0]
        contiguous, position = True, 0
        for start, stop in sorted(ranges):
            contiguous = contiguous and start == position
            position = stop
        if not contiguous or position != num_rows:
            raise ValueError(
                f"weight sync: the train ranks' pieces of {name} cover rows {sorted(ranges)}, not 0..{num_rows} once"
            )
