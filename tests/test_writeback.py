"""Early writeback: a shard file's pages leave the dirty state as soon as it is written, on a
plain file system and through overlayfs (where sync_file_range(2) does nothing), so a part's
commit finds little left to sync. Drop-behind: the pages of what was written long enough ago
leave the page cache (zarr shard files and a webdataset tar alike), and the data reads back
from the disk."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shared.wds
from shared.cache import open_part, open_part_writer
from shared.fsio import filesystem_type
from shared.writeback import DropBehind, start_writeback
from shared.zarr_part import write_buffers

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux page cache")

_CACHESTAT = 451  # the same number on every architecture (a syscall added after 424)
MB = 1 << 20


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recent")]


def cachestat(path: Path, offset: int = 0, length: int = 0) -> _Stat:
    """cachestat(2) (Linux 6.5) of `path`'s pages in [offset, offset + length) (0: to the end);
    skips where the call is missing."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        stat = _Stat()
        rng = ctypes.byref(_Range(offset, length))
        if libc.syscall(_CACHESTAT, fd, rng, ctypes.byref(stat), 0):
            pytest.skip(f"cachestat(2): {os.strerror(ctypes.get_errno())}")
        return stat
    finally:
        os.close(fd)


def dirty_pages(path: Path) -> int:
    """Pages of `path`, just written, that are dirty in the page cache. Skips where its pages
    are not seen there (a file system stacked on another, as an overlay seen from above, or one
    without a page cache)."""
    stat = cachestat(path)
    if stat.cache == 0:
        pytest.skip(f"{path}: its pages are not in this file system's page cache")
    return stat.dirty


def cached_pages(path: Path, offset: int = 0, length: int = 0) -> int:
    return cachestat(path, offset, length).cache


@pytest.fixture
def on_disk(tmp_path):
    """A folder on a file system with a page cache of its own (sync_file_range reaches it)."""
    if _in_memory(tmp_path):
        pytest.skip(f"{tmp_path} is in memory: its pages are its only copy")
    import shared.writeback as writeback

    probe = tmp_path / "probe"
    probe.write_bytes(bytes(4096))
    fd = os.open(probe, os.O_RDONLY)
    try:
        if writeback._sync_file_range() is None or writeback._is_overlay(fd):
            pytest.skip("no sync_file_range(2) on this file system")
    finally:
        os.close(fd)
    if cached_pages(probe) == 0:
        pytest.skip(f"{tmp_path}: its pages are not in this file system's page cache")
    return tmp_path


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
    import shared.writeback as writeback

    if _in_memory(tmp_path):
        pytest.skip("in memory")
    monkeypatch.setattr(writeback, "_sync_file_range", lambda: None)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    write_buffers(tmp_path / "c.0.0.0", [os.urandom(4 * MB)])
    assert dirty_pages(tmp_path / "c.0.0.0") > 0


def test_through_an_overlay_sync_file_range_alone_leaves_the_pages_dirty(tmp_path, monkeypatch):
    # Why an overlay takes posix_fadvise: sync_file_range(2) reaches the overlay's own page
    # cache, not the file's below.
    import shared.writeback as writeback

    if _in_memory(tmp_path):
        pytest.skip("in memory")
    with overlay(tmp_path) as (write_to, seen_at):
        monkeypatch.setattr(writeback, "_is_overlay", lambda dev: False)
        write_buffers(write_to / "c.0.0.0", [os.urandom(4 * MB)])
        assert dirty_pages(seen_at / "c.0.0.0") > 0


def test_files_written_long_enough_ago_leave_the_page_cache(on_disk):
    drop = DropBehind(lag=8 * MB)
    data = [os.urandom(4 * MB) for _ in range(6)]
    for n, d in enumerate(data):
        write_buffers(on_disk / f"c.{n}.0.0", [d])
        drop.written(str(on_disk / f"c.{n}.0.0"), len(d))
    # 8 MB or more written after files 0-3; files 4 and 5 are the latest and keep their pages.
    assert [cached_pages(on_disk / f"c.{n}.0.0") > 0 for n in range(6)] == [False] * 4 + [True] * 2
    assert [(on_disk / f"c.{n}.0.0").read_bytes() for n in range(6)] == data  # from the disk


def test_without_drop_behind_written_files_stay_cached(on_disk):
    # What the test above would see if nothing dropped the pages: it can fail.
    for n in range(6):
        write_buffers(on_disk / f"c.{n}.0.0", [os.urandom(4 * MB)])
    assert all(cached_pages(on_disk / f"c.{n}.0.0") > 0 for n in range(6))


