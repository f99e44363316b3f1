"""Disk space: what is free where a folder is (or will be), sizes as text, and the error a full
disk stops a stage with (its message names the folder, its free space and what was needed)."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from shared.stopping import StopRun


class DiskFull(StopRun):
    """A stage's output folder is on a full disk; the message says where and how much."""


class DiskFailed(StopRun):
    """A stage's output folder is on a disk that failed a write (an I/O error, or a write lost
    after it succeeded: `shared.writeback.WritebackError`); the message says where."""


def free_bytes(path: Path | str) -> int:
    """Free bytes on the file system that holds (or will hold) `path`."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def used_bytes(path: Path | str) -> int:
    """The disk space that deleting `path` (a file, or a folder with all under it) gives back:
    its blocks, each file counted once however many names it has; 0 for what is gone."""
    seen, total = set(), 0
    for entry in [Path(path), *(Path(path).rglob("*") if Path(path).is_dir() else ())]:
        try:
            st = entry.lstat()
        except OSError:
            continue  # removed meanwhile
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def size_text(nbytes: float) -> str:
    """
    >>> size_text(19_600_000), size_text(3.4e9), size_text(512)
    ('19.6 MB', '3.40 GB', '0.0 MB')
    """
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


def is_disk_full(error: BaseException, folder: Path | str, need: int) -> bool:
    """Whether `error`, raised while writing `need` bytes into `folder`, is a full disk: ENOSPC,
    or any write error with less than `need` bytes free now (torch.save's writer reports a
    full disk as `RuntimeError: ... unexpected pos`, without an errno)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return free_bytes(folder) < need
    except OSError:
        return False


@contextlib.contextmanager
def full_disk_stops(folder: Path | str, *, rerun: str) -> Iterator[None]:
    """Turn ENOSPC raised in the block into DiskFull naming `folder` and its free space; the
    message ends with `rerun` (what to do once there is space)."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = free_bytes(folder)
        raise DiskFull(
            f"the disk holding {folder} is full ({size_text(free)} free) writing "
            f"{e.filename or 'a file'}. {rerun}"
        ) from None
