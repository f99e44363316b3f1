"""A full disk while extracting is one message: which folder, its free space, a part's size."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from typing import Any

from shared.manifest import CacheMismatch, read_manifest
from shared.space import DiskFull


@contextlib.contextmanager
def disk_full_message(job: Any) -> Iterator[None]:
    """Turn ENOSPC (raised by a writer or the commit thread) into one message: which folder,
    its free space, and about how much a part takes (the mean of those committed). `job` is
    the extract.job.Job (only its `out` is read)."""
    try:
        yield
    except OSError as e:
        if e.errno != errno.ENOSPC:
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
