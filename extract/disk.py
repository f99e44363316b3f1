"""A full or failing disk while extracting is one message: which folder, its free space, a
part's size, and what to do."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from typing import Any

from shared.manifest import CacheMismatch, read_manifest
from shared.space import DiskFailed, DiskFull, size_text


@contextlib.contextmanager
def disk_full_message(job: Any) -> Iterator[None]:
    """Turn ENOSPC or EDQUOT (raised by a writer or the commit thread) into one message: which
    folder, its free space, and about how much a part takes (the mean of those committed); EIO
    into one too. A disk that refuses data its file system had room for (space allocated as
    written: a thin-provisioned, network or loop device whose own store is full) fails the
    writeback of bytes written before, so the message says so when the file system shows free
    space. `job` is the extract.job.Job (only its `out` is read)."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.EIO:
            raise DiskFailed(
                f"the disk holding {job.out} failed a write ({e.strerror}: "
                f"{e.filename or 'a cache file'}). The part being written was not committed; "
                "the committed ones are kept (`python -m extract.verify` checks them). Check "
                "the disk, then rerun the same command."
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
        free = shutil.disk_usage(job.out).free
        below = (
            f" Its file system shows {size_text(free)} free, so the space ran out below it "
            f"(a disk that allocates space as it is written: {e.strerror} for bytes written "
            "before, which were not committed)."
            if free > 128 << 20  # far more than any one write of a part
            else ""
        )
        raise DiskFull(
            f"the disk holding {job.out} is full ({free / 1e6:,.1f} MB free; {size}).{below} "
            "Free space there (or move the cache and use its new --out), then rerun the same "
            "command: committed parts are kept and the one being written is redone."
        ) from None
