"""Progress counters across ranks, the host staging buffers of extraction, and its writer
threads' close."""

from __future__ import annotations

import errno
import threading
from concurrent.futures import wait
from functools import partial

import pytest
import torch

from extract.sink import Staging, TaskDropped, WriterPool, device_payload
from shared.progress import RankCounters, read_counters


def test_counters_of_all_ranks_are_summed_after_close(tmp_path):
    ranks = [RankCounters(tmp_path, r, every=3600) for r in range(2)]
    ranks[0].add(rows=3, tokens=100)
    ranks[1].add(rows=2)
    ranks[0].add(rows=1)
    for c in ranks:
        c.close()
    assert read_counters(tmp_path) == {"rows": 6, "tokens": 100}
    assert all(c._thread is None or not c._thread.is_alive() for c in ranks)
    # Nothing but the counter files is left behind (no temporary files).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]


def test_flush_writes_the_current_counts(tmp_path):
    c = RankCounters(tmp_path, 0, every=3600)
    c.add(parts=1)
    c.flush()
    assert read_counters(tmp_path) == {"parts": 1}
    c.add(parts=2)
    c.flush()
    assert read_counters(tmp_path) == {"parts": 3}
    c.close()


def _as_hidden(states: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"hidden": states}


def test_a_payload_that_fails_gives_its_buffer_back():
    """A failed stage (the payload raised) leaves no buffer taken: with one buffer, the next
    stage goes through instead of waiting forever."""
    staging = Staging(1, pinned=False, rows=10)

    def broken(states: torch.Tensor) -> dict[str, torch.Tensor]:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        staging.stage(torch.ones(3, 4), broken, tokens=3)
    staged = []  # on a thread: a buffer never given back would block it, not the test run
    ones = torch.ones(3, 4)
    t = threading.Thread(
        target=lambda: staged.append(staging.stage(ones, _as_hidden, tokens=3)), daemon=True
    )
    t.start()
    t.join(timeout=60)
    assert staged, "the failed stage kept its buffer"
    assert torch.equal(staged[0][0]["hidden"], torch.ones(3, 4))


def test_staging_copies_and_reuses_buffers_sized_for_the_budget():
    staging = Staging(1, pinned=False, rows=10)
    small = torch.arange(12, dtype=torch.float32).view(3, 4)
    views, release = staging.stage(small, _as_hidden, tokens=3)
    assert views["_event"] is None
    assert torch.equal(views["hidden"], small)
    ptr = views["hidden"].data_ptr()
    release()
    large = torch.arange(40, dtype=torch.float32).view(10, 4)  # within the 10-row budget
    views, release = staging.stage(large, _as_hidden, tokens=10)
    assert torch.equal(views["hidden"], large)
    assert views["hidden"].data_ptr() == ptr  # no new allocation
    release()
    over = torch.ones(11, 4)  # a single row longer than the budget still fits (grown)
    views, release = staging.stage(over, _as_hidden, tokens=11)
    assert torch.equal(views["hidden"], over)
    release()


@pytest.mark.parametrize("store", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("fmt", ["zarr", "webdataset"])
def test_reserved_buffers_take_every_batch_of_the_budget_without_allocating(store, fmt):
    """Reserved as the worker does (a one-token float32 payload), every staged bf16 batch of up
    to the budget lands in the reserved buffers: no allocation, the same memory."""
    staging = Staging(2, pinned=False, rows=10)
    staging.reserve(device_payload(torch.zeros(1, 3, 64), store, fmt), tokens=1)
    reserved = staging.nbytes
    slots = [staging._free.get() for _ in range(2)]
    memory = {(name, buf.data_ptr(), buf.dtype) for slot in slots for name, buf in slot.items()}
    for slot in slots:
        staging._free.put(slot)
    payload = partial(device_payload, store=store, fmt=fmt)
    for tokens in (10, 7, 10):
        packed = torch.randn(tokens, 3, 64, dtype=torch.bfloat16)
        batch = payload(packed)
        views, release = staging.stage(packed, payload, tokens=tokens)
        assert all(torch.equal(views[k], batch[k]) for k in batch)
        assert {(k, views[k].data_ptr(), views[k].dtype) for k in batch} <= memory
        release()
    assert staging.nbytes == reserved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("store", ["bf16", "int4"])
def test_gpu_payload_made_on_the_side_stream_survives_the_next_forward(store):
    """On a GPU the payload is made on the side stream: the states it reads are not handed to
    the next allocation (the next forward's) before it has read them, and it stages the bytes
    the main stream would have made."""
    device = torch.device("cuda")
    staging = Staging(1, pinned=True, rows=4096)
    states = torch.randn(4096, 3, 512, device=device, dtype=torch.bfloat16) * 4
    expected = {k: v.cpu() for k, v in device_payload(states, store, "zarr").items()}
    torch.cuda._sleep(50_000_000)  # the main stream is busy: the side stream runs late
    views, release = staging.stage(
        states, partial(device_payload, store=store, fmt="zarr"), tokens=4096
    )
    ptr = states.data_ptr()
    del states
    reused = torch.empty(4096 * 3 * 512, device=device, dtype=torch.bfloat16)
    assert reused.data_ptr() != ptr  # held for the side stream until its payload is made
    reused.fill_(0)
    staging.wait_landed(views)
    assert all(torch.equal(views[k], expected[k]) for k in expected)
    total, longest = staging.side_stream_s()  # one batch: from its forward's end to its copy's
    assert 0 < longest == total and staging.landing_waited_s > 0
    release()


def test_closing_the_writers_after_a_failure_wakes_a_commit_waiting_for_dropped_tasks():
    # A full disk with two parts in flight: a task fails, close raises it and drops the tasks
    # not started, and the part's commit waiting for them (a thread in wait()) must wake, or
    # the commit thread and the process hang.
    pool, started, gate = WriterPool(1), threading.Event(), threading.Event()

    def full_disk():
        raise OSError(errno.ENOSPC, "No space left on device")

    ran = []
    failing = pool.submit(full_disk)
    running = pool.submit(lambda: (started.set(), gate.wait()))
    queued = [pool.submit(ran.append, k) for k in range(3)]
    commit = threading.Thread(target=wait, args=([running, *queued],))  # commit_part's wait
    commit.start()
    # The second task runs (so the first has failed) before close: a close that came first
    # would drop it too.
    assert started.wait(60)
    closing = []
    closer = threading.Thread(target=lambda: closing.append(_raised(pool.close)))
    closer.start()
    while not pool._closed:  # close has seen the failure: what has not started is dropped
        closer.join(0.001)
    gate.set()
    closer.join()
    commit.join(60)
    assert not commit.is_alive()
    assert isinstance(closing[0], OSError) and failing.exception() is closing[0]
    assert running.exception() is None and ran == []
    assert all(isinstance(f.exception(), TaskDropped) for f in queued)


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None
