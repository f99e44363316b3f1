"""The page cache and the disk under a writer: writeback started early, written pages dropped,
a whole tree made durable, and the write errors a disk reports only at a sync."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import functools
import os
import threading
from pathlib import Path

from shared.fsio import fsync_dir

_OVERLAYFS_SUPER_MAGIC = 0x794C7630


def _is_overlay(fd: int) -> bool:
    """Whether the open file `fd` is on overlayfs: fstatfs(2)'s f_type, the first field of
    struct statfs (False where fstatfs is missing)."""
    fn = getattr(_libc(), "fstatfs", None)
    if fn is None:
        return False
    buf = ctypes.create_string_buffer(256)  # larger than struct statfs on any Linux ABI
    if fn(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == _OVERLAYFS_SUPER_MAGIC


# What a sync call answers where it cannot be made (not what a failed write answers).
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP)


class WritebackError(OSError):
    """A write that had succeeded failed later, when the kernel wrote it to the disk (a disk
    whose own store is full below its file system, an I/O error): found by a sync."""


def _syncfs(path: Path, fd: int | None = None) -> bool:
    """syncfs(2) on the file system holding `path`, through `fd` (an open descriptor of it) if
    given; False where syncfs is missing. Raises WritebackError when it reports a write the
    disk failed: any on that file system since `fd` was opened (since now without one), even
    one another process's syncfs has already seen. Each file's own fsync is no substitute
    after such an error: a closed file evicted from memory takes its error with it."""
    fn = getattr(_libc(), "syncfs", None)
    if fn is None:
        return False
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)
    try:
        if fn(fd) == 0:
            return True
        err = ctypes.get_errno()
        if err in _UNSUPPORTED:
            return False
        raise WritebackError(err, os.strerror(err), str(path))
    finally:
        if own:
            os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to start writing the dirty pages of `fd` in [offset, offset + length) (0:
    to the end) to disk now, without waiting (a no-op where neither way below exists).

    Without it a part's data stays dirty until its commit, whose sync then writes gigabytes at
    once; on ext4 that stalled every writer thread while it ran (on an H200 host, extraction
    went from 0.74 to 0.885 of the plain forward with early writeback: README, Results).
    Started per file, the disk writes steadily and the commit's sync finds little left to do.
    The way: sync_file_range(2) (SYNC_FILE_RANGE_WRITE), except on overlayfs (a container's
    usual file system), where it acts on the overlay's own, empty page cache and leaves every
    page dirty: there posix_fadvise's DONTNEED, which reaches the file below (it also drops the
    range's clean pages, hence only the range just written, and on older kernels drains every
    CPU's page lists, so it is not used everywhere). This only starts the writes: durability
    still comes from `sync_tree` at the commit."""
    fn = _sync_file_range()
    if fn is None or _is_overlay(fd):
        advise = getattr(os, "posix_fadvise", None)
        if advise is not None:
            with contextlib.suppress(OSError):  # advisory: a failure leaves it to the commit
                advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        return
    fn(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advisory: a failure leaves it to the commit


_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 4
# Bytes written after a file before its pages leave the page cache (`DropBehind`): far more than
# a disk's queue of writes in flight, so that its writeback is done by then (no wait).
DROP_BEHIND_BYTES = 256 << 20


def drop_written(fd: int, offset: int = 0, length: int = 0, name: str | None = None) -> None:
    """Drop the pages of `fd` in [offset, offset + length) (0: to the end) from the page cache,
    once on disk: sync_file_range(2) waits for the writeback `start_writeback` began, writes a
    page that is dirty again (one an append wrote into while its writeback ran, which that
    skipped) and waits for it; no wait for pages long written. A no-op where sync_file_range is
    missing. Only the page cache's copy goes: a read finds the data on disk. Raises
    WritebackError (naming `name`) for a write that failed: the wait takes the error from the
    file, so a later fsync or syncfs would not see it, and the part must fail here.

    Why: a cache is written once and read another day, or by another machine, so its pages in
    memory serve nobody, while every new page the kernel takes for the next writes costs more
    than one it reuses: on a virtual machine that returns idle memory to its host (free page
    reporting), several times more (`python bench/writer_cost.py --page-cache both --pause 5`:
    system seconds per GB, dropped against kept). Dropped pages are free for the next writes at
    once."""
    fn, advise = _sync_file_range(), getattr(os, "posix_fadvise", None)
    if fn is None or advise is None:
        return
    flags = _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER
    if fn(fd, offset, length, flags) != 0:
        err = ctypes.get_errno()
        if err in _UNSUPPORTED:
            return
        raise WritebackError(err, os.strerror(err), name)
    with contextlib.suppress(OSError):  # advisory: a failure leaves the pages cached
        advise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class DropBehind:
    """Drops the pages of files written one after another from the page cache (`drop_written`),
    each once `lag` more bytes have been written after it: the disk has them by then, and the
    files being written keep theirs. Thread-safe; files that are gone by then are skipped."""

    def __init__(self, lag: int | None = None):
        """`lag`: bytes (default DROP_BEHIND_BYTES)."""
        self.lag, self._behind = DROP_BEHIND_BYTES if lag is None else lag, 0
        self._files: collections.deque[tuple[str, int]] = collections.deque()
        self._lock = threading.Lock()

    def written(self, path: str, nbytes: int) -> None:
        """`path` (`nbytes`) has just been written, its writeback started. Raises
        WritebackError when the writeback of a file dropped now failed (see `drop_written`)."""
        old = []
        with self._lock:
            self._files.append((path, nbytes))
            self._behind += nbytes
            while self._files and self._behind - self._files[0][1] >= self.lag:
                old.append(self._files.popleft())
                self._behind -= old[-1][1]
        _drop_files(old)  # outside the lock: a wait for a slow disk blocks this thread only

    def drop_rest(self) -> None:
        """Drops the files not dropped yet (the last `lag` bytes written): at a part's commit,
        once its sync has put them on the disk: no shard file of a committed part stays cached."""
        with self._lock:
            old, self._files, self._behind = list(self._files), collections.deque(), 0
        _drop_files(old)


def _drop_files(files: list[tuple[str, int]]) -> None:
    for path, _ in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            drop_written(fd, name=path)
        finally:
            os.close(fd)


@functools.cache
def _sync_file_range():  # noqa: ANN202
    fn = getattr(_libc(), "sync_file_range", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
    return fn


def sync_tree(root: Path, fd: int | None = None) -> None:
    """Make every file and folder under `root` durable before it is renamed into place; raises
    WritebackError when the disk failed a write (see `_syncfs`).

    On Linux one syncfs(2) of its file system (through `fd`, `root` opened when its writing
    began, if given): a single journal commit, where an fsync per file commits the journal
    once per file (thousands per zarr part) and serialises on it. It also waits for other
    writers' dirty data on that file system, and fails on their lost writes too (since `fd`
    was opened): extraction calls it on its commit thread, so only the part's commit waits,
    and a part that fails is redone. Where syncfs is missing every file and folder is fsynced.
    """
    root = Path(root)
    if _syncfs(root, fd):
        return
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(root)
