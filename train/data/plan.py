"""Epoch plans: which packed rows every rank and DataLoader worker reads, from metadata only.

Every micro-batch is one *row* of exactly `row_tokens` context tokens holding whole samples back
to back (the rest is padding), so compiled code sees one shape for the whole run. A plan is a
chain of small deterministic stages over plain values (part numbers, sample lengths):

    order_parts -> epoch_samples -> shuffle_buffer -> pack_rows -> rank_rows -> worker_rows

The whole epoch is packed first, then cut into contiguous slices: every rank gets the same
number of rows (at most world_size - 1 rows of an epoch are dropped, one per rank at most), and
its workers get nearly equal contiguous slices of those (a worker may get none). Samples, not
parts, are split, so any cache with a step's worth of rows trains on any number of ranks and
workers; a slice is contiguous in the shuffled order, so a worker still reads few parts.
Because the row list depends on nothing but the seed and the cache, 2 ranks x 1 worker and
1 rank x 2 workers with twice the accumulation see the same rows (when the row count is even),
which the tests use to check distributed training.

A rank consumes its workers round robin, the order torch's DataLoader returns the items of an
IterableDataset in; `rank_schedule` turns that into what each worker yields, with placeholders so
that every worker yields the same number of items per epoch and with a rotation of workers so a
resumed run continues the exact order. Optimizer steps may span an epoch boundary.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

T = TypeVar("T")

PACK_POOL = 64  # samples waiting to be placed into rows: enough short ones to fill the tails


class SampleRef(NamedTuple):
    """One sample of the cache: part number (index into the part list), row in it, its length
    (already clipped to what a row holds)."""

    part: int
    index: int
    length: int


def mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from several integers (seed, epoch, stream, ...)."""
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


# --- stages ----------------------------------------------------------------------------------


