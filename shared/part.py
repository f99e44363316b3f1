"""Cache parts (format version 1): the layout, samples, and the writer/reader base classes.

A part is one work unit's samples, packed without padding. In the zarr format (DESIGN.md
section 3) sample n occupies rows ``offsets[n] .. offsets[n] + lengths[n]`` of ``hidden``
[T, K, H]; each sample starts on a multiple of CHUNK_ROWS and the rows up to the next sample are
zeros that are never written (fill value 0). The layout is fixed from the lengths up front, so
every sample write covers whole chunks and writes from several threads never touch the same
file. The webdataset format (``shared/wds.py``) stores the same records as tar members.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.checksum import part_checksum, tree_file_sizes
from shared.codec import (
    CHUNK_ROWS,
    HiddenInput,
    check_format,
    check_store,
    dequantize_fp8,
    encode_hidden,
    payload_width,
    token_array,
    u16_to_bf16,
)
from shared.diskqueue import DiskQueue, drain
from shared.fsio import fsync_dir, remove_path, replace_dir
from shared.int4 import Int4Scheme, decode_int4

log = logging.getLogger(__name__)


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
    """One cached sample. hidden holds bf16 bits (uint16), e4m3 bits (uint8) [L, K', H] (with
    their `scale`) or int4 records (uint8 [L, K', H + 4], with their `scheme`)."""

    sample_index: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden: np.ndarray
    scale: np.ndarray | None = None
    scheme: Int4Scheme | None = None

    def hidden_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """bf16 [L, K', H] on ``device``; fp8 and int4 payloads are decoded there."""
        if self.scheme is not None:
            records = torch.from_numpy(np.ascontiguousarray(self.hidden)).to(device)
            return decode_int4(records, self.scheme)
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


class PartWriter:
    """Writes one part into ``<final>.tmp`` and renames it on commit(); see open_part_writer.

    ``write`` is thread-safe and samples may arrive in any order. Use as a context manager to
    abort on an exception.
    """

    # Whether `write` takes a sample in pieces of rows (a zarr sample is whole shard files of
    # CHUNK_ROWS rows; a tar's sample is one member).
    takes_pieces = False

    def __init__(
        self,
        final: Path,
        *,
        store: str,
        num_layers: int,
        hidden_size: int,
        lengths: Sequence[int],
        io: DiskQueue | None = None,
    ) -> None:
        """`io`: where the format may queue its file writes (they run in `write`'s thread
        without it); `commit` waits for them."""
        self.final = final
        self._io, self._io_futures = io, []
        self.tmp = final.with_name(final.name + ".tmp")
        self.store, self.num_layers, self.hidden_size = store, num_layers, hidden_size
        self.scheme = Int4Scheme(hidden=hidden_size) if store == "int4" else None
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        if (self.lengths <= 0).any():
            raise ValueError("every sample length must be > 0")
        self._lock = threading.Lock()
        self._claimed: set[tuple[int, int]] = set()  # (sample, its CHUNK_ROWS block) written
        self._sample_indices: dict[int, int] = {}  # sample_index -> the sample holding it
        self._index_of: dict[int, int] = {}  # and back
        self._rows_written = np.zeros(len(self.lengths), dtype=np.int64)
        self._written = np.zeros(len(self.lengths), dtype=bool)
        self._supervised = 0
        self._closed = False
        # Seconds of the commit's steps, for the log: its last queued writes, finishing and
        # syncing the part, its checksum, the rename.
        self.commit_seconds: dict[str, float] = {}

    @property
    def width(self) -> int:
        """The payload's last dimension (`shared.codec.payload_width`)."""
        return payload_width(self.store, self.hidden_size)

    def store_attrs(self) -> dict[str, Any]:
        """What a part records about its store besides its name: an int4 part its scheme."""
        return {} if self.scheme is None else {"int4": self.scheme.to_dict()}

    def write(
        self,
        n: int,
        *,
        sample_index: int,
        input_ids: torch.Tensor | np.ndarray,
        loss_mask: torch.Tensor | np.ndarray,
        hidden: HiddenInput,
        rows: slice | None = None,
    ) -> None:
        """Store sample n (lengths[n] tokens), or with `rows` one piece of it (`takes_pieces`
        formats): those token positions of the sample, from a multiple of CHUNK_ROWS to one or
        to the sample's end, `input_ids`, `loss_mask` and `hidden` then the piece's. A sample
        is written once its pieces cover it; several threads may write pieces of one sample at
        once, so a long sample's compression is not one thread's. Safe to call from several
        threads at once."""
        if not 0 <= n < len(self.lengths):
            raise IndexError(f"sample {n} out of range for a part of {len(self.lengths)}")
        start, stop = self._piece(n, rows)
        ids = token_array(input_ids, np.int32, stop - start, "input_ids")
        mask = token_array(loss_mask, np.uint8, stop - start, "loss_mask")
        shape = (stop - start, self.num_layers, self.hidden_size)
        payload, scale = encode_hidden(hidden, self.store, shape)
        sample_index = int(sample_index)
        chunks = {(n, c) for c in range(start // CHUNK_ROWS, -(-stop // CHUNK_ROWS))}
        with self._lock:
            if self._closed or not chunks.isdisjoint(self._claimed):
                raise RuntimeError(f"sample {n} already written or writer closed")
            if self._index_of.get(n, sample_index) != sample_index:
                raise ValueError(
                    f"sample {n}'s pieces carry sample_index {self._index_of[n]} and {sample_index}"
                )
            if self._sample_indices.get(sample_index, n) != n:
                raise ValueError(f"sample_index {sample_index} written twice")
            self._claimed |= chunks
            self._index_of[n], self._sample_indices[sample_index] = sample_index, n
        try:
            self._store(n, sample_index, ids, mask, payload, scale, start)
        except BaseException:
            with self._lock:
                self._claimed -= chunks
                if not any(m == n for m, _ in self._claimed):  # no other piece of it holds them
                    del self._index_of[n], self._sample_indices[sample_index]
            raise
        with self._lock:
            self._rows_written[n] += stop - start
            self._written[n] = self._rows_written[n] == self.lengths[n]
            self._supervised += int(np.count_nonzero(mask))

    def _piece(self, n: int, rows: slice | None) -> tuple[int, int]:
        """(start, stop) token positions of the piece `rows` of sample n (the whole sample
        without it), checked."""
        length = int(self.lengths[n])
        if rows is None:
            return 0, length
        start, stop, step = rows.indices(length)
        whole = (start, stop) == (0, length)
        if not whole and not self.takes_pieces:
            raise ValueError(f"{type(self).__name__} takes whole samples, not rows {rows}")
        ragged_end = stop % CHUNK_ROWS and stop != length
        if step != 1 or start >= stop or start % CHUNK_ROWS or ragged_end:
            raise ValueError(
                f"rows {rows} of sample {n} ({length} tokens): a piece starts at a multiple of "
                f"{CHUNK_ROWS} and ends at one or at the sample's end"
            )
        return start, stop

    def commit(self) -> PartStats:
        """Finish the part, rename ``.tmp`` to its final name and return its stats.

        Raises RuntimeError if a sample was not written (the tmp is kept for abort()).
        """
        with self._lock:
            missing = np.flatnonzero(~self._written)
            if self._closed or len(missing):
                raise RuntimeError(f"cannot commit {self.final.name}: missing {missing[:10]}")
            self._closed = True
        clock = [time.perf_counter()]

        def step(name: str) -> None:
            clock.append(time.perf_counter())
            self.commit_seconds[name] = clock[-1] - clock[-2]

        drain(self._io_futures)  # a failed write raises here: the part is not committed
        step("writes")
        self._finish()
        step("sync")
        # One walk of the folder serves the checksum and the size (thousands of shard files).
        sizes = tree_file_sizes(self.tmp) if self.tmp.is_dir() else None
        checksum = part_checksum(self.tmp, self._known_files(), sizes)
        step("checksum")
        stats = PartStats(
            rows=len(self.lengths),
            tokens=int(self.lengths.sum()),
            supervised_tokens=self._supervised,
            stored_rows=self._stored_rows(),
            nbytes=sum(sizes.values()) if sizes is not None else self.tmp.stat().st_size,
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
        step("rename")
        log.debug("committed %s: %s", self.final, stats)
        return stats

    def abort(self) -> None:
        """Discard the part being written."""
        with self._lock:
            self._closed = True
            futures = list(self._io_futures)
        wait(futures)  # no queued write lands in the folder after it is removed
        try:
            with contextlib.suppress(OSError):  # a full disk refuses the last buffered bytes
                self._close_quietly()
        finally:
            remove_path(self.tmp)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None and self.tmp.exists():
            self.abort()

    def _queue_write(self, nbytes: int, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args), which writes `nbytes` to the tmp: on the `io` queue, or now."""
        if self._io is None:
            fn(*args)
            return
        future = self._io.submit(nbytes, fn, *args)  # may wait for the queue: not under the lock
        with self._lock:
            self._io_futures.append(future)

    # Format-specific parts.
    def _store(self, n: int, sample_index: int, ids: np.ndarray, mask: np.ndarray,
               payload: np.ndarray, scale: np.ndarray | None, first: int) -> None:  # fmt: skip
        """Store the rows of sample n from token `first` on (0 unless `takes_pieces`)."""
        raise NotImplementedError

    def _known_files(self) -> dict[str, tuple[int, int]]:
        """(size, crc32c) of files whose bytes the writer hashed as it wrote them."""
        return {}

    def _finish(self) -> None:
        """Write what is left and make the tmp durable."""
        raise NotImplementedError

    def _stored_rows(self) -> int:
        return int(self.lengths.sum())

    def _close_quietly(self) -> None:
        pass


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
        int4: dict[str, Any] | None = None,
    ) -> None:
        """`int4`: an int4 part's recorded scheme (`Int4Scheme.to_dict`)."""
        check_store(store)
        self.path = path
        self.store, self.num_layers, self.hidden_size = store, num_layers, hidden_size
        self.width = payload_width(store, hidden_size)
        self.scheme = None
        if store == "int4":
            if int4 is None:
                raise ValueError(f"{path}: an int4 part without its scheme")
            self.scheme = Int4Scheme.from_dict(int4)
            if self.scheme.hidden != hidden_size:
                raise ValueError(
                    f"{path}: int4 scheme of hidden {self.scheme.hidden}, not {hidden_size}"
                )
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

    def iter_indexed(
        self, layers: Sequence[int] | None = None, only: Collection[int] | None = None
    ) -> Iterator[tuple[int, Sample]]:
        """(n, sample n) for every sample, or those numbered in `only`, in the order they are
        read most cheaply."""
        for n in range(self.num_samples) if only is None else sorted(only):
            yield n, self.read(n, layers)

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
