"""shared.diskqueue: the bound on queued bytes, a failed write raised on the next submit and at
the commit (the part is not committed), and parts written through the queue equal to parts
written inline."""

from __future__ import annotations

import errno
import zlib

import pytest

import shared.zarr_part
from shared.cache import open_part
from shared.diskqueue import DiskQueue, drain
from tests.test_cache import assert_matches, make_records, write_part


def test_queued_bytes_never_exceed_the_budget():
    """One write thread, a budget of two 1-byte jobs: each job finds at most two queued. Without
    the bound the loop would queue all 60 before the first few ran."""
    q = DiskQueue(threads=1, budget=2)
    seen: list[int] = []

    def job() -> None:
        seen.append(q.pending)
        zlib.crc32(bytes(1 << 20))  # some work, so an unbounded queue would fill up

    futures = [q.submit(1, job) for _ in range(60)]
    drain(futures)
    q.close()
    assert len(seen) == 60 and max(seen) <= 2
    assert q.pending == 0 and q.written == 60


def test_a_job_larger_than_the_budget_runs_alone():
    q = DiskQueue(threads=2, budget=10)
    drain([q.submit(100, lambda: None), q.submit(100, lambda: None)])
    q.close()
    assert q.written == 200


def test_a_failed_write_is_raised_by_the_next_submit_and_by_drain():
    q = DiskQueue(threads=1, budget=1 << 30)

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    failed = q.submit(5, full)
    with pytest.raises(OSError, match="No space"):
        drain([failed])
    with pytest.raises(OSError, match="No space"):
        q.submit(1, lambda: None)
    q.close()
    assert q.pending == 0 and q.written == 0


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_zarr_part_through_the_queue_equals_the_part_written_inline(tmp_path, store):
    records = make_records()
    inline = write_part(tmp_path / "a", 0, records, fmt="zarr", store=store, threads=3)
    q = DiskQueue(threads=2, budget=1)  # every sample's files wait for the ones before
    queued = write_part(tmp_path / "b", 0, records, fmt="zarr", store=store, threads=3, io=q)
    q.close()
    assert queued == inline  # same bytes: same checksum, sizes and counts
    reader = open_part(tmp_path / "b" / "part-000000")
    for n, record in enumerate(records):
        assert_matches(reader.read(n), record, store)


def test_a_failed_shard_write_leaves_the_part_uncommitted(tmp_path, monkeypatch):
    real, calls = shared.zarr_part.write_buffers, []

    def fails_third(path, buffers):  # noqa: ANN001, ANN202
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, buffers)

    monkeypatch.setattr(shared.zarr_part, "write_buffers", fails_third)
    q = DiskQueue(threads=1)
    with pytest.raises(OSError, match="No space"):
        write_part(tmp_path, 0, make_records(), fmt="zarr", store="bf16", io=q)
    q.close()
    assert len(calls) >= 3
    assert not (tmp_path / "part-000000").exists()
