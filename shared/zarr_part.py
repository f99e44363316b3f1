"""The zarr part format: writer, reader and verification.

zarr layout of ``hidden``: shards [64, K, H] holding inner chunks [64, 1, H] (H: the payload's
width, the hidden size or an int4 record's bytes), so a reader of one layer decodes only that
layer's inner chunks (via the shard index), and a part has one file per 64 rows rather than K.
The chunks' codecs, and zarr's side of ours: ``shared/zarr_codecs.py``.

Where compression runs: in the writing thread. ``shard_buffers`` encodes each hidden shard
exactly as the array's zarr metadata declares and ``write_buffers`` writes it as a plain file
under its chunk key (os.writev, no joined copy); zarr creates the metadata, writes the small
arrays at commit and does all reading. Blosc (one internal thread, ``shared/codec.py``) and
crc32c release the GIL, so N writer threads compress on N cores. Writing through zarr's Array API
instead funnels every chunk through zarr's single event-loop thread (the codecs run on its worker
pool via ``asyncio.to_thread``, but scheduling, crc32c and shard assembly do not). The part is
made durable at its commit with one syncfs (``shared.writeback.sync_tree``). The reader and
``verify_zarr`` read these shards directly (``shared/zarr_shards.py``); zarr still reads each
part's first and last shard in verification. Reading our shards,
per-layer oindex reads, crc32c detection and nchunks_initialized behave the same on zarr 3.1.6
and 3.4.2. Writer throughput against plain Blosc: ``python bench/write_bench.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import crc32c
import numpy as np
import zarr

from shared.codec import CHUNK_ROWS, FORMAT_VERSION, Bf16Planes, payload_dtype, payload_width
from shared.fsio import named
from shared.part import PartReader, PartWriter, Sample, aligned_offsets, layout_problems
from shared.writeback import DropBehind, start_writeback, sync_tree
from shared.zarr_codecs import hidden_compressor, hidden_compressors, zarr_compressors
from shared.zarr_shards import (
    KEY_SEPARATOR,
    ShardFiles,
    inner_codec,
    shard_buffers,
    shard_key,
    shard_problems,
    zero_padded,
)

log = logging.getLogger(__name__)

# Rows per chunk of the small per-token arrays written at commit (input_ids, loss_mask, scale):
# large enough for few files, small enough that a random read decodes little.
SMALL_CHUNK_ROWS = 1 << 14
# Start each shard file's writeback as soon as it is written (`shared.writeback.start_writeback`);
# off only to measure what it changes (`bench/extract_bench.py --writeback commit`).
EARLY_WRITEBACK = True
# Drop each shard file's pages from the page cache once the disk has them
# (`shared.writeback.DropBehind`); off only to measure what it changes (`bench/writer_cost.py
# --page-cache keep`).
DROP_BEHIND = True


def write_buffers(path: Path | str, buffers: list[bytes]) -> tuple[int, int]:
    """Write `buffers` one after another as the file `path` (os.writev: no joined copy, and the
    GIL is released for the whole write); returns (size, crc32c) of the file's bytes, taken from
    the buffers in memory. Its writeback starts at once; it is made durable with the whole part,
    at its commit."""
    size, crc = 0, 0
    for b in buffers:
        size, crc = size + len(b), crc32c.crc32c(b, crc)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left:
            done = os.writev(fd, buffers)
            left -= done
            if left:  # a short write: drop what was written and go on
                while done >= len(buffers[0]):
                    done -= len(buffers[0])
                    buffers = buffers[1:]
                buffers = [memoryview(buffers[0])[done:], *buffers[1:]]
        if EARLY_WRITEBACK:
            start_writeback(fd)
    except OSError as e:
        raise named(e, path) from None
    finally:
        os.close(fd)
    return size, crc


class ZarrPartWriter(PartWriter):
    """A zarr v3 group; hidden is written per sample or piece of one, the small arrays at
    commit."""

    takes_pieces = True

    def __init__(self, final: Path, **kw) -> None:
        super().__init__(final, **kw)
        self.offsets = aligned_offsets(self.lengths)
        rows, K, H = int(self.offsets[-1]), self.num_layers, self.width
        self._group = zarr.open_group(zarr.storage.LocalStore(self.tmp), mode="w")
        ptype = payload_dtype(self.store)
        self._group.create_array(
            "hidden",
            shape=(rows, K, H),
            dtype=ptype,
            chunks=(CHUNK_ROWS, 1, H),
            shards=(CHUNK_ROWS, K, H),
            compressors=hidden_compressors(self.store),
            fill_value=0,
            # Pinned, since shard_buffers + write_buffers write the files under these keys.
            chunk_key_encoding={"name": "default", "separator": KEY_SEPARATOR},
        )
        self._root = str(self.tmp)
        self._ids = np.zeros(rows, np.int32)
        self._mask = np.zeros(rows, np.uint8)
        self._scale = np.zeros((rows, K), np.float32) if self.store == "fp8" else None
        self._sample_index = np.zeros(len(self.lengths), np.int64)
        # (size, crc32c) of each shard file as written: the commit's checksum need not reread it.
        self._written_files: dict[str, tuple[int, int]] = {}
        self._drop_behind = DropBehind() if DROP_BEHIND else None
        # The part's folder, open from its first write to its sync: a syncfs through it reports
        # every write the disk failed since, even one another process's syncfs has seen.
        self._sync_fd: int | None = os.open(self.tmp, os.O_RDONLY)

    def _store(self, n, sample_index, ids, mask, payload, scale, first) -> None:  # noqa: ANN001
        start, length = int(self.offsets[n]) + first, len(ids)
        compress = hidden_compressor(self.store, self.hidden_size)
        if not isinstance(payload, Bf16Planes):  # planes are bytes: no byte order
            payload = payload.astype(payload.dtype.newbyteorder("<"), copy=False)  # as stored
        files, nbytes = [], 0
        for row in range(0, length, CHUNK_ROWS):
            block = payload[row : row + CHUNK_ROWS]
            if len(block) < CHUNK_ROWS:  # the sample's last shard: zero rows up to the boundary
                block = zero_padded(block)
            buffers = shard_buffers(block, compress)
            files.append((shard_key((start + row) // CHUNK_ROWS), buffers))
            nbytes += sum(len(b) for b in buffers)
        # The payload (a staged batch's rows) is no longer needed once compressed.
        self._queue_write(nbytes, self._write_shards, files)
        self._ids[start : start + length] = ids
        self._mask[start : start + length] = mask
        if scale is not None:
            self._scale[start : start + length] = scale
        self._sample_index[n] = sample_index

    def _write_shards(self, files: list[tuple[str, list[bytes]]]) -> None:
        """Write one sample's shard files (key, buffers) and note their (size, crc32c)."""
        for key, buffers in files:
            path = f"{self._root}/{key}"
            size_crc = write_buffers(path, buffers)  # no folder to make
            with self._lock:
                self._written_files[key] = size_crc
            if self._drop_behind is not None:
                self._drop_behind.written(path, size_crc[0])

    def _small_array(self, name: str, data: np.ndarray) -> None:
        chunks = (SMALL_CHUNK_ROWS, *data.shape[1:])
        arr = self._group.create_array(
            name,
            shape=data.shape,
            dtype=data.dtype,
            chunks=chunks,
            compressors=zarr_compressors(data.dtype.itemsize),
            fill_value=0,
            # Every chunk a file, zeros too: a missing one is then damage, never zeros
            config={"write_empty_chunks": True},
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
            every_chunk_written=True,  # `missing_chunks` may count the small arrays' chunks
            **self.store_attrs(),
        )
        try:
            sync_tree(self.tmp, fd=self._sync_fd)
            if self._drop_behind is not None:
                self._drop_behind.drop_rest()
        finally:
            self._close_quietly()

    def _stored_rows(self) -> int:
        return int(self.offsets[-1])

    def _close_quietly(self) -> None:
        fd, self._sync_fd = self._sync_fd, None
        if fd is not None:
            os.close(fd)

    def _known_files(self) -> dict[str, tuple[int, int]]:
        return self._written_files


