"""Epoch plans: which micro-batches every rank and DataLoader worker reads, from metadata only.

A plan is a chain of small deterministic stages over plain values (part numbers, sample lengths):

    order_parts -> split_by_tokens (into ranks x workers streams) -> stream_samples
                -> shuffle_buffer -> pack

A *stream* is the sequence of micro-batches one DataLoader worker of one rank produces in one
epoch; there are `world_size * workers` of them, numbered `rank * workers + worker`. Splitting
parts straight into streams (instead of ranks first, then workers) makes the global batch depend
only on the number of streams: 2 ranks x 1 worker and 1 rank x 2 workers with twice the gradient
accumulation see the same micro-batches, which the tests use to check distributed training.

A rank consumes its streams round robin, the same order torch's DataLoader returns items of an
IterableDataset in; `rank_schedule` turns that into what each worker yields, with placeholders so
every worker yields the same number of items per epoch (the DataLoader's round robin then never
drifts) and with a rotation of workers so a resumed run continues the exact order. Every rank
runs `epoch_limit` micro-batches per epoch: the shortest rank's count, rounded down to whole
optimizer steps, so no rank waits in a collective at an epoch's end.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import numpy as np

PAD_MULTIPLE = 128  # sequence lengths are padded to this: a bounded set of compiled shapes

T = TypeVar("T")


class SampleRef(NamedTuple):
    """One sample of the cache: part number (index into the part list), row in it, its length."""

    part: int
    index: int
    length: int


def mix_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from several integers (seed, epoch, stream, ...)."""
    state = np.random.SeedSequence([int(v) for v in values]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def padded_length(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """`length` rounded up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-length // multiple) * multiple)


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


def split_by_tokens(parts: Sequence[int], tokens: Sequence[int], *, n: int) -> list[list[int]]:
    """Split `parts` into `n` lists of about equal token count, each keeping the input order.

    Largest parts first onto the lightest list (ties: the lowest list), then each list is put
    back into the order of `parts`. `tokens[p]` is the token count of part `p`.

    >>> split_by_tokens([0, 1, 2, 3], [5, 1, 1, 3], n=2)
    [[0], [1, 2, 3]]
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rank_in_input = {p: i for i, p in enumerate(parts)}
    loads = [0] * n
    bins: list[list[int]] = [[] for _ in range(n)]
    for p in sorted(parts, key=lambda p: (-tokens[p], rank_in_input[p])):
        lightest = min(range(n), key=lambda b: (loads[b], b))
        bins[lightest].append(p)
        loads[lightest] += tokens[p]
    return [sorted(b, key=rank_in_input.__getitem__) for b in bins]


def stream_samples(
    parts: Iterable[int], lengths: Sequence[Sequence[int]], *, max_length: int | None = None
) -> Iterator[SampleRef]:
    """Every sample of `parts` in part order then stored order, lengths clipped to max_length."""
    for p in parts:
        for n, length in enumerate(lengths[p]):
            length = int(length)
            yield SampleRef(p, n, length if max_length is None else min(length, max_length))


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


def pack(
    samples: Iterable[SampleRef], *, batch_tokens: int, multiple: int = PAD_MULTIPLE
) -> Iterator[list[SampleRef]]:
    """Greedy micro-batches in arrival order with padded length x batch size <= batch_tokens.

    The padded length is the longest sample's length rounded up to `multiple`; a sample that
    does not fit the budget even alone forms a batch by itself.

    >>> [len(b) for b in pack([SampleRef(0, i, 100) for i in range(5)], batch_tokens=256)]
    [2, 2, 1]
    """
    batch: list[SampleRef] = []
    longest = 0
    for s in samples:
        new_longest = max(longest, padded_length(s.length, multiple))
        if batch and new_longest * (len(batch) + 1) > batch_tokens:
            yield batch
            batch, new_longest = [], padded_length(s.length, multiple)
        batch.append(s)
        longest = new_longest
    if batch:
        yield batch


# --- composition -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """Everything an epoch plan depends on besides the epoch number."""

    lengths: tuple[tuple[int, ...], ...]  # per part, the length of every sample
    seed: int
    num_streams: int  # world_size x workers
    batch_tokens: int
    shuffle_buffer: int
    max_length: int | None = None
    shuffle: bool = True

    @property
    def part_tokens(self) -> list[int]:
        return [sum(ls) for ls in self.lengths]


def plan_stream(spec: PlanSpec, parts: Sequence[int], *, epoch: int, stream: int) -> list:
    """The micro-batches (lists of SampleRef) of one stream in one epoch."""
    samples = stream_samples(parts, spec.lengths, max_length=spec.max_length)
    if spec.shuffle:
        rng = random.Random(mix_seed(spec.seed, epoch, stream, 0x5B0F))
        samples = shuffle_buffer(samples, size=spec.shuffle_buffer, rng=rng)
    return list(pack(samples, batch_tokens=spec.batch_tokens))


def stream_parts(spec: PlanSpec, *, epoch: int) -> list[list[int]]:
    """The parts of every stream in one epoch (the order each stream reads them in)."""
    order = order_parts(len(spec.lengths), seed=spec.seed, epoch=epoch, shuffle=spec.shuffle)
    return split_by_tokens(order, spec.part_tokens, n=spec.num_streams)


def plan_epoch(spec: PlanSpec, *, epoch: int) -> list[list[list[SampleRef]]]:
    """Micro-batches of every stream in one epoch: `plan[stream][i]` is a list of SampleRef."""
    return [
        plan_stream(spec, parts, epoch=epoch, stream=s)
        for s, parts in enumerate(stream_parts(spec, epoch=epoch))
    ]


def epoch_limit(stream_counts: Sequence[int], *, workers: int, grad_accum: int) -> int:
    """Micro-batches every rank runs in an epoch: the shortest rank's, in whole optimizer steps.

    `stream_counts[s]` is the number of micro-batches of stream s; rank r owns streams
    r*workers .. r*workers + workers - 1.

    >>> epoch_limit([3, 4, 5, 1], workers=2, grad_accum=2)
    6
    """
    per_rank = [sum(stream_counts[r : r + workers]) for r in range(0, len(stream_counts), workers)]
    shortest = min(per_rank) if per_rank else 0
    return shortest - shortest % grad_accum


# --- the order a rank consumes its streams in ------------------------------------------------


class WorkerItem(NamedTuple):
    """One item a worker yields: batch `round` of its stream, or a placeholder when not real."""

    round: int
    real: bool


def _real_positions(counts: Sequence[int], limit: int) -> list[int]:
    """Round-robin positions (round * W + stream) of a rank's first `limit` real batches."""
    w = len(counts)
    positions = [
        t * w + s for t in range(max(counts, default=0)) for s in range(w) if t < counts[s]
    ]
    return positions[:limit]


def rank_schedule(
    counts: Sequence[int], *, limit: int, consumed: int = 0
) -> tuple[int, list[list[WorkerItem]]]:
    """What each of a rank's workers yields in one epoch, resuming after `consumed` batches.

    `counts[l]` is the number of micro-batches of the rank's stream l (l = 0..W-1). The rank
    consumes streams round robin, skipping exhausted ones, and stops after `limit` batches.
    Returns `(rotation, items)`: physical worker i reads stream (i + rotation) % W and yields
    `items[(i + rotation) % W]`; merging the workers' items round robin (what DataLoader does)
    and dropping placeholders gives exactly batches consumed+1 .. limit in order.

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