def order_parts(num_parts: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The parts of one epoch in a seeded random order (or in stored order without shuffle).

    >>> sorted(order_parts(4, seed=0, epoch=1)) == [0, 1, 2, 3]
    True
    """
    order = list(range(num_parts))
    if shuffle:
        random.Random(mix_seed(seed, epoch, 0x9A27)).shuffle(order)
    return order


def epoch_samples(
    parts: Iterable[int], lengths: Sequence[Sequence[int]], *, clip: int
) -> Iterator[SampleRef]:
    """Every sample of `parts` in part order then stored order, lengths clipped to `clip`;
    samples of length 0 (held out for evaluation, see `holdout_lengths`) are skipped.

    >>> list(epoch_samples([1, 0], [[3, 0], [9]], clip=4))
    [SampleRef(part=1, index=0, length=4), SampleRef(part=0, index=0, length=3)]
    """
    for p in parts:
        for n, length in enumerate(lengths[p]):
            if length > 0:
                yield SampleRef(p, n, min(int(length), clip))


def shuffle_buffer(items: Iterable[T], *, size: int, rng: random.Random) -> Iterator[T]:
    """Shuffle a stream with a bounded buffer: at most `size` items are held at once.

    Once the buffer is full, each new item replaces a randomly chosen held one, which is
    emitted; the rest are emitted in random order at the end. `size <= 1` passes items through.
    """
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        i = rng.randrange(size)
        yield buf[i]
        buf[i] = item
    rng.shuffle(buf)
    yield from buf


def pack_rows(
    samples: Iterable[SampleRef], *, row_tokens: int, pool: int = PACK_POOL
) -> Iterator[list[SampleRef]]:
    """Rows of whole samples, each at most `row_tokens` long (best fit from a small pool).

    Up to `pool` samples wait at once. A row starts with the longest waiting sample, then
    repeatedly takes the longest waiting sample that still fits (ties: the earliest), until
    none fits; the pool is refilled in arrival order after every placement. Every sample is
    placed exactly once; `length <= row_tokens` is required (clip first).

    >>> rows = pack_rows([SampleRef(0, i, n) for i, n in enumerate([5, 3, 4, 2])], row_tokens=7)
    >>> [[r.length for r in row] for row in rows]
    [[5, 2], [4, 3]]
    """
    source = iter(samples)
    waiting: list[tuple[int, int, SampleRef]] = []  # (length, -arrival, ref), sorted ascending
    arrival = 0

    def refill() -> None:
        nonlocal arrival
        while len(waiting) < pool:
            ref = next(source, None)
            if ref is None:
                return
            if not 0 < ref.length <= row_tokens:
                raise ValueError(f"sample length {ref.length} not in [1, {row_tokens}]")
            bisect.insort(waiting, (ref.length, -arrival, ref))
            arrival += 1

    refill()
    while waiting:
        row, room = [], row_tokens
        while waiting:
            # the longest waiting sample of length <= room; among equals the earliest arrival
            i = bisect.bisect_right(waiting, (room, 1, None)) - 1
            if i < 0:
                break
            length, _, ref = waiting.pop(i)
            row.append(ref)
            room -= length
            refill()
        yield row


def contiguous_slices(count: int, n: int) -> list[range]:
    """`n` contiguous ranges covering 0..count-1, sizes differing by at most one (larger first).

    >>> contiguous_slices(5, 2)
    [range(0, 3), range(3, 5)]
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    base, extra = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def rank_rows(num_rows: int, *, rank: int, world_size: int) -> range:
    """The rows of `rank`: contiguous, `num_rows // world_size` for every rank (the remainder,
    fewer than world_size rows, is dropped)."""
    per = num_rows // world_size
    return range(rank * per, (rank + 1) * per)


# --- composition -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """Everything an epoch plan depends on besides the epoch number."""

    lengths: tuple[tuple[int, ...], ...]  # per part, every sample's length (0: not in this plan)
    seed: int
    row_tokens: int
    shuffle_buffer: int
    max_length: int | None = None
    shuffle: bool = True

    @property
    def clip(self) -> int:
        """What a sample is truncated to: the row, or max_length if shorter."""
        return min(self.row_tokens, self.max_length or self.row_tokens)


def plan_rows(spec: PlanSpec, *, epoch: int) -> list[list[SampleRef]]:
    """Every packed row of one epoch, in the order ranks and workers slice them."""
    order = order_parts(len(spec.lengths), seed=spec.seed, epoch=epoch, shuffle=spec.shuffle)
    samples = epoch_samples(order, spec.lengths, clip=spec.clip)
    if spec.shuffle:
        rng = random.Random(mix_seed(spec.seed, epoch, 0x5B0F))
        samples = shuffle_buffer(samples, size=spec.shuffle_buffer, rng=rng)
    return list(pack_rows(samples, row_tokens=spec.row_tokens))


def worker_rows(
    num_rows: int, *, rank: int, world_size: int, workers: int, even: bool = True
) -> list[range]:
    """The row numbers each of `rank`'s workers reads in one epoch: contiguous slices of the
    rank's rows. `even`: every rank the same count (`rank_rows`); else nearly equal shares, none
    dropped.

    >>> worker_rows(7, rank=1, world_size=2, workers=2)
    [range(3, 5), range(5, 6)]
    """
    if even:
        mine = rank_rows(num_rows, rank=rank, world_size=world_size)
    else:
        mine = contiguous_slices(num_rows, world_size)[rank]
    return [
        range(mine.start + s.start, mine.start + s.stop)
        for s in contiguous_slices(len(mine), workers)
    ]


def epoch_lengths(
    spec: PlanSpec,
    *,
    world_size: int,
    epochs: int | None,
    steps: int | None,
    grad_accum: int,
    first: Sequence[int] = (),
) -> list[int]:
    """Rows per rank of each epoch to run: `epochs` of them, or enough for `steps` steps.
    `first`: the rows per rank of epochs planned otherwise (a first pass that followed the
    extraction, `train.data.growing`); the epochs after them are planned from `spec`.

    Raises ValueError when an epoch has fewer rows than one optimizer step needs on every rank
    (world_size x grad_accum): the caller turns it into a message about the cache's size.
    """
    limits: list[int] = list(first)
    need = steps * grad_accum if steps is not None else None
    while len(limits) < (epochs or 0) if need is None else sum(limits) < need:
        rows = len(plan_rows(spec, epoch=len(limits)))
        if rows < world_size * grad_accum:
            raise ValueError(
                f"epoch {len(limits)} packs into {rows} rows; one optimizer step needs "
                f"{world_size * grad_accum} (ranks x grad_accum)"
            )
        limits.append(rows // world_size)
    return limits


def evenly_spaced(total: int, count: int) -> list[int]:
    """`count` of 0..total-1, evenly spaced (centred in equal strides).

    >>> evenly_spaced(10, 2)
    [2, 7]
    """
    if not 0 <= count < max(total, 1):
        raise ValueError(f"cannot hold out {count} of {total} for evaluation")
    return sorted({int((i + 0.5) * total / count) for i in range(count)})


def holdout_lengths(
    lengths: Sequence[Sequence[int]], *, num_samples: int = 0, num_parts: int = 0
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(train, eval) per-part length tables: held-out samples have length 0 in the train table
    and the others 0 in the eval table. `num_parts` > 0 holds out that many whole parts, evenly
    spaced; otherwise `num_samples` samples evenly spaced over the cache in stored order.

    >>> holdout_lengths([[5, 6], [7, 8]], num_samples=1)
    (((5, 6), (0, 8)), ((0, 0), (7, 0)))
    """
    flat = [(p, n) for p, ls in enumerate(lengths) for n in range(len(ls))]
    if num_parts > 0:
        parts = set(evenly_spaced(len(lengths), num_parts))
        held = {(p, n) for p, n in flat if p in parts}
    else:
        held = {flat[i] for i in evenly_spaced(len(flat), num_samples)}
    train = tuple(
        tuple(0 if (p, n) in held else int(x) for n, x in enumerate(ls))
        for p, ls in enumerate(lengths)
    )
    evals = tuple(
        tuple(int(x) if (p, n) in held else 0 for n, x in enumerate(ls))
        for p, ls in enumerate(lengths)
    )
    return train, evals


# --- the order a rank consumes its workers in ------------------------------------------------


class WorkerItem(NamedTuple):
    """One item a worker yields: row `round` of its slice, or a placeholder when not real."""

    round: int
    real: bool


def _real_positions(counts: Sequence[int], limit: int) -> list[int]:
    """Round-robin positions (round * W + worker) of a rank's first `limit` real rows."""
    w = len(counts)
    positions = [
        t * w + s for t in range(max(counts, default=0)) for s in range(w) if t < counts[s]
    ]
    return positions[:limit]


def rank_schedule(
    counts: Sequence[int], *, limit: int, consumed: int = 0
) -> tuple[int, list[list[WorkerItem]]]:
    """What each of a rank's workers yields in one epoch, resuming after `consumed` rows.

    `counts[l]` is the number of rows of the rank's worker slice l (l = 0..W-1). The rank
    consumes slices round robin, skipping exhausted ones, and stops after `limit` rows.
    Returns `(rotation, items)`: physical worker i reads slice (i + rotation) % W and yields
    `items[(i + rotation) % W]`; merging the workers' items round robin (what DataLoader does)
    and dropping placeholders gives exactly rows consumed+1 .. limit in order.

    >>> rank_schedule([2, 1], limit=3)
    (0, [[WorkerItem(round=0, real=True), WorkerItem(round=1, real=True)], \
[WorkerItem(round=0, real=True), WorkerItem(round=1, real=False)]])
    """
    w = len(counts)
    if not 0 <= consumed <= limit <= sum(counts):
        raise ValueError(f"need 0 <= consumed ({consumed}) <= limit ({limit}) <= {sum(counts)}")
    real = _real_positions(counts, limit)
    rounds = real[-1] // w + 1 if real else 0
    start = real[consumed - 1] + 1 if consumed else 0
    first_round, rotation = divmod(start, w)
    real_set = set(real)
    items = []
    for s in range(w):
        begin = first_round if s >= rotation else first_round + 1
        items.append([WorkerItem(t, t * w + s in real_set) for t in range(begin, rounds)])
    return rotation, items


def merge_round_robin(streams: Sequence[Sequence[T]]) -> list[T]:
    """Round robin over `streams`, skipping exhausted ones: the DataLoader's order of workers."""
    out: list[T] = []
    for t in range(max((len(s) for s in streams), default=0)):
        out.extend(s[t] for s in streams if t < len(s))
    return out