SMALL_ARRAYS = ("offsets", "lengths", "sample_index", "input_ids", "loss_mask", "scale")


def missing_chunks(arrays: dict[str, zarr.Array], attrs: dict) -> list[str]:
    """The small arrays of a part (`arrays`, as opened) that miss chunk files, each said with
    its count: zarr reads a missing chunk as zeros, without an error. Parts written before every
    chunk was written (no `every_chunk_written`) left all-zero chunks out: not counted."""
    if not attrs.get("every_chunk_written"):
        return []
    return [
        f"{name} has {arr.nchunks_initialized} of {arr.nchunks} chunks"
        for name, arr in arrays.items()
        if arr.nchunks_initialized != arr.nchunks
    ]


class ZarrPartReader(PartReader):
    """Random-access reader of a zarr part; only the requested layers' chunks are decoded."""

    def __init__(self, path: Path) -> None:
        group = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r")
        attrs = dict(group.attrs)
        if attrs.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path}: format_version {attrs.get('format_version')}, expected {FORMAT_VERSION}"
            )
        names = [n for n in SMALL_ARRAYS if n != "scale" or attrs.get("store") == "fp8"]
        arrays = {name: group[name] for name in names}
        super().__init__(
            path,
            store=attrs["store"],
            num_layers=int(attrs["num_layers"]),
            hidden_size=int(attrs["hidden_size"]),
            lengths=arrays["lengths"][...],
            sample_indices=arrays["sample_index"][...],
            int4=attrs.get("int4"),
        )
        self.offsets = arrays["offsets"][...]
        self._hidden = group["hidden"]
        problems = missing_chunks(arrays, attrs)
        problems += layout_problems(self.offsets, self.lengths, self._hidden.shape[0])
        if problems:  # a reader would return zeros or other samples' rows, silently
            raise ValueError(f"{path}: {'; '.join(problems)}: the part is damaged")
        # Our own shard layout is read directly (`ShardFiles`): several times less CPU a token
        # than through zarr; any other layout through zarr.
        inner = inner_codec(Path(path, "hidden", "zarr.json"), self.num_layers, self.width)
        self._shards = (
            None
            if inner is None
            else ShardFiles(Path(path), self.store, inner, self.num_layers, self.hidden_size)
        )
        # Per-token arrays are a few bytes per token: read once rather than per sample.
        self._ids = arrays["input_ids"][...]
        self._mask = arrays["loss_mask"][...]
        # fp8 scales (4 bytes per token and layer) too: zarr's per-sample reads cost far more.
        self._scale = arrays["scale"][...] if self.store == "fp8" else None

    def read(self, n: int, layers: Sequence[int] | None = None) -> Sample:
        if not 0 <= n < self.num_samples:
            raise IndexError(f"sample {n} out of range for {self.num_samples} samples")
        pos = self.layer_positions(layers)
        start = int(self.offsets[n])
        rows = slice(start, start + int(self.lengths[n]))
        if self._shards is not None:
            hidden = self._shards.read(rows, range(self.num_layers) if pos is None else pos)
        elif pos is None:
            hidden = self._hidden[rows]
        else:
            hidden = self._hidden.oindex[rows, pos]
        if self._scale is None:
            scale = None
        else:
            scale = self._scale[rows] if pos is None else self._scale[rows][:, pos]
        return Sample(
            sample_index=int(self.sample_indices[n]),
            input_ids=self._ids[rows],
            loss_mask=self._mask[rows],
            hidden=hidden,
            scale=scale,
            scheme=self.scheme,
        )

    def iter_samples(self, layers: Sequence[int] | None = None) -> Iterator[Sample]:
        for n in range(self.num_samples):
            yield self.read(n, layers)


def verify_zarr(path: Path, threads: int = 1) -> list[str]:
    """Problems of a zarr part (empty if fine): metadata, small arrays, layout, and every
    hidden chunk's checksum and decoding."""
    try:
        group = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r")
        attrs, hidden = dict(group.attrs), group["hidden"]
    except KeyError:  # the group opens: its hidden array's folder is gone
        return ["hidden: missing"]
    except Exception as e:  # a verifier reports, whatever broke
        return [f"cannot open: {type(e).__name__}: {e}"]
    problems = []
    if attrs.get("format_version") != FORMAT_VERSION:
        problems.append(f"format_version {attrs.get('format_version')} != {FORMAT_VERSION}")
    T, K, H = hidden.shape
    try:
        width = payload_width(attrs.get("store"), attrs.get("hidden_size"))
    except (ValueError, TypeError) as e:
        return [*problems, f"store: {e}"]
    if [K, H] != [attrs.get("num_layers"), width]:
        problems.append(f"hidden shape {hidden.shape} disagrees with the group attributes")
    small, opened = {}, {}
    for name in SMALL_ARRAYS:
        if name == "scale" and attrs.get("store") != "fp8":
            continue
        try:
            opened[name] = group[name]
            small[name] = opened[name][...]
        except KeyError:  # its folder gone
            problems.append(f"{name}: missing")
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    problems += missing_chunks(opened, attrs)
    N = len(small.get("lengths", ()))
    shapes = dict(sample_index=(N,), input_ids=(T,), loss_mask=(T,), scale=(T, K))
    for name, want in shapes.items():
        if name == "sample_index" and "lengths" not in small:
            continue  # its count unknown: `lengths` is said missing or unreadable
        if name in small and small[name].shape != want:
            problems.append(f"{name} shape {small[name].shape} != {want}")
    if "offsets" in small and "lengths" in small:
        problems += layout_problems(small["offsets"], small["lengths"], T)
    if hidden.nchunks_initialized != hidden.nchunks:
        problems.append(f"hidden has {hidden.nchunks_initialized} of {hidden.nchunks} chunks")
    inner = inner_codec(path / "hidden" / "zarr.json", K, H)
    if inner is None:  # not the layout `shard_buffers` writes: decode everything through zarr
        step = CHUNK_ROWS * 16
        for start in range(0, T, step):
            try:
                hidden[start : start + step]
            except Exception as e:
                problems.append(f"hidden rows {start}..{start + step}: {type(e).__name__}: {e}")
        return problems
    # zarr itself reads the first and the last shard; every shard is then checked directly
    # (index crc32c, each inner chunk's crc32c, its decoding and size), on `threads` threads.
    for start in sorted({0, max(0, T - CHUNK_ROWS)}):
        try:
            hidden[start : start + CHUNK_ROWS]
        except Exception as e:
            problems.append(f"hidden rows {start}..{start + CHUNK_ROWS}: {type(e).__name__}: {e}")
    shards = range(-(-T // CHUNK_ROWS))
    try:
        shard_files = ShardFiles(path, attrs.get("store"), inner, K, attrs.get("hidden_size"))
    except ValueError as e:
        return [*problems, f"store: {e}"]
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="verify-shards") as pool:
        for found in pool.map(partial(shard_problems, shard_files), shards):
            problems += found
    return problems
