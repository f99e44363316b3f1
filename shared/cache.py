"""Hidden-state cache parts (format version 1): layout, zarr writer and reader, verification.

A part is one work unit's samples, packed without padding. In the zarr format (DESIGN.md
section 3) sample n occupies rows ``offsets[n] .. offsets[n] + lengths[n]`` of ``hidden``
[T, K, H]; each sample starts on a multiple of CHUNK_ROWS and the rows up to the next sample are
zeros that are never written (fill value 0). The layout is fixed from the lengths up front, so
every sample write covers whole chunks and writes from several threads never touch the same
file. The webdataset format (``shared/wds.py``) stores the same records as tar members.

zarr layout of ``hidden``: shards [64, K, H] holding inner chunks [64, 1, H], so a reader of one
layer decodes only that layer's inner chunks (via the shard index), and a part has one file per
64 rows rather than K. Measured through zarr's Array API on a 210 MB array (5 samples of 1024
rows, K=5, H=4096, random bf16), best of 3 on 2 shared cores with zarr 3.1.6: plain chunks
[64, 1, H] wrote 102 MB/s from 1 thread and 113 MB/s from 2; shards 138 and 123 MB/s (the
spread between runs is ~30%).

Where compression runs: in the writing thread. ``encode_shard`` encodes each hidden shard
exactly as the array's zarr metadata declares and writes it as a plain file under its chunk key;
zarr creates the metadata, writes the small arrays at commit and does all reading. Blosc (one
internal thread, ``shared/codec.py``) and crc32c release the GIL, so N writer threads compress
on N cores. Writing through zarr's Array API instead funnels every chunk through zarr's single
event-loop thread (the codecs run on its worker pool via ``asyncio.to_thread``, but scheduling,
crc32c and shard assembly do not): on the 16-core H200 host with zarr 3.4.2, 1/2/4/8 writer
threads gave 0.45/0.45/0.37/0.43 GB/s of raw bf16 (about 2.2 cores busy) while plain Blosc on
the same data from the same threads gave 0.21/0.46/0.93/1.34 GB/s. On 2 cores here (zarr
3.1.6) that path gave 103 MB/s from 1 thread and 142 from 2. Reading our shards, per-layer
oindex reads, crc32c detection and nchunks_initialized behave the same on zarr 3.1.6 and 3.4.2
(numcodecs 0.17.1, Python 3.12).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np
import torch
import zarr
from numcodecs import Blosc
from zarr.codecs import BloscCodec, Crc32cCodec

from shared.codec import (
    CHUNK_ROWS,
    FORMAT_VERSION,
    HiddenInput,
    blosc_settings,
    check_format,
    check_store,
    dequantize_fp8,
    encode_hidden,
    numcodecs_blosc,
    part_checksum,
    payload_dtype,
    token_array,
    u16_to_bf16,
)
from shared.fsio import fsync_dir, replace_dir

log = logging.getLogger(__name__)

# Rows per chunk of the small per-token arrays written at commit (input_ids, loss_mask, scale):
# large enough for few files, small enough that a random read decodes little.
SMALL_CHUNK_ROWS = 1 << 14


def part_name(part_id: int, fmt: str) -> str:
    """``part-000123`` (zarr) or ``part-000123.tar`` (wds)."""
    check_format(fmt)
    return f"part-{part_id:06d}" + (".tar" if fmt == "wds" else "")


def aligned_offsets(lengths: Sequence[int]) -> np.ndarray:
    """int64 [N+1]: sample starts rounded up to CHUNK_ROWS; the last entry is the row count T.

    >>> aligned_offsets([3, 64, 65]).tolist()
    [0, 64, 128, 256]
    """
    rows_N = -(-np.asarray(lengths, dtype=np.int64) // CHUNK_ROWS) * CHUNK_ROWS
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(rows_N, dtype=np.int64)])


@dataclass(frozen=True, eq=False)
class Sample:
    """One cached sample. hidden holds bf16 bits (uint16) or e4m3 bits (uint8) [L, K', H]."""

    sample_index: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden: np.ndarray
    scale: np.ndarray | None = None

    def hidden_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bf16 [L, K', H] on ``device``; fp8 payloads are dequantised there."""
        if self.scale is None:
            return u16_to_bf16(self.hidden).to(device)
        q = torch.from_numpy(np.ascontiguousarray(self.hidden)).to(device)
        return dequantize_fp8(q, torch.from_numpy(np.ascontiguousarray(self.scale)).to(device))


@dataclass(frozen=True)
class PartStats:
    """What the manifest records about a committed part."""

    rows: int  # samples
    tokens: int
    supervised_tokens: int
    stored_rows: int  # T: tokens plus alignment rows (zarr); tokens (wds)
    nbytes: int  # on disk
    checksum: str


def remove_path(path: Path) -> None:
    """Remove a file or folder if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class PartWriter:
    """Writes one part into ``<final>.tmp`` and renames it on commit(); see open_part_writer.

    ``write`` is thread-safe and samples may arrive in any order. Use as a context manager to
    abort on an exception.
    """

    def __init__(
        self, final: Path, *, store: str, num_layers: int, hidden_size: int, lengths: Sequence[int]
    ) -> None:
        self.final = final
        self.tmp = final.with_name(final.name + ".tmp")
        self.store, self.num_layers, self.hidden_size = store, num_layers, hidden_size
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if (self.lengths <= 0).any():
            raise ValueError("every sample length must be > 0")
        self._lock = threading.Lock()
        self._claimed: set[int] = set()
        self._sample_indices: set[int] = set()
        self._written = np.zeros(len(self.lengths), dtype=bool)
        self._supervised = 0
        self._closed = False

    def write(
        self,
        n: int,
        *,
        sample_index: int,
        input_ids: torch.Tensor | np.ndarray,
        loss_mask: torch.Tensor | np.ndarray,
        hidden: HiddenInput,
    ) -> None:
        """Store sample n (lengths[n] tokens). Safe to call from several threads at once."""
        if not 0 <= n < len(self.lengths):
            raise IndexError(f"sample {n} out of range for a part of {len(self.lengths)}")
        length = int(self.lengths[n])
        ids = token_array(input_ids, np.int32, length, "input_ids")
        mask = token_array(loss_mask, np.uint8, length, "loss_mask")
        shape = (length, self.num_layers, self.hidden_size)
        payload, scale = encode_hidden(hidden, self.store, shape)
        sample_index = int(sample_index)
        with self._lock:
            if self._closed or n in self._claimed:
                raise RuntimeError(f"sample {n} already written or writer closed")
            if sample_index in self._sample_indices:
                raise ValueError(f"sample_index {sample_index} written twice")
            self._claimed.add(n)
            self._sample_indices.add(sample_index)
        try:
            self._store(n, sample_index, ids, mask, payload, scale)
        except BaseException:
            with self._lock:
                self._claimed.discard(n)
                self._sample_indices.discard(sample_index)
            raise
        with self._lock:
            self._written[n] = True
            self._supervised += int(np.count_nonzero(mask))

    def commit(self) -> PartStats:
        """Finish the part, rename ``.tmp`` to its final name and return its stats.

        Raises RuntimeError if a sample was not written (the tmp is kept for abort()).
        """
        with self._lock:
            missing = np.flatnonzero(~self._written)
            if self._closed or len(missing):
                raise RuntimeError(f"cannot commit {self.final.name}: missing {missing[:10]}")
            self._closed = True
        self._finish()
        checksum = part_checksum(self.tmp)
        stats = PartStats(
            rows=len(self.lengths),
            tokens=int(self.lengths.sum()),
            supervised_tokens=self._supervised,
            stored_rows=self._stored_rows(),
            nbytes=_disk_bytes(self.tmp),
            checksum=checksum,
        )
        if self.final.exists():
            # Committed before a crash but never recorded in the manifest, so never trusted.
            log.warning("replacing %s, which the manifest does not list", self.final)
        if self.tmp.is_dir():
            replace_dir(self.tmp, self.final)
        else:
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)
        log.info("committed %s: %s", self.final, stats)
        return stats

    def abort(self) -> None:
        """Discard the part being written."""
        with self._lock:
            self._closed = True
        self._close_quietly()
        remove_path(self.tmp)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None and self.tmp.exists():
            self.abort()

    # Format-specific parts.
    def _store(self, n: int, sample_index: int, ids: np.ndarray, mask: np.ndarray,
               payload: np.ndarray, scale: np.ndarray | None) -> None:  # fmt: skip
        raise NotImplementedError

    def _finish(self) -> None:
        """Write what is left and make the tmp durable."""
        raise NotImplementedError

    def _stored_rows(self) -> int:
        return int(self.lengths.sum())

    def _close_quietly(self) -> None:
        pass


def zarr_compressors(typesize: int) -> list:
    """Blosc (cache settings) then crc32c, so every chunk is checksummed when decoded."""
    return [BloscCodec(**blosc_settings(typesize)), Crc32cCodec()]


def encode_shard(block: np.ndarray, codec: Blosc) -> bytes:
    """The file of one ``hidden`` shard ([CHUNK_ROWS, K, H] rows) as its zarr metadata declares:
    per layer an inner chunk bytes -> Blosc -> crc32c, then the shard index (uint64 offset and
    size per inner chunk, little-endian) and its crc32c (zarr v3 ``sharding_indexed``, index at
    the end). Runs in the calling thread; Blosc and crc32c release the GIL."""
    chunks, index = [], np.zeros((block.shape[1], 2), dtype="<u8")
    for k in range(block.shape[1]):
        data = codec.encode(np.ascontiguousarray(block[:, k], dtype=block.dtype.newbyteorder("<")))
        chunks.append(data + crc32c.crc32c(data).to_bytes(4, "little"))
        index[k] = (index[k - 1].sum() if k else 0, len(chunks[-1]))
    index_bytes = index.tobytes()
    return b"".join(chunks) + index_bytes + crc32c.crc32c(index_bytes).to_bytes(4, "little")


class ZarrPartWriter(PartWriter):
    """A zarr v3 group; hidden is written per sample, the small arrays at commit."""

    def __init__(self, final: Path, **kw) -> None:
        super().__init__(final, **kw)
        self.offsets = aligned_offsets(self.lengths)
        rows, K, H = int(self.offsets[-1]), self.num_layers, self.hidden_size
        self._group = zarr.open_group(zarr.storage.LocalStore(self.tmp), mode="w")
        ptype = payload_dtype(self.store)
        self._group.create_array(
            "hidden",
            shape=(rows, K, H),
            dtype=ptype,
            chunks=(CHUNK_ROWS, 1, H),
            shards=(CHUNK_ROWS, K, H),
            compressors=zarr_compressors(ptype.itemsize),
            fill_value=0,
            # Pinned, since encode_shard writes the files under these keys itself.
            chunk_key_encoding={"name": "default", "separator": "/"},
        )
        self._ids = np.zeros(rows, np.int32)
        self._mask = np.zeros(rows, np.uint8)
        self._scale = np.zeros((rows, K), np.float32) if self.store == "fp8" else None
        self._sample_index = np.zeros(len(self.lengths), np.int64)

    def _store(self, n, sample_index, ids, mask, payload, scale) -> None:  # noqa: ANN001
        start, stop, length = int(self.offsets[n]), int(self.offsets[n + 1]), len(ids)
        codec = numcodecs_blosc(payload.itemsize)
        for row in range(0, stop - start, CHUNK_ROWS):
            block = payload[row : row + CHUNK_ROWS]
            if len(block) < CHUNK_ROWS:  # the sample's last shard: zero rows up to the boundary
                pad = np.zeros((CHUNK_ROWS - len(block), *block.shape[1:]), block.dtype)
                block = np.concatenate([block, pad])
            path = self.tmp / "hidden" / "c" / str((start + row) // CHUNK_ROWS) / "0" / "0"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(encode_shard(block, codec))
        self._ids[start : start + length] = ids
        self._mask[start : start + length] = mask
        if scale is not None:
            self._scale[start : start + length] = scale
        self._sample_index[n] = sample_index

    def _small_array(self, name: str, data: np.ndarray) -> None:
        chunks = (SMALL_CHUNK_ROWS, *data.shape[1:])
        arr = self._group.create_array(
            name,
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            compressors=zarr_compressors(data.dtype.itemsize),
            fill_value=0,
        )
        if data.size:
            arr[...] = data

    def _finish(self) -> None:
        self._small_array("input_ids", self._ids)
        self._small_array("loss_mask", self._mask)
        self._small_array("offsets", self.offsets)
        self._small_array("lengths", self.lengths)
        self._small_array("sample_index", self._sample_index)
        if self._scale is not None:
            self._small_array("scale", self._scale)
        self._group.attrs.update(
            format_version=FORMAT_VERSION,
            store=self.store,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            chunk_rows=CHUNK_ROWS,
        )
        for path in self.tmp.rglob("*"):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())

    def _stored_rows(self) -> int:
        return int(self.offsets[-1])


def open_part_writer(
    out_dir: Path,
    part_id: int,
    *,
    fmt: str,
    store: str,
    num_layers: int,
    hidden_size: int,
    lengths: Sequence[int],
) -> PartWriter:
    """Start writing part ``part_id`` under ``out_dir``; a ``.tmp`` left by a crash is removed."""
    check_format(fmt)
    check_store(store)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / part_name(part_id, fmt)
    leftover = final.with_name(final.name + ".tmp")
    if leftover.exists():
        log.warning("removing %s left by an interrupted writer", leftover)
        remove_path(leftover)
    kw = dict(store=store, num_layers=num_layers, hidden_size=hidden_size, lengths=lengths)
    if fmt == "zarr":
        return ZarrPartWriter(final, **kw)
    from shared.wds import WdsPartWriter  # wds builds on the classes above

    return WdsPartWriter(final, **kw)


class PartReader:
    """Reads one part. Iteration yields samples in stored order; ``layers`` are positions into
    the stored layer axis (0..K-1), any subset in any order, returned in the order given."""

    def __init__(
        self,
        path: Path,
        *,
        store: str,
        num_layers: int,
        hidden_size: int,
        lengths: np.ndarray,
        sample_indices: np.ndarray,
    ) -> None:
        check_store(store)
        self.path = path
        self.store, self.num_layers, self.hidden_size = store, num_layers, hidden_size
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.sample_indices = np.asarray(sample_indices, dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def __iter__(self) -> Iterator[Sample]:
        return self.iter_samples()

    def iter_samples(self, layers: Sequence[int] | None = None) -> Iterator[Sample]:
        raise NotImplementedError

    def read(self, n: int, layers: Sequence[int] | None = None) -> Sample:
        """Sample n by random access (zarr parts only)."""
        raise NotImplementedError(f"{self.path.name}: random access needs a zarr part")

    def layer_positions(self, layers: Sequence[int] | None) -> np.ndarray | None:
        """Validated int64 positions into the stored layer axis, or None for all layers."""
        if layers is None:
            return None
        pos = np.asarray(list(layers), dtype=np.int64).reshape(-1)
        if len(pos) == 0 or (pos < 0).any() or (pos >= self.num_layers).any():
            raise IndexError(f"layers must be non-empty positions in 0..{self.num_layers - 1}")
        return pos


class ZarrPartReader(PartReader):
    """Random-access reader of a zarr part; only the requested layers' chunks are decoded."""

    def __init__(self, path: Path) -> None:
        group = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r")
        attrs = dict(group.attrs)
        if attrs.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: format_version {attrs.get('format_version')}, expected {FORMAT_VERSION}"
            )
        super().__init__(
            path,
            store=attrs["store"],
            num_layers=int(attrs["num_layers"]),
            hidden_size=int(attrs["hidden_size"]),
            lengths=group["lengths"][...],
            sample_indices=group["sample_index"][...],
        )
        self.offsets = group["offsets"][...]
        self._hidden = group["hidden"]
        # Per-token arrays are a few bytes per token: read once rather than per sample.
        self._ids = group["input_ids"][...]
        self._mask = group["loss_mask"][...]
        self._scale = group["scale"] if self.store == "fp8" else None

    def read(self, n: int, layers: Sequence[int] | None = None) -> Sample:
        if not 0 <= n < self.num_samples:
            raise IndexError(f"sample {n} out of range for {self.num_samples} samples")
        pos = self.layer_positions(layers)
        start = int(self.offsets[n])
        rows = slice(start, start + int(self.lengths[n]))
        if pos is None:
            hidden = self._hidden[rows]
            scale = None if self._scale is None else self._scale[rows]
        else:
            hidden = self._hidden.oindex[rows, pos]
            scale = None if self._scale is None else self._scale.oindex[rows, pos]
        return Sample(
            sample_index=int(self.sample_indices[n]),
            input_ids=self._ids[rows],
            loss_mask=self._mask[rows],
            hidden=hidden,
            scale=scale,
        )

    def iter_samples(self, layers: Sequence[int] | None = None) -> Iterator[Sample]:
        for n in range(self.num_samples):
            yield self.read(n, layers)


def open_part(path: Path) -> PartReader:
    """Open a part: a zarr folder or a webdataset ``.tar``."""
    path = Path(path)
    if path.is_dir():
        return ZarrPartReader(path)
    if path.suffix == ".tar" and path.is_file():
        from shared.wds import WdsPartReader  # wds builds on the classes above

        return WdsPartReader(path)
    raise FileNotFoundError(f"{path}: not a part folder or .tar file")


def layout_problems(offsets: np.ndarray, lengths: np.ndarray, total_rows: int) -> list[str]:
    """What is wrong with a zarr part's offsets/lengths: alignment, overlap, bounds."""
    if offsets.shape != (len(lengths) + 1,):
        return [f"offsets shape {offsets.shape} for {len(lengths)} samples"]
    problems = []
    if (lengths <= 0).any():
        problems.append(f"non-positive lengths at samples {np.flatnonzero(lengths <= 0)[:10]}")
    if offsets[0] != 0 or (offsets % CHUNK_ROWS).any():
        problems.append(f"offsets not aligned to {CHUNK_ROWS} rows")
    if (offsets[:-1] + lengths > offsets[1:]).any():
        problems.append("samples overlap or offsets decrease")
    if offsets[-1] > total_rows:
        problems.append(f"offsets end at {offsets[-1]} beyond {total_rows} rows")
    return problems


def verify_part(path: Path, expected_checksum: str | None = None) -> list[str]:
    """Problems found in a part (empty if fine): checksum, decodability of every chunk or
    member (crc32c), layout consistency."""
    path = Path(path)
    if not path.exists():
        return [f"{path}: missing"]
    problems = []
    if expected_checksum is not None:
        actual = part_checksum(path)
        if actual != expected_checksum:
            problems.append(f"checksum {actual} != expected {expected_checksum}")
    if path.is_dir():
        problems += _verify_zarr(path)
    else:
        from shared.wds import verify_wds  # wds builds on the classes above

        problems += verify_wds(path)
    return problems


def _verify_zarr(path: Path) -> list[str]:
    try:
        group = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r")
        attrs, hidden = dict(group.attrs), group["hidden"]
    except Exception as e:  # a verifier reports, whatever broke
        return [f"cannot open: {type(e).__name__}: {e}"]
    problems = []
    if attrs.get("format_version") != FORMAT_VERSION:
        problems.append(f"format_version {attrs.get('format_version')} != {FORMAT_VERSION}")
    T, K, H = hidden.shape
    if [K, H] != [attrs.get("num_layers"), attrs.get("hidden_size")]:
        problems.append(f"hidden shape {hidden.shape} disagrees with the group attributes")
    small = {}
    for name in ["offsets", "lengths", "sample_index", "input_ids", "loss_mask", "scale"]:
        if name == "scale" and attrs.get("store") != "fp8":
            continue
        try:
            small[name] = group[name][...]
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    N = len(small.get("lengths", ()))
    shapes = dict(sample_index=(N,), input_ids=(T,), loss_mask=(T,), scale=(T, K))
    for name, want in shapes.items():
        if name in small and small[name].shape != want:
            problems.append(f"{name} shape {small[name].shape} != {want}")
    if "offsets" in small and "lengths" in small:
        problems += layout_problems(small["offsets"], small["lengths"], T)
    if hidden.nchunks_initialized != hidden.nchunks:
        problems.append(f"hidden has {hidden.nchunks_initialized} of {hidden.nchunks} chunks")
    step = CHUNK_ROWS * 16
    for start in range(0, T, step):
        try:
            hidden[start : start + step]
        except Exception as e:
            problems.append(f"hidden rows {start}..{start + step}: {type(e).__name__}: {e}")
    return problems