def test_a_file_removed_before_its_turn_is_skipped(on_disk):
    drop = DropBehind(lag=MB)
    write_buffers(on_disk / "a", [os.urandom(MB)])
    drop.written(str(on_disk / "a"), MB)
    (on_disk / "a").unlink()  # an aborted part's folder goes while its writes are in flight
    write_buffers(on_disk / "b", [os.urandom(2 * MB)])
    drop.written(str(on_disk / "b"), 2 * MB)  # drops "a": gone, so nothing to do
    assert cached_pages(on_disk / "b") > 0


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_a_parts_bytes_leave_the_page_cache_as_written_the_rest_at_its_commit(
    on_disk, monkeypatch, fmt
):
    import shared.writeback as writeback

    monkeypatch.setattr(writeback, "DROP_BEHIND_BYTES", 4 * MB)
    monkeypatch.setattr(shared.wds, "DROP_BEHIND_BYTES", 4 * MB)
    lengths, hidden = [512] * 12, 1024  # 2 MB of bf16 states a sample, barely compressible
    rng = np.random.default_rng(0)
    states = [torch.from_numpy(rng.standard_normal((n, 2, hidden), np.float32)) for n in lengths]
    states = [h.to(torch.bfloat16) for h in states]
    writer = open_part_writer(
        on_disk, 0, fmt=fmt, store="bf16", num_layers=2, hidden_size=hidden, lengths=lengths
    )
    for n, h in enumerate(states):  # one after another, in this thread
        writer.write(n, sample_index=n, input_ids=np.arange(512), loss_mask=np.ones(512),
                     hidden=h)  # fmt: skip
    if fmt == "zarr":
        shards = sorted((writer.tmp / "hidden").glob("c.*"), key=lambda p: int(p.name[2:-4]))
        cached = [cached_pages(p) > 0 for p in shards]
        assert not any(cached[:8]) and cached[-1], cached  # the first samples' shards dropped
    else:
        size = writer.tmp.stat().st_size
        assert cached_pages(writer.tmp, 0, size // 2) == 0
        assert cached_pages(writer.tmp, size - MB, MB) > 0
    writer.commit()  # the last 4 MB go once synced: no page of its states stays
    if fmt == "zarr":
        assert not any(cached_pages(p) for p in (writer.final / "hidden").glob("c.*"))
    else:
        assert cached_pages(writer.final) == 0
    read = {s.sample_index: np.asarray(s.hidden) for s in open_part(writer.final)}
    assert sorted(read) == list(range(len(states)))  # every sample, from the disk
    for n, h in enumerate(states):
        assert np.array_equal(read[n].view(np.uint16), h.view(torch.uint16).numpy())


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_a_write_the_disk_lost_fails_the_part_though_the_disk_recovers(
    failing_disk, monkeypatch, fmt
):
    # Waiting for a file's writeback before dropping its pages takes the write's error from the
    # file: a later fsync or syncfs no longer sees it. The drop must fail the part then, or the
    # part would be committed with a checksum of bytes the disk never got.
    import shared.writeback as writeback

    folder, fail, heal = failing_disk
    monkeypatch.setattr(writeback, "DROP_BEHIND_BYTES", 4 * MB)
    monkeypatch.setattr(shared.wds, "DROP_BEHIND_BYTES", 4 * MB)
    # The disk fails the first samples' writes, then takes the rest: enough after it (over
    # 4 MB) that every failed file has been dropped before the commit syncs the part.
    lengths, hidden = [512] * 16, 1024
    rng = np.random.default_rng(0)
    writer = open_part_writer(
        folder, 0, fmt=fmt, store="bf16", num_layers=2, hidden_size=hidden, lengths=lengths
    )
    os.sync()  # the part's first files (its metadata) are on disk
    fail()
    with pytest.raises(OSError):
        for n in range(len(lengths)):
            h = torch.from_numpy(rng.standard_normal((512, 2, hidden), np.float32))
            writer.write(n, sample_index=n, input_ids=np.arange(512), loss_mask=np.ones(512),
                         hidden=h.to(torch.bfloat16))  # fmt: skip
            if n == 5:  # the disk has failed the writes so far; from now on it takes them
                os.sync()
                heal()
        writer.commit()
    writer.abort()
    assert not writer.final.exists() and not writer.tmp.exists()


@pytest.mark.parametrize("evicted", [False, True])
def test_a_write_error_another_sync_has_seen_still_fails_the_part(failing_disk, evicted):
    # Another process's syncfs (another rank's commit, another run on the disk) sees the
    # disk's error first: a descriptor opened after that would not see it, one opened when the
    # part began does.
    import shared.writeback as writeback

    folder, fail, heal = failing_disk
    lengths, hidden = [512] * 3, 1024
    rng = np.random.default_rng(0)
    writer = open_part_writer(
        folder, 0, fmt="zarr", store="bf16", num_layers=2, hidden_size=hidden, lengths=lengths
    )
    os.sync()
    fail()
    for n in range(len(lengths)):
        h = torch.from_numpy(rng.standard_normal((512, 2, hidden), np.float32))
        writer.write(n, sample_index=n, input_ids=np.arange(512), loss_mask=np.ones(512),
                     hidden=h.to(torch.bfloat16))  # fmt: skip
    os.sync()  # the writeback fails
    heal()
    if evicted:  # the closed files leave memory, and their own errors with them
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3")
        except OSError as e:
            pytest.skip(f"cannot drop the caches: {e}")
    with pytest.raises(writeback.WritebackError):  # someone else's syncfs takes the error first
        writeback._syncfs(folder)
    with pytest.raises(writeback.WritebackError):
        writer.commit()
    with contextlib.suppress(OSError):  # the failed writes damaged this ext4's own blocks
        writer.abort()
    assert not writer.final.exists()
