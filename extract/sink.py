"""Host side of capture: what is staged, pinned staging buffers, and compression + writing on
a thread pool.

The GPU never waits for the disk while a staging buffer is free: a batch's states are turned
into their stored form and copied into a pinned buffer on a side stream, and a writer thread
waits for that copy, then compresses each sample and writes it (a zarr part's shard files go to
`shared.diskqueue`'s threads, so the buffer is free once its samples are compressed). The
number of buffers bounds the memory and the work in flight.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from extract.data import Tokenized
from shared.codec import Bf16Planes, hidden_codec, quantize_fp8
from shared.int4 import Int4Scheme, encode_int4
from shared.planes import split_planes


class Staging:
    """A fixed pool of reusable host buffers (pinned on CUDA), one per batch in flight.

    Buffers are sized for `rows` tokens (the batch token budget) when first used, so the slow
    pinned allocations happen once per buffer rather than whenever a batch is longer than the
    ones before. On CUDA the payload and its copy run on a side stream: the next forward starts at
    once.
    """

    def __init__(self, count: int, *, pinned: bool, rows: int = 0):
        self.pinned, self.rows = pinned, rows
        self.waited_s = 0.0  # time stage() spent blocked for a free buffer (writers behind)
        self.landing_waited_s = 0.0  # writer threads' time waiting for copies (`wait_landed`)
        self._lock = threading.Lock()
        self._span_sum = self._span_max = 0.0  # `side_stream_s`
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
        self,
        states: torch.Tensor,
        payload: Callable[[torch.Tensor], dict[str, torch.Tensor]],
        *,
        tokens: int,
    ) -> tuple[dict[str, torch.Tensor], Callable]:
        """Make `payload(states)` (tensors holding `tokens` tokens on states' device) and copy
        it into a free buffer (blocking while none is free).

        On CUDA both run on the side stream, after the forward that made `states`: the payload's
        kernels (the int4 encoder's above all) overlap the next forward instead of delaying it.
        Returns host views and a `release()` to call once they have been written; the views'
        `_event` (None off CUDA) is set once the copy has landed.
        """
        start = time.perf_counter()
        slot = self._free.get()
        self.waited_s += time.perf_counter() - start
        try:
            views = self._fill(slot, states, payload, tokens)
        except BaseException:
            self._free.put(slot)  # the buffer is not in flight
            raise
        return views, lambda: self._free.put(slot)

    def _fill(self, slot: dict, states: torch.Tensor, payload: Callable, tokens: int) -> dict:
        if not self.pinned:
            tensors = payload(states)
            views = {name: self._view(slot, name, t, tokens) for name, t in tensors.items()}
            for name, t in tensors.items():
                views[name].copy_(t)
            return {**views, "_event": None}
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=states.device)
        main = torch.cuda.current_stream(states.device)
        forward_end = torch.cuda.Event(enable_timing=True)
        forward_end.record(main)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            tensors = payload(states)
            states.record_stream(self._stream)  # not reused before the payload is made
            views = {name: self._view(slot, name, t, tokens) for name, t in tensors.items()}
            for name, t in tensors.items():
                views[name].copy_(t, non_blocking=True)
            # Blocking: writer threads waiting for the copy sleep instead of spinning a core.
            landed = torch.cuda.Event(blocking=True, enable_timing=True)
            landed.record(self._stream)
        return {**views, "_event": landed, "_span": forward_end}

    def wait_landed(self, views: dict) -> None:
        """Block until the copy of `stage`'s `views` has landed (at once off CUDA); the wait
        counts into `landing_waited_s`, and the batch's span (its forward's end to the copy's
        landing) into `side_stream_s` once. Safe from any thread."""
        event = views["_event"]
        if event is None:
            return
        start = time.perf_counter()
        event.synchronize()
        with self._lock:
            self.landing_waited_s += time.perf_counter() - start
            forward_end = views.pop("_span", None)
            if forward_end is not None:
                span = forward_end.elapsed_time(event) / 1e3
                self._span_sum += span
                self._span_max = max(self._span_max, span)

    def side_stream_s(self) -> tuple[float, float]:
        """(sum, longest) seconds from a staged batch's forward ending to its copy landing, on
        the device: the payload and copy on the side stream, behind the batches before them and
        sharing the device with the next forward; (0, 0) off CUDA. Counts the batches whose
        copies a writer has waited for (`wait_landed`)."""
        with self._lock:
            return self._span_sum, self._span_max

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


class TaskDropped(RuntimeError):
    """A writer task that `WriterPool.close` dropped before it started: its part is not
    committed."""


class WriterPool:
    """Threads for compression and writing; errors surface on the next `check()` or `close()`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="writer")
        self.futures: list[Future] = []
        self.busy_s = 0.0  # the threads' time in tasks, all threads together
        self.cpu_s = 0.0  # of it, their time running on a core (the rest: GIL, cores, waits)
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable, *args) -> Future:
        fut = self.pool.submit(self._timed, fn, *args)
        with self._lock:
            self.futures.append(fut)
        return fut

    def _timed(self, fn: Callable, *args) -> object:
        if self._closed:  # dropped: the future fails, so whoever waits for it wakes
            raise TaskDropped("the writer threads were closed before this task started")
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - start
                self.cpu_s += time.thread_time() - cpu

    def wait_idle(self) -> None:
        """Wait for the tasks submitted so far, failed or not (`check` and `close` raise)."""
        with self._lock:
            pending = list(self.futures)
        wait(pending)

    def check(self) -> None:
        with self._lock:
            done = [f for f in self.futures if f.done()]
            self.futures = [f for f in self.futures if not f.done()]
        for f in done:
            f.result()

    def close(self) -> None:
        """Wait for the tasks, raising the first failure; on a failure (or an interrupt) the
        tasks not started are dropped: each fails with TaskDropped. Not cancelled: a future
        cancelled by the executor's shutdown never wakes a `wait` for it, and a part's commit
        waits for its tasks (`extract.commit.commit_part`)."""
        try:
            for f in list(self.futures):
                f.result()
        finally:
            self._closed = True
            self.pool.shutdown(wait=True)


