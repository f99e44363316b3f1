"""Atomic file writes and an advisory lock: every file the project writes goes through here."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def unwritable_reason(out: Path) -> str | None:
    """Why no folder can be made or written at `out`, naming the path at fault (None when one
    can): `out` is a file, or the nearest existing folder above it is not writable (a
    read-only file system included). Said before any work, beside the option that named it.

    >>> unwritable_reason(Path("/proc/version/run"))
    '/proc/version is a file, not a folder'
    """
    probe = Path(out)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK):
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        return f"{probe} is not a writable folder" + (" (a read-only file system)" * read_only)
    return None


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    r"""A mountinfo path with its octal escapes (\040 for a space, \134 for a backslash) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, in mount order, from
    /proc/self/mountinfo (empty where it is missing: not Linux)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields, _, rest = line.partition(" - ")
        fields = fields.split()
        if len(fields) >= 5 and rest:
            mounts.append((_unescape(fields[4]), rest.split()[0]))
    return mounts


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding `path` ("ext4", "overlay", "tmpfs", ...): that of
    the mount point that is the longest prefix of its real path (the last mounted, where several
    share it). None where no mount is known.

    >>> filesystem_type(Path("/proc/self")) in ("proc", None)
    True
    """
    probe = Path(path).resolve()
    best, kind = -1, None
    for point, fstype in _mounts():
        if (probe == Path(point) or Path(point) in probe.parents) and len(point) >= best:
            best, kind = len(point), fstype
    return kind


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


def named(e: OSError, path: Path | str) -> OSError:
    """`e` naming `path` where the call that raised it left it nameless (a write, tarfile's
    appends), so that a full or failing disk's message says which file; `e` itself otherwise."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no temporary file is left behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def replace_file_bytes(path: Path, data: bytes) -> None:
    """Atomic but not durable: readers see the old file or the new one, and nothing waits for
    the disk. For files that are rewritten every second and worthless after a crash (progress
    counters): an fsync there can stall its caller for seconds while the file system commits
    other writers' data."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")


_TMP = re.compile(r"^\..+\.tmp\.\d+\.\d+$")
STALE_TMP_S = 60.0  # an atomic write takes milliseconds: a temporary file this old was left


def remove_stale_tmp(folder: Path, older_than_s: float = STALE_TMP_S) -> list[Path]:
    """Delete the temporary files of atomic writes in `folder` that a killed process left
    (older than `older_than_s`: a running write's is younger); returns them."""
    gone = []
    now = time.time()
    for entry in os.scandir(folder) if Path(folder).is_dir() else []:
        try:
            if _TMP.match(entry.name) and now - entry.stat().st_mtime > older_than_s:
                os.unlink(entry.path)
                gone.append(Path(entry.path))
        except OSError:  # gone already, or not ours to delete: best effort
            continue
    return gone


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it: for a moment every
    other thread would create files with another mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_modes(root: Path) -> None:
    """Files 0644 and folders 0755 under `root` (within the umask): what the user's own
    writes get. safetensors and tempfile.mkdtemp create private files and folders (0600,
    0700), which a serving process running as another user cannot read."""
    root = Path(root)
    mask = _umask()
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        if path.stat().st_mode & 0o777 != want:
            path.chmod(want)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename a finished folder `tmp` to `final`, replacing an older `final` if one exists."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if missing); serialises manifest updates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def within(path: Path | str, folder: Path | str) -> bool:
    """Whether `path` is `folder` or lies inside it, both resolved.

    >>> within("/a/b/c", "/a/b"), within("/a/b", "/a/b"), within("/a/bc", "/a/b")
    (True, True, False)
    """
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents
