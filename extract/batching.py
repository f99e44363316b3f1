"""Batching rows by length: little padding, and no padding ever stored."""

from __future__ import annotations

from collections.abc import Sequence


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices sorted longest first (stable, so the order depends only on the lengths).

    >>> length_order([3, 9, 3, 5])
    [1, 3, 0, 2]
    """
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def make_batches(lengths: Sequence[int], *, batch_tokens: int) -> list[range]:
    """Split consecutive items (already sorted longest first) into batches whose padded size
    (rows x longest row) stays within `batch_tokens`; an item longer than that is alone.

    >>> make_batches([8, 6, 4, 4, 2], batch_tokens=12)
    [range(0, 1), range(1, 3), range(3, 5)]
    """
    batches, start = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or (i - start + 1) * lengths[start] > batch_tokens:
            batches.append(range(start, i))
            start = i
    return [b for b in batches if len(b)]
