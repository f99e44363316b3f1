"""A full or failing disk while extracting is one message: which folder, its free space, a
part's size, and what to do."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.manifest import CacheMismatch, read_manifest
from shared.space import DiskFailed, DiskFull
from shared.writeback import WritebackError


@contextlib.contextmanager
def disk_full_message(job: Any) -> Iterator[None]:
    """Turn ENOSPC or EDQUOT (raised by a writer or the commit thread) into one message: which
    folder, its free space, and about how much a part takes (the mean of those committed). A
    write that the disk failed after it had succeeded (`WritebackError`: found by a part's
    sync, or by dropping its pages) is one message too, whatever its errno, as is an I/O error
    writing a file under the cache. `job` is the extract.job.Job (only its `out` is read)."""
    try:
        yield
    except OSError as e:
        if isinstance(e, WritebackError) or (e.errno == errno.EIO and _under(e.filename, job.out)):
            raise DiskFailed(
                f"the disk holding {job.out} failed to store data written there ({e.strerror}: "
                f"{e.filename or 'a cache file'}): a disk whose space or device below its "
                "file system failed (thin-provisioned, network, loop), or a failing disk. The "
                "part being written was not committed; the committed ones are kept (`python -m "
                "extract.verify` checks them). Give that disk room or fix it, then rerun the "
                "same command."
            ) from None
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            parts = read_manifest(job.out).parts
        except (CacheMismatch, OSError):
            parts = ()
        size = (
            f"a part takes about {sum(p.nbytes for p in parts) / len(parts) / 1e6:,.1f} MB "
            "(the mean of those committed)"
            if parts
            else "no part was committed yet"
        )
        free = shutil.disk_usage(job.out).free / 1e6
        raise DiskFull(
            f"the disk holding {job.out} is full ({free:,.1f} MB free; {size}). Free space "
            "there (or move the cache and use its new --out), then rerun the same command: "
            "committed parts are kept and the one being written is redone."
        ) from None


def _under(path: object, folder: Path) -> bool:
    if not path:
        return False
    try:
        return Path(str(path)).resolve().is_relative_to(Path(folder).resolve())
    except (OSError, ValueError):
        return False
