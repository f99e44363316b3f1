"""Early writeback: a shard file's pages leave the dirty state as soon as it is written, on a
plain file system and through overlayfs (where sync_file_range(2) does nothing), so a part's
commit finds little left to sync."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.fsio import filesystem_type, start_writeback
from shared.zarr_part import write_buffers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache")

_CACHESTAT = 451  # the same number on every architecture (a syscall added after 424)
MB = 1 << 20


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


def dirty_pages(path: Path) -> int:
    """Pages of `path`, just written, that are dirty in the page cache (cachestat(2), Linux
    6.5). Skips where its pages are not seen there (a file system stacked on another, as an
    overlay seen from above, or one without a page cache)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Stat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(_Range(0, 0)), ctypes.byref(stat), 0):
            pytest.skip(f"cachestat(2): {os.strerror(ctypes.get_errno())}")
        if stat.cache == 0:
            pytest.skip(f"{path}: its pages are not in this file system's page cache")
        return stat.dirty
    finally:
        os.close(fd)


def _in_memory(path: Path) -> bool:
    return filesystem_type(path) in ("tmpfs", "ramfs")


@contextlib.contextmanager
def overlay(tmp_path: Path):
    """An overlay mounted in `tmp_path`: (its merged folder, its upper folder, whose files hold
    the pages); skips where none can be mounted (not root, no overlayfs)."""
    parts = {n: tmp_path / n for n in ("lower", "upper", "work", "merged")}
    for p in parts.values():
        p.mkdir()
    options = "lowerdir={lower},upperdir={upper},workdir={work}".format(**parts)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(parts["merged"])],
        capture_output=True,
    )
    if done.returncode:
        pytest.skip(f"cannot mount an overlay here: {done.stderr.decode().strip()}")
    try:
        yield parts["merged"], parts["upper"]
    finally:
        subprocess.run(["umount", "-l", str(parts["merged"])], capture_output=True)


@pytest.fixture(params=["plain", "overlay"])
def folders(request, tmp_path):
    """(where to write, where the file's pages are seen): the same folder, or an overlay's merged
    folder and its upper folder."""
    if _in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is in memory: nothing is written back")
    if request.param == "plain":
        yield tmp_path, tmp_path
        return
    with overlay(tmp_path) as pair:
        yield pair


def test_a_written_shard_file_is_not_left_dirty(folders):
    write_to, seen_at = folders
    data = os.urandom(4 * MB)
    size, _ = write_buffers(write_to / "c.0.0.0", [data[: MB + 7], data[MB + 7 :]])
    assert size == len(data)
    assert dirty_pages(seen_at / "c.0.0.0") == 0
    assert (write_to / "c.0.0.0").read_bytes() == data


def test_an_appended_file_is_not_left_dirty_after_each_append(folders):
    # The webdataset writer appends samples to one tar and starts its writeback after each. A
    # page that an append ends in may be written again by the next one while its writeback
    # runs, and then stays dirty: at most one such page an append, of the 513 each writes.
    write_to, seen_at = folders
    with open(write_to / "part.tar", "wb") as f:
        for n in range(4):
            start = f.tell()
            f.write(bytes([n]) * (2 * MB + 100))
            f.flush()
            start_writeback(f.fileno(), start, f.tell() - start)
            assert dirty_pages(seen_at / "part.tar") <= n


def test_without_either_way_the_pages_stay_dirty(tmp_path, monkeypatch):
    # What the tests above would see if nothing started the writeback: they can fail.
    import shared.fsio as fsio

    if _in_memory(tmp_path):
        pytest.skip("in memory")
    monkeypatch.setattr(fsio, "_sync_file_range", lambda: None)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    write_buffers(tmp_path / "c.0.0.0", [os.urandom(4 * MB)])
    assert dirty_pages(tmp_path / "c.0.0.0") > 0


def test_through_an_overlay_sync_file_range_alone_leaves_the_pages_dirty(tmp_path, monkeypatch):
    # Why an overlay takes posix_fadvise: sync_file_range(2) reaches the overlay's own page
    # cache, not the file's below.
    import shared.fsio as fsio

    if _in_memory(tmp_path):
        pytest.skip("in memory")
    with overlay(tmp_path) as (write_to, seen_at):
        monkeypatch.setattr(fsio, "_is_overlay", lambda dev: False)
        write_buffers(write_to / "c.0.0.0", [os.urandom(4 * MB)])
        assert dirty_pages(seen_at / "c.0.0.0") > 0
