"""Host side of capture: pinned staging buffers, and compression + writing on a thread pool.

The GPU never waits for the disk while a staging buffer is free: a batch's states are copied
asynchronously into a pinned buffer, and a writer thread waits for that copy, then compresses
and writes each sample. The number of buffers bounds the memory and the work in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class Staging:
    """A fixed pool of reusable host buffers (pinned on CUDA), one per batch in flight.

    Buffers are sized for `rows` tokens (the batch token budget) when first used, so the slow
    pinned allocations happen once per buffer rather than whenever a batch is longer than the
    ones before. On CUDA the copies run on a side stream: the next forward starts at once.
    """

    def __init__(self, count: int, *, pinned: bool, rows: int = 0):
        self.pinned, self.rows = pinned, rows
        self.waited_s = 0.0  # time stage() spent blocked for a free buffer (writers behind)
        self.nbytes = 0  # of all buffers allocated
        self._free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        self._stream: torch.cuda.Stream | None = None
        for _ in range(count):
            self._free.put({})

    def reserve(self, tensors: dict[str, torch.Tensor], *, tokens: int) -> None:
        """Allocate every buffer now for tensors like these (holding `tokens` tokens), sized
        for the batch budget: pinning hundreds of MB takes about half a second a buffer, which
        the first forwards would otherwise wait for."""
        slots = [self._free.get() for _ in range(self._free.qsize())]
        for slot in slots:
            for name, t in tensors.items():
                self._view(slot, name, t, tokens)
            self._free.put(slot)

    def stage(
        self, tensors: dict[str, torch.Tensor], *, tokens: int
    ) -> tuple[dict[str, torch.Tensor], Callable]:
        """Copy device tensors holding `tokens` tokens into a free buffer (blocking while none
        is free).

        Returns host views and a `release()` to call once they have been written; the views'
        `_event` (None off CUDA) is set once the copy has landed.
        """
        start = time.perf_counter()
        slot = self._free.get()
        self.waited_s += time.perf_counter() - start
        views = {name: self._view(slot, name, t, tokens) for name, t in tensors.items()}
        event = None
        if self.pinned:
            device = next(iter(tensors.values())).device
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._stream):
                for name, t in tensors.items():
                    views[name].copy_(t, non_blocking=True)
                    t.record_stream(self._stream)  # not reused before the copy is done
                # Blocking: writer threads waiting for the copy sleep instead of spinning a core.
                event = torch.cuda.Event(blocking=True)
                event.record(self._stream)
        else:
            for name, t in tensors.items():
                views[name].copy_(t)
        views["_event"] = event  # type: ignore[assignment]
        return views, lambda: self._free.put(slot)

    def _view(
        self, slot: dict[str, torch.Tensor], name: str, t: torch.Tensor, tokens: int
    ) -> torch.Tensor:
        """A view of shape t.shape into the slot's buffer `name`, grown when too small."""
        buf = slot.get(name)
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            numel = max(t.numel(), self.rows * (t.numel() // max(1, tokens)))
            if name in slot:
                self.nbytes -= slot[name].nbytes
            buf = torch.empty(numel, dtype=t.dtype, pin_memory=self.pinned)
            self.nbytes += buf.nbytes
            slot[name] = buf
        return buf[: t.numel()].view(t.shape)


class WriterPool:
    """Threads for compression and writing; errors surface on the next `check()` or `close()`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="writer")
        self.futures: list[Future] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        fut = self.pool.submit(fn, *args)
        with self._lock:
            self.futures.append(fut)
        return fut

    def check(self) -> None:
        with self._lock:
            done = [f for f in self.futures if f.done()]
            self.futures = [f for f in self.futures if not f.done()]
        for f in done:
            f.result()

    def close(self) -> None:
        try:
            for f in list(self.futures):
                f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
