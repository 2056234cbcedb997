"""Who sends which samples to whom when a step's batch changes layout: a pure function.

    gathered, per world rank: [num_items] and one row [uid, group, tokens, meta bytes] per item
        │  plan_move(...)        no Comm, no rank of its own: every rank computes the same plan
        ▼
    items          source replica by replica, position inside the replica (the global order)
    bin_of         item → destination replica (balanced_assignment: equal counts, tokens balanced)
    senders        (item, destination rank) → the destination itself if it holds a copy, else the
                   member of the item's source replica that has sent the fewest bytes so far
    pairs          (sender, receiver) → items in global order; its byte size is what the
                   sender's chunk to the receiver weighs (fixed-size tensor rows + its own pickles)

`redistribute` (redistribute.py) gathers the rows, calls `plan_move` and moves the bytes.
Because the plan depends only on gathered values, every rank agrees on it without a coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass

from distflow.data.balance import balanced_assignment, bin_loads, imbalance
from distflow.layout import Layout

UID, GROUP, TOKENS, META_BYTES = range(4)
"""Columns of a gathered item row."""


@dataclass
class MovePlan:
    items: list[tuple[int, int, list[int]]]
    """(source replica, position inside the replica, [uid, group, tokens, meta bytes]) in global order."""
    bin_of: list[int]
    """Item → destination replica."""
    pairs: dict[tuple[int, int], list[int]]
    """(sender, receiver) world ranks → the items the sender packs for the receiver, in global order."""
    rows: list[list[list[int]]]
    """The gathered rows of every world rank (a sender's meta bytes are those of its own pickles)."""
    row_bytes: int
    """Bytes of one item's tensor rows (every field, one row each)."""
    imbalance_before: float
    """max/mean tokens per destination replica if items were split in arrival order."""
    imbalance_after: float

    def meta_sizes(self, sender: int, receiver: int) -> list[int]:
        """Lengths of the sender's pickles of the items it sends to `receiver`."""
        return [self.rows[sender][self.items[i][1]][META_BYTES] for i in self.pairs.get((sender, receiver), ())]

    def chunk_bytes(self, sender: int, receiver: int) -> int:
        return sum(self.row_bytes + size for size in self.meta_sizes(sender, receiver))

    def send_sizes(self, rank: int) -> list[int]:
        return [self.chunk_bytes(rank, q) for q in range(len(self.rows))]

    def recv_sizes(self, rank: int) -> list[int]:
        return [self.chunk_bytes(s, rank) for s in range(len(self.rows))]

    def positions(self, sender: int, receiver: int) -> list[int]:
        """Where, in the sender's own batch, the items it sends to `receiver` sit."""
        return [self.items[i][1] for i in self.pairs.get((sender, receiver), ())]

    def uids(self, sender: int, receiver: int) -> list[int]:
        return [self.items[i][2][UID] for i in self.pairs.get((sender, receiver), ())]


def plan_move(
    counts: list[int],
    rows: list[list[list[int]]],
    row_bytes: int,
    src: Layout,
    dst: Layout,
    *,
    keep_groups: bool,
    uneven: bool = False,
) -> MovePlan:
    """The plan of a move from `src` to `dst`, from what every world rank holds.

    `counts[r]`: items on world rank r; `rows[r][p]`: [uid, group, tokens, meta bytes] of its
    item p (rows past `counts[r]` are padding). `keep_groups`: items of one group land on one
    replica. `uneven`: see `redistribute`.
    """
    items = _items_in_global_order(counts, rows, src)
    total = len(items)
    unit = [row[GROUP] for _, _, row in items] if keep_groups else None
    tokens = [row[TOKENS] for _, _, row in items]
    try:
        bin_of = balanced_assignment(tokens, dst.dp_size, units=unit, uneven=uneven)
    except ValueError as err:
        raise RuntimeError(f"cannot split {total} samples over {dst.describe()}: {err}") from None
    naive = [i * dst.dp_size // max(total, 1) for i in range(total)]

    item_bytes = [row_bytes + row[META_BYTES] for _, _, row in items]
    sender_of = _choose_senders(items, bin_of, item_bytes, src, dst)
    pairs: dict[tuple[int, int], list[int]] = {}
    for i in range(total):
        for q in dst.replica(bin_of[i]):
            pairs.setdefault((sender_of[(i, q)], q), []).append(i)
    return MovePlan(
        items,
        bin_of,
        pairs,
        rows,
        row_bytes,
        imbalance_before=imbalance(bin_loads(tokens, naive, dst.dp_size)),
        imbalance_after=imbalance(bin_loads(tokens, bin_of, dst.dp_size)),
    )


def _items_in_global_order(
    counts: list[int], rows: list[list[list[int]]], src: Layout
) -> list[tuple[int, int, list[int]]]:
    """Source replica by replica, position inside the replica; checks that the ranks of a
    replica hold the same items (uid, group, tokens)."""
    items: list[tuple[int, int, list[int]]] = []
    for r in range(src.dp_size):
        members = src.replica(r)
        count = counts[members[0]]
        for m in members[1:]:
            _check_same_items(rows, counts, members[0], m)
        items.extend((r, p, rows[members[0]][p]) for p in range(count))
    return items


def _check_same_items(rows: list[list[list[int]]], counts: list[int], leader: int, member: int) -> None:
    # Pickles of equal values may differ in length (object sharing), so meta bytes are not compared.
    count = counts[leader]
    same = [row[:3] for row in rows[member][:count]] == [row[:3] for row in rows[leader][:count]]
    if counts[member] == count and same:
        return
    diff = next((p for p in range(count) if rows[member][p][:3] != rows[leader][p][:3]), None)
    detail = (
        ""
        if diff is None
        else (f"; item {diff}: [uid, group, tokens] = {rows[leader][diff][:3]} vs {rows[member][diff][:3]}")
    )
    raise RuntimeError(
        f"ranks {leader} and {member} of one replica hold different samples "
        f"({counts[leader]} vs {counts[member]} items{detail}); the ranks of a "
        f"replica must compute identical results"
    )


def _choose_senders(items, bin_of, item_bytes, src: Layout, dst: Layout) -> dict[tuple[int, int], int]:
    """(item, destination rank) → sending rank: the destination itself if it holds a copy,
    else the member of the item's source replica that has sent the fewest bytes so far."""
    sent: dict[int, int] = {}
    sender_of = {}
    for i, (r, _, _) in enumerate(items):
        members = src.replica(r)
        for q in dst.replica(bin_of[i]):
            if q in members:
                sender_of[(i, q)] = q
                continue
            sender = min(members, key=lambda m: (sent.get(m, 0), m))
            sent[sender] = sent.get(sender, 0) + item_bytes[i]
            sender_of[(i, q)] = sender
    return sender_of
