"""shared.diskqueue: the bound on queued bytes, a failed write raised on the next submit and at
the commit (the part is not committed), and parts written through the queue equal to parts
written inline."""

from __future__ import annotations

import errno
import threading
import zlib
from concurrent.futures import wait

import pytest

import shared.zarr_part
from shared.cache import open_part, open_part_writer
from shared.codec import CHUNK_ROWS
from shared.diskqueue import DiskQueue, WriteDropped, drain
from tests.test_cache import H, K, assert_matches, make_records, write_part


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


def test_peak_and_wait_idle():
    """Three jobs held on an event are all pending together; `wait_idle` returns once they are
    written; the peak stays after they end."""
    q, go = DiskQueue(threads=1, budget=100), threading.Event()
    futures = [q.submit(n, go.wait) for n in (10, 20, 30)]
    assert q.pending == 60 and q.peak == 60
    idle = threading.Thread(target=q.wait_idle)
    idle.start()
    assert idle.is_alive()  # the jobs wait for `go`, so the queue cannot be idle yet
    go.set()
    idle.join()
    assert q.pending == 0 and q.written == 60
    drain(futures)
    drain([q.submit(5, lambda: None)])
    q.close()
    assert q.pending == 0 and q.peak == 60 and q.written == 65


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
    """The last shard file fails: every write() has returned by then, so only the commit,
    which waits for the part's files, can find it."""
    records = make_records()
    files = sum(-(-len(r.input_ids) // CHUNK_ROWS) for r in records)
    real, calls = shared.zarr_part.write_buffers, []

    def fails_last(path, buffers):  # noqa: ANN001, ANN202
        calls.append(path)
        if len(calls) == files:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, buffers)

    monkeypatch.setattr(shared.zarr_part, "write_buffers", fails_last)
    q = DiskQueue(threads=1)
    with pytest.raises(OSError, match="No space"):
        write_part(tmp_path, 0, records, fmt="zarr", store="bf16", io=q)
    q.close()
    assert len(calls) == files
    assert not (tmp_path / "part-000000").exists()


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_queued_writes_hold_their_own_bytes(tmp_path, store):
    """The staged memory a sample came from is reused once write() returns: the disk thread,
    held until the source is overwritten, still writes the sample as it was."""
    records = make_records()
    q, hold = DiskQueue(threads=1), threading.Event()
    q.submit(0, hold.wait)  # the one disk thread waits: every file below stays queued
    writer = open_part_writer(
        tmp_path, 0, fmt="zarr", store=store, num_layers=K, hidden_size=H,
        lengths=[len(r.input_ids) for r in records], io=q,
    )  # fmt: skip
    for n, r in enumerate(records):
        source = r.hidden.clone()
        writer.write(
            n, sample_index=r.sample_index, input_ids=r.input_ids, loss_mask=r.loss_mask,
            hidden=source,
        )  # fmt: skip
        source.zero_()
    assert q.pending > 0 and q.written == 0
    hold.set()
    writer.commit()
    q.close()
    reader = open_part(tmp_path / "part-000000")
    for n, record in enumerate(records):
        assert_matches(reader.read(n), record, store)


def test_close_drops_queued_jobs_and_refuses_new_ones():
    q, started, hold = DiskQueue(threads=1), threading.Event(), threading.Event()
    ran = []
    running = q.submit(1, lambda: (started.set(), hold.wait()))
    queued = q.submit(1, ran.append, "queued")
    started.wait()
    closer = threading.Thread(target=q.close)
    closer.start()
    while not q._closed:  # close has begun: the queued job is dropped from here on
        closer.join(0.001)
    hold.set()  # the running job ends; close waits for it and drops the queued one
    closer.join()
    assert running.done() and running.exception() is None
    assert ran == [] and q.pending == 0
    # A dropped write wakes whoever waits for it (a part's commit draining its writes) and
    # fails it: the part is not committed.
    assert not wait([queued], timeout=60).not_done  # (a cancelled future would never wake it)
    with pytest.raises(WriteDropped):
        drain([queued])
    with pytest.raises(RuntimeError, match="closed"):
        q.submit(1, lambda: None)


def test_a_submit_waiting_for_room_when_the_queue_closes_is_refused():
    q, hold = DiskQueue(threads=1, budget=2), threading.Event()
    running = q.submit(2, hold.wait)  # the budget is full until it ends
    refused = []

    def submit_one_more():
        try:
            q.submit(1, lambda: None)
        except RuntimeError as e:
            refused.append(str(e))

    submitter = threading.Thread(target=submit_one_more)
    submitter.start()  # waits for room (or finds the queue closed)
    closer = threading.Thread(target=q.close)
    closer.start()
    while not q._closed:
        closer.join(0.001)
    hold.set()
    closer.join()
    submitter.join()
    assert running.exception() is None
    assert refused == ["the disk queue is closed"] and q.pending == 0
