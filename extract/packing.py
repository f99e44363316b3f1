"""Packed rows: whole samples back to back in one row of a fixed size, for a compiled forward.

A packed forward sees one shape for the whole run, [1, chunk_tokens], so a compiled target is
compiled once, and no padding is computed but the tail of each chunk. Samples never straddle two
chunks; positions restart at 0 at each sample, and attention (and a linear-attention layer's
state) is confined to the sample (`doc_ids`, `cu_seqlens`). The tail after the last sample is one
more segment of pad tokens: it attends only to itself, so no row of the attention is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# flex_attention's block size: a chunk is a whole number of blocks.
CHUNK_MULTIPLE = 128


def chunk_size(batch_tokens: int, max_length: int) -> int:
    """Tokens per packed row: the batch budget, at least one row of `max_length`, rounded up to
    whole attention blocks.

    >>> chunk_size(16384, 3072), chunk_size(1000, 3000), chunk_size(100, 10)
    (16384, 3072, 128)
    """
    need = max(batch_tokens, max_length)
    return -(-need // CHUNK_MULTIPLE) * CHUNK_MULTIPLE


def row_sizes(chunk_tokens: int) -> tuple[int, ...]:
    """The sizes a packed row takes, largest first: `chunk_tokens`, then a half and a quarter of
    it (whole blocks). A row whose samples fill no more than a smaller size runs at that size,
    so the last row of a part (its samples' leftovers: on average half a row) computes less
    padding, for one compiled graph per size.

    >>> row_sizes(16384), row_sizes(3072), row_sizes(256)
    ((16384, 8192, 4096), (3072, 1536, 768), (256, 128))
    """
    sizes = {-(-(chunk_tokens // d) // CHUNK_MULTIPLE) * CHUNK_MULTIPLE for d in (1, 2, 4)}
    return tuple(sorted(sizes, reverse=True))


def fitting_size(sizes: Sequence[int], tokens: int) -> int:
    """The smallest of `sizes` that holds `tokens`.

    >>> fitting_size((16384, 8192, 4096), 155), fitting_size((16384, 8192, 4096), 11451)
    (4096, 16384)
    """
    return min(s for s in sizes if s >= tokens)


def pack_rows(lengths: Sequence[int], *, chunk_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into chunks of at most `chunk_tokens` tokens, first fit in the
    order given (longest first gives first-fit decreasing: little tail left per chunk). Each chunk
    lists its indices in the order given; chunks are in the order they were opened.

    >>> pack_rows([8, 6, 4, 4, 2], chunk_tokens=12)
    [[0, 2], [1, 3, 4]]
    >>> pack_rows([5, 5], chunk_tokens=4)
    Traceback (most recent call last):
    ...
    ValueError: a row of 5 tokens does not fit a packed row of 4
    """
    chunks: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > chunk_tokens:
            raise ValueError(f"a row of {n} tokens does not fit a packed row of {chunk_tokens}")
        for c, free in enumerate(room):
            if n <= free:
                chunks[c].append(i)
                room[c] -= n
                break
        else:
            chunks.append([i])
            room.append(chunk_tokens - n)
    return chunks


def taper_end(
    chunks: list[list[int]], lengths: Sequence[int], *, chunk_tokens: int, small: int
) -> list[list[int]]:
    """`chunks` (`pack_rows`'s) with the rows of the last ones, about one chunk's worth, packed
    again into rows of `small` tokens: the run's last forwards are then small, and what the host
    still has to compress and write after the last one is a small row's states, not a whole
    chunk's (the larger chunk before them compresses while they run). Only rows that fit `small`
    are moved; the chunks before them stay as they were.

    >>> taper_end([[0, 1], [2, 3, 4]], [6, 5, 3, 3, 2], chunk_tokens=11, small=4)
    [[0, 1], [2], [3], [4]]
    >>> taper_end([[0], [1]], [9, 8], chunk_tokens=10, small=4)
    [[0], [1]]
    """
    moved: list[int] = []
    keep = len(chunks)
    while keep and sum(lengths[i] for i in moved) < chunk_tokens:
        last = chunks[keep - 1]
        if any(lengths[i] > small for i in last):
            break
        moved = last + moved
        keep -= 1
    if not moved:
        return chunks
    again = pack_rows([lengths[i] for i in moved], chunk_tokens=small)
    return chunks[:keep] + [[moved[j] for j in chunk] for chunk in again]


@dataclass(frozen=True)
class Packed:
    """One packed row: `ids`, `positions` and `doc_ids` [chunk_tokens]; `cu_seqlens` [segments
    + 1] the segment bounds (the samples, then the pad tail if any); `real` tokens before it."""

    ids: np.ndarray
    positions: np.ndarray
    doc_ids: np.ndarray
    cu_seqlens: np.ndarray
    real: int


def packed_inputs(rows: Sequence[np.ndarray], *, chunk_tokens: int, pad_id: int) -> Packed:
    """The packed row of `rows` (token id arrays) followed by a tail of `pad_id`.

    Built with numpy, which keeps the GIL: each torch call would release it and wait to get it
    back from the writer threads, on the thread that feeds the GPU.

    >>> p = packed_inputs([np.array([5, 6, 7]), np.array([8])], chunk_tokens=6, pad_id=0)
    >>> p.ids.tolist(), p.positions.tolist(), p.doc_ids.tolist()
    ([5, 6, 7, 8, 0, 0], [0, 1, 2, 0, 0, 1], [0, 0, 0, 1, 2, 2])
    >>> p.cu_seqlens.tolist(), p.real
    ([0, 3, 4, 6], 4)
    """
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    real = int(lengths.sum())
    if real > chunk_tokens:
        raise ValueError(f"{real} tokens do not fit a packed row of {chunk_tokens}")
    tail = chunk_tokens - real
    segments = np.concatenate([lengths, [tail]]) if tail else lengths
    cu_seqlens = np.concatenate([[0], np.cumsum(segments)]).astype(np.int64)
    ids = np.full(chunk_tokens, pad_id, dtype=np.int64)
    if len(rows):
        ids[:real] = np.concatenate(rows)
    doc_ids = np.repeat(np.arange(len(segments), dtype=np.int32), segments)
    positions = np.arange(chunk_tokens, dtype=np.int64) - np.repeat(cu_seqlens[:-1], segments)
    return Packed(ids, positions, doc_ids, cu_seqlens, real)


def sample_groups(
    lengths: Sequence[int], starts: Sequence[int], *, budget: int
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The samples of a packed row as padded batches for a dense causal attention kernel.

    Samples (`lengths`, starting at `starts` in the row), longest first, are cut into batches of
    at most `budget` padded tokens. Per batch: `index` [B, W], the row position each slot reads
    (a slot past its sample's end repeats its last token: a causal query never sees it),
    `src`, the flat slots of real tokens, and `dst`, their positions in the row.

    >>> [g[0].tolist() for g in sample_groups([3, 2, 1], [0, 3, 5], budget=6)]
    [[[0, 1, 2], [3, 4, 4]], [[5]]]
    >>> g = sample_groups([2, 3], [0, 2], budget=6)[0]
    >>> g[0].tolist(), g[1].tolist(), g[2].tolist()
    ([[2, 3, 4], [0, 1, 1]], [0, 1, 2, 3, 4], [2, 3, 4, 0, 1])
    """
    from extract.batching import length_order, make_batches

    order = length_order(lengths)
    lengths, starts = [lengths[i] for i in order], [starts[i] for i in order]
    groups = []
    for batch in make_batches(lengths, batch_tokens=budget):
        width = lengths[batch.start]
        slot = np.arange(width)
        index = np.stack([starts[i] + np.minimum(slot, lengths[i] - 1) for i in batch])
        src = np.concatenate([b * width + np.arange(lengths[i]) for b, i in enumerate(batch)])
        dst = np.concatenate([starts[i] + np.arange(lengths[i]) for i in batch])
        groups.append((index.astype(np.int64), src.astype(np.int64), dst.astype(np.int64)))
    return groups
