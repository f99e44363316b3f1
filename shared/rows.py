"""Which source rows a block of work covers: an extraction's unit (one part) and a
regeneration's chunk are fixed ranges of rows, numbered from 0, the last one shorter."""

from __future__ import annotations


def unit_rows(unit: int, *, rows_per_part: int, total_rows: int) -> range:
    """The rows of block `unit`: `rows_per_part` of them, the last block's fewer.

    >>> unit_rows(1, rows_per_part=4, total_rows=10), unit_rows(2, rows_per_part=4, total_rows=10)
    (range(4, 8), range(8, 10))
    """
    first = unit * rows_per_part
    return range(first, min(first + rows_per_part, total_rows))
