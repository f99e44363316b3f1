"""crc32c checksums of buffers, files and whole parts: what the manifest records and verify
recomputes. A part's checksum is combined from the writers' per-file crc32c (`crc32c_combine`), so
a commit never reads its files back."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Mapping
from pathlib import Path

import crc32c
import numpy as np

from shared.codec import c_contiguous

CHECKSUM_PREFIX = "crc32c:"
_READ_BLOCK = 8 << 20


def crc32c_hex(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0) -> str:
    """Prefixed crc32c of a buffer (a numpy array is hashed as its raw bytes)."""
    if isinstance(data, np.ndarray):
        data = c_contiguous(data).view(np.uint8).reshape(-1)
    return f"{CHECKSUM_PREFIX}{crc32c.crc32c(data, value):08x}"


def _crc_file_into(path: Path, value: int) -> int:
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            value = crc32c.crc32c(block, value)
    return value


def crc32c_file(path: Path | str) -> str:
    """Prefixed crc32c of a file's bytes."""
    return f"{CHECKSUM_PREFIX}{_crc_file_into(Path(path), 0):08x}"


# CRC-32C (Castagnoli), reflected, for combining checksums of consecutive byte ranges.
_CRC32C_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32C polynomial (reflected bit order, as zlib's crc32 combine)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of A + B from crc32c(A), crc32c(B) and len(B), without reading either.

    crc(A + B) = crc(A) * x^(8 len2) + crc(B) modulo the polynomial; the multiplication by
    x^(8 len2) applies one byte-table operator per set bit of len2 (about ten table lookups per
    bit), so a commit combining thousands of shard files holds the GIL only briefly.

    >>> a, b = b"hidden ", b"states"
    >>> crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
    True
    """
    value, k = crc1, 3  # x^(8 * len2) = product of x^(2^(3 + i)) over the set bits i of len2
    while len2:
        if len2 & 1:
            t0, t1, t2, t3 = _times_x2n_tables(k & 31)
            v = value
            value = t0[v & 255] ^ t1[(v >> 8) & 255] ^ t2[(v >> 16) & 255] ^ t3[v >> 24]
        len2 >>= 1
        k += 1
    return value ^ crc2


@functools.cache
def _times_x2n_tables(k: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Multiplication by x^(2^k) modulo the polynomial, as four 256-entry tables indexed by the
    bytes of the multiplicand (it is linear in the multiplicand's bits)."""
    columns = [_multmodp(_X2N[k], 1 << bit) for bit in range(32)]
    tables = []
    for j in range(4):
        table = [0] * 256
        for byte in range(1, 256):
            low = byte & -byte
            table[byte] = table[byte ^ low] ^ columns[8 * j + low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def part_checksum(
    path: Path,
    known: Mapping[str, tuple[int, int]] | None = None,
    sizes: Mapping[str, int] | None = None,
) -> str:
    """Checksum of a part: a .tar's bytes, or for a zarr folder every file in sorted relative
    path order with its path, its size and its bytes all hashed (so a renamed, moved, truncated
    or missing file changes the result).

    `known` maps relative paths to (size, crc32c of the bytes) that the writer computed while
    writing them: those files are combined in without being read again (a file whose size
    differs is read); a .tar's own under "". Verification never passes `known`: it reads
    everything. `sizes`: the folder's `tree_file_sizes`, when the caller has it already.
    """
    path = Path(path)
    if path.is_file():  # a tar: `known` may give its (size, crc32c) under ""
        size_crc = (known or {}).get("")
        if size_crc is not None and size_crc[0] == path.stat().st_size:
            return f"{CHECKSUM_PREFIX}{size_crc[1]:08x}"
        return crc32c_file(path)
    files = tree_file_sizes(path) if sizes is None else sizes
    known = known or {}
    value = 0
    for rel in sorted(files):
        size = files[rel]
        value = crc32c.crc32c(rel.encode() + b"\0" + size.to_bytes(8, "little"), value)
        size_crc = known.get(rel)
        if size_crc is not None and size_crc[0] == size:
            value = crc32c_combine(value, size_crc[1], size)
        else:
            value = _crc_file_into(path / rel, value)
    return f"{CHECKSUM_PREFIX}{value:08x}"


def tree_file_sizes(root: Path) -> dict[str, int]:
    """{posix path relative to `root`: size} of every regular file under the folder `root`.

    os.scandir on strings: a part has thousands of shard files, and pathlib's rglob costs the
    commit thread far more time under the GIL."""
    sizes: dict[str, int] = {}
    stack = [("", os.fspath(root))]
    while stack:
        rel_dir, abs_dir = stack.pop()
        with os.scandir(abs_dir) as entries:
            for e in entries:
                rel = f"{rel_dir}{e.name}"
                if e.is_dir(follow_symlinks=False):
                    stack.append((rel + "/", e.path))
                elif e.is_file(follow_symlinks=False):
                    sizes[rel] = e.stat(follow_symlinks=False).st_size
    return sizes


class HashedFile:
    """A file being appended to that keeps the size and crc32c of every byte written through it
    (a webdataset tar: tarfile writes headers, data and padding alike by `write`): the commit's
    checksum without reading the file back, from a disk once its pages have been dropped."""

    def __init__(self, f: io.BufferedWriter):
        self._f, self.size, self.crc = f, 0, 0

    def write(self, data: bytes) -> int:
        n = self._f.write(data)
        self.size, self.crc = self.size + len(data), crc32c.crc32c(data, self.crc)
        return n

    def __getattr__(self, name: str):  # noqa: ANN204  (tell, flush, fileno, close)
        return getattr(self._f, name)
