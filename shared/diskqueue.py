"""File writes on their own threads, with a bound on the bytes waiting to be written.

A part writer's threads compress a staged batch and hand each shard file's bytes here instead
of writing them: the staged buffer is free as soon as its samples are compressed, so the device
never waits for a disk that stalls for a moment (a commit's sync, writeback of a full request
queue), only for one slower on average than the forward, once `budget` bytes wait. The first
failed write (a full disk) is raised by the next `submit` and by `drain`, so the part that lost
it is never committed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

# Bytes of compressed shard files waiting for a write thread, per process: about four batches'
# output of an 8B target (16,384 tokens x 5 layers x 4096 x 2 bytes, compressed 1.5x).
DEFAULT_BUDGET = 2 << 30
DEFAULT_THREADS = 4


class WriteDropped(RuntimeError):
    """A write that `DiskQueue.close` dropped before it started: its part is not committed."""


class DiskQueue:
    """`submit(nbytes, fn, *args)` runs fn(*args) on a write thread, blocking the caller while
    more than `budget` bytes are queued or being written (never for a lone job larger than it)."""

    def __init__(self, threads: int = DEFAULT_THREADS, budget: int = DEFAULT_BUDGET):
        self.threads, self.budget = max(1, threads), budget
        self.pending = 0  # bytes submitted and not yet written
        self.peak = 0  # the most bytes pending at once
        self.waited_s = 0.0  # callers' time blocked on the budget
        self.busy_s = 0.0  # write threads' time in the jobs
        self.cpu_s = 0.0  # of it, their time running on a core (the rest: the disk, the GIL)
        self.written = 0  # bytes of the jobs that succeeded
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="disk")

    def submit(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("the disk queue is closed")
            self._raise_error()
            if self.pending and self.pending + nbytes > self.budget:
                start = time.perf_counter()
                self._cond.wait_for(
                    lambda: (
                        self._error is not None
                        or self._closed
                        or self.pending + nbytes <= self.budget
                        or not self.pending
                    )  # fmt: skip
                )
                self.waited_s += time.perf_counter() - start
                self._raise_error()
                if self._closed:
                    raise RuntimeError("the disk queue is closed")
            future = self._pool.submit(self._run, fn, args)
            self.pending += nbytes
            self.peak = max(self.peak, self.pending)
        # Done, failed or dropped by `close`: the bytes leave the queue and waiters wake.
        future.add_done_callback(lambda f: self._finished(nbytes, f))
        return future

    def _run(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self._closed:  # dropped: the future fails, so whoever waits for it wakes
            raise WriteDropped("the disk queue was closed before this write started")
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        except BaseException as e:
            with self._cond:
                self._error = self._error or e
            raise
        finally:
            with self._cond:
                self.busy_s += time.perf_counter() - start
                self.cpu_s += time.thread_time() - cpu

    def _finished(self, nbytes: int, future: Future) -> None:
        with self._cond:
            self.pending -= nbytes
            if not future.cancelled() and future.exception() is None:
                self.written += nbytes
            self._cond.notify_all()

    def wait_idle(self) -> None:
        """Wait until no job is queued or running (each written, failed or dropped)."""
        with self._cond:
            self._cond.wait_for(lambda: not self.pending)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for the writes running, drop those not started (a part whose writes were all
        waited for is already committed; the others are not); idempotent. A dropped write's
        future fails with WriteDropped: one cancelled by the executor's own shutdown would
        never wake a `wait` for it (a commit draining its part's writes would hang, and the
        process with it at exit)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # a submit waiting for room is refused
        self._pool.shutdown(wait=True)


def drain(futures: list[Future]) -> None:
    """Wait for every one of `futures`, then raise the first failure among them."""
    wait(futures)
    for f in futures:
        f.result()