def device_payload(
    packed: torch.Tensor, store: str, fmt: str, *, compiled: bool = True
) -> dict[str, torch.Tensor]:
    """What is staged to the host: layer-major payload [K, N, H] (one layer's rows contiguous,
    see LayerCapture) and, for fp8, the scales [N, K]; int4 records [K, N, H + 4], encoded on
    the device (`shared.int4.encode_int4`; on a GPU its compiled encoder if `compiled`). bf16
    for zarr parts goes as its two `planes` byte planes, split on the device
    (`shared.planes.split_planes`): as many bytes as the bf16 values, and the writer threads,
    which share the host's cores and its GIL with the thread launching the forwards, only
    compress."""
    if store == "fp8":
        q, scale = quantize_fp8(packed)
        return {"q": q.transpose(0, 1).contiguous(), "scale": scale.contiguous()}
    if store == "int4":
        scheme = Int4Scheme(hidden=packed.shape[-1])
        records = encode_int4(packed.transpose(0, 1), scheme, compiled=compiled)
        return {"int4": records}
    hidden = packed.transpose(0, 1).to(torch.bfloat16)
    if fmt == "zarr" and hidden_codec(store) == "planes":
        planes = split_planes(hidden)
        return {"exponent": planes.exponent, "sign_mantissa": planes.sign_mantissa}
    return {"hidden": hidden.contiguous()}


class Countdown:
    """Calls `release` when the last of `count` writer tasks (samples or pieces of them) of one
    staged batch is done."""

    def __init__(self, count: int, release: Callable[[], None]):
        self.left, self.release, self.lock = count, release, threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.release()


def write_sample(
    writer,
    n: int,
    row: Tokenized,
    host: dict,
    rows: slice,
    piece: slice,
    countdown: Countdown,
    staging: Staging,
) -> None:
    """Write the `piece` of sample n (token positions in it) that the staged batch `host`
    holds at `rows`."""
    try:
        staging.wait_landed(host)  # the async copy into the pinned buffer
        # [L, K, H] views of the layer-major buffers: the writers take them without a copy.
        if "q" in host:
            hidden = (host["q"][:, rows].transpose(0, 1), host["scale"][rows])
        elif "int4" in host:
            hidden = host["int4"][:, rows].transpose(0, 1)
        elif "exponent" in host:
            e, sm = (host[name][:, rows].transpose(0, 1) for name in ("exponent", "sign_mantissa"))
            hidden = Bf16Planes(e, sm)
        else:
            hidden = host["hidden"][:, rows].transpose(0, 1)
        writer.write(
            n,
            sample_index=row.row,
            input_ids=row.input_ids[piece],
            loss_mask=row.loss_mask[piece],
            hidden=hidden,
            rows=piece,  # a format that takes no pieces gets the whole sample as its one piece
        )
    finally:
        countdown.done()
