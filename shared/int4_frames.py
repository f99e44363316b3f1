"""The `int4` store's records on disk: per chunk of rows, two zstd frames (`int4_frames`).

The records themselves (what a vector's bytes mean) are `shared.int4`'s; here only how a chunk
of them is laid out in a shard file: the int4 bytes column by column (each byte position over
the rows: codes, then scales and indices, which repeat), the rest row by row (zeros, and the few
fp8 vectors).
"""

from __future__ import annotations

import numpy as np

from shared.zstd_frames import zstd_frame, zstd_unframe

INT4_FRAMES = (
    "u32le size of frame 1; frame 1: zstd of the int4 bytes [rows, int4_bytes] transposed "
    "(column by column); frame 2: zstd of the other bytes [rows, W - int4_bytes], row by row"
)
# zstd as for the `planes` exponent bytes (`shared.codec.PLANES_EXPONENT_ZSTD`): zstd's fast
# strategy with a 64-entry hash table and 7-byte matches codes bytes nearly as Huffman literals
# and finds the long runs (zeros, repeated indices); `bench/store_bench.py` measures it.
INT4_ZSTD = dict(strategy="fast", window_log=18, hash_log=6, chain_log=6, search_log=1, min_match=7)


def int4_frames(records: np.ndarray, split: int) -> list[bytes]:
    """The stored bytes of uint8 records [..., W] (rows in C order) as consecutive pieces: the
    size of frame 1, frame 1 (zstd of bytes [:, :split] column by column: each byte position's
    values over the rows, a few symbols each), frame 2 (zstd of the rest, row by row).

    >>> r = np.zeros((64, 20), np.uint8); r[:, :8] = np.arange(8)
    >>> pieces = int4_frames(r, 8)
    >>> np.array_equal(int4_unframe(b"".join(pieces), 20), r), sum(map(len, pieces)) < 60
    (True, True)
    """
    rows = records.reshape(-1, records.shape[-1])
    cols = zstd_frame(np.ascontiguousarray(rows[:, :split].T), INT4_ZSTD)
    rest = zstd_frame(np.ascontiguousarray(rows[:, split:]), INT4_ZSTD)
    return [len(cols).to_bytes(4, "little"), cols, rest]


def int4_unframe(buf: bytes | memoryview, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of `int4_frames`: uint8 [rows, width] (into the first rows of `out`, C-contiguous
    [>= rows, width], if given)."""
    view = memoryview(buf)
    n = int.from_bytes(view[:4], "little")
    cols = np.frombuffer(zstd_unframe(view[4 : 4 + n]), np.uint8)
    rest = np.frombuffer(zstd_unframe(view[4 + n :]), np.uint8)
    rows, left = divmod(cols.size + rest.size, width)
    split = cols.size // max(rows, 1)
    if left or rows == 0 or split * rows != cols.size:
        raise ValueError(f"int4 frames of {cols.size} + {rest.size} bytes for records of {width}")
    if out is None:
        out = np.empty((rows, width), np.uint8)
    out = out.reshape(-1, width)[:rows]
    if len(out) != rows:
        raise ValueError(f"int4 frames of {rows} records, room for {len(out)}")
    out[:, :split] = cols.reshape(split, rows).T
    out[:, split:] = rest.reshape(rows, width - split)
    return out
