"""A rank's part pipeline: forward -> capture -> staged host copy -> compress/write threads ->
atomic part commit, one part at a time."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from extract.backpressure import EndClocks, RankClocks, limit_warning
from extract.batching import length_order
from extract.capture import LayerCapture
from extract.commit import OpenPart, commit_part, discard
from extract.data import Rejected, Tokenized
from extract.forward_clock import ForwardClock
from extract.job import Job
from extract.packing import chunk_size
from extract.sink import Countdown, Staging, WriterPool, device_payload, write_sample
from shared.cache import open_part_writer
from shared.codec import CHUNK_ROWS
from shared.diskqueue import DiskQueue
from shared.progress import RankCounters

log = logging.getLogger(__name__)
# Parts whose forwards are done and whose writes and commit are not: the device runs at most this
# many parts ahead of the commits, so a stop (SIGTERM, Ctrl-C) ends within that many parts'
# writes, and the unfinished work a crash loses stays as small, whatever the disk's budget.
PARTS_AWAITING_COMMIT = 2
# Rows of a sample one writer task compresses (a multiple of CHUNK_ROWS): 21 MB of raw bf16 at
# the 8B shape's 5 layers of 4,096, about 60 ms of one writer thread's time.
PIECE_ROWS = 8 * CHUNK_ROWS


def sample_pieces(length: int, size: int) -> list[slice]:
    """A sample of `length` tokens in pieces of `size` rows, the last one shorter.

    >>> sample_pieces(1100, 512)
    [slice(0, 512, None), slice(512, 1024, None), slice(1024, 1100, None)]
    >>> sample_pieces(64, 512)
    [slice(0, 64, None)]
    """
    return [slice(a, min(a + size, length)) for a in range(0, length, size)]


class PartPipeline:
    """Forward -> capture -> async host copy -> compress/write threads -> atomic part commit.

    `open(unit, kept, rejected)` prepares a part (on the reader thread, see `run_units`);
    `submit(part)` runs its forwards on this process's device and queues its writes; the commit
    (rename + manifest record) happens on a commit thread once the writes are done, so the device
    moves on to the next part at once.
    """

    def __init__(
        self,
        job: Job,
        device: torch.device,
        capture: LayerCapture,
        *,
        threads: int,
        counters: RankCounters,
        clock: ForwardClock | None = None,
        writes: bool = True,
        before_forward: Callable[[], None] | None = None,
    ):
        """`clock`: told where each part's forwards begin (its log names the gaps there).
        `writes` False: a rank that runs its input group's forwards (its slice of a sharded
        target) while another rank of the group writes the parts; `before_forward`: called
        before each forward (`extract.lockstep`)."""
        self.job, self.device, self.capture, self.counters = job, device, capture, counters
        self.clock, self.writes, self.before_forward = clock, writes, before_forward
        # `--compile none`: nothing compiled, the int4 encoder included.
        self.payload = functools.partial(
            device_payload, store=job.store, fmt=job.format, compiled=job.compile != "none"
        )
        rows = chunk_size(job.batch_tokens, job.max_length)  # the most a forward holds
        self.staging = Staging(job.staging_buffers, pinned=device.type == "cuda", rows=rows)
        start = time.perf_counter()
        one = torch.zeros(1, len(job.layer_ids), _hidden(capture), device=device)  # [N, K, H]
        if writes:
            self.staging.reserve(self.payload(one), tokens=1)
        log.info(
            "%d staging buffers of %.2f GB%s in %.1f s",
            job.staging_buffers,
            self.staging.nbytes / job.staging_buffers / 1e9,
            " (pinned)" if device.type == "cuda" else "",
            time.perf_counter() - start,
        )
        self.writers = WriterPool(threads)
        # Zarr shard files are written here once the writers compressed them (a webdataset
        # part is one tar, appended by the writer threads themselves).
        self.disk = DiskQueue() if job.format == "zarr" else None
        self.committer = ThreadPoolExecutor(1, thread_name_prefix="commit")
        self.commits: list[Future] = []
        # by unit, the parts submitted here and their commits (None: not queued yet); a failed
        # run removes those that did not reach the manifest
        self.submitted: dict[int, tuple[OpenPart, Future | None]] = {}
        self.commit_waited_s = 0.0  # the device's time waiting for parts to commit
        self.threads = threads
        self.started = time.perf_counter()
        self.forwards_end: float | None = None  # set by `mark_forwards_end`
        self.disk_backlog, self.disk_waited_then = 0, 0.0  # the disk queue's, then
        self.end: EndClocks | None = None  # set by a `close` after `mark_forwards_end`

    def open(self, unit: int, kept: list[Tokenized], rejected: list[Rejected]) -> OpenPart:
        """The unit's samples longest first and its part writer (a folder and zarr metadata on
        disk): safe on another thread than `submit`'s, so it runs on the reader thread."""
        job = self.job
        kept = [kept[i] for i in length_order([len(k.input_ids) for k in kept])]
        if not self.writes:
            return OpenPart(unit, kept, rejected, job.unit_rows(unit), None)
        writer = open_part_writer(
            job.out,
            unit,
            fmt=job.format,
            store=job.store,
            num_layers=len(job.layer_ids),
            hidden_size=_hidden(self.capture),
            lengths=[len(k.input_ids) for k in kept],
            io=self.disk,
        )
        return OpenPart(unit, kept, rejected, job.unit_rows(unit), writer)

    def submit(self, part: OpenPart, *, last: bool = False) -> None:
        """Run the part's forwards and queue its writes and commit; `last`: the rank's last
        part, whose last forwards the layout may make small (a short wait after them)."""
        job, kept, writer = self.job, part.kept, part.writer
        if writer is not None:
            self.submitted[part.unit] = (part, None)
        self._wait_for_commits(PARTS_AWAITING_COMMIT - 1)
        lengths = [len(k.input_ids) for k in kept]
        # One writer task per sample, or per piece of a long one where the format takes pieces:
        # a batch's samples compress in parallel, and a long one is not one thread's work (it
        # held the end of a run and each staging buffer's release behind one thread).
        pieces_too = getattr(writer, "takes_pieces", False)  # writer None: this rank writes nothing
        piece_rows = PIECE_ROWS if pieces_too else max(lengths, default=1)
        futures = []
        if self.clock is not None:
            self.clock.mark_part()
        batches = self.capture.layout.batches(lengths, batch_tokens=job.batch_tokens, last=last)
        for batch in batches:
            if self.before_forward is not None:
                self.before_forward()
            packed = self.capture.run([kept[i].input_ids for i in batch], device=self.device)
            if writer is None:
                continue  # its input group's writer stores these states
            host, release = self.staging.stage(packed, self.payload, tokens=packed.shape[0])
            pieces = [sample_pieces(lengths[n], piece_rows) for n in batch]
            countdown, start = Countdown(sum(map(len, pieces)), release), 0
            for n, sample in zip(batch, pieces, strict=True):
                for piece in sample:  # its rows in the staged batch, and in the sample
                    staged = slice(start + piece.start, start + piece.stop)
                    task = (writer, n, kept[n], host, staged, piece, countdown, self.staging)
                    futures.append(self.writers.submit(write_sample, *task))
                start += lengths[n]
            self.counters.add(  # done_rows: the bar moves per batch, not per part
                tokens=packed.shape[0], done_rows=len(batch)
            )
            self.writers.check()
        if writer is None:
            return
        commit = self.committer.submit(commit_part, part, job, futures, self.counters)
        self.submitted[part.unit] = (part, commit)
        self.commits.append(commit)

    def _wait_for_commits(self, most: int) -> None:
        """Block until at most `most` parts await their commit; re-raise a failed one (the
        next part's forwards never start after a failed commit; `close` raises the last's)."""
        pending = [f for f in self.commits if not f.done()]
        oldest = pending[: max(0, len(pending) - most)]
        if oldest:
            start = time.perf_counter()
            wait(oldest)
            self.commit_waited_s += time.perf_counter() - start
        for f in [f for f in self.commits if f.done()]:
            f.result()

    def close(self, *, failed: bool = False) -> None:
        """Wait for every queued write and commit; re-raise the first failure. Idempotent.
        `failed` (the caller's run failed), or a failure here: the parts not committed are
        removed (their .tmp folders would hold the disk, a full one too, until the next run)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            with contextlib.ExitStack() as shutdown:  # run last to first, each despite failures
                if self.disk is not None:
                    shutdown.callback(self.disk.close)
                shutdown.callback(self.committer.shutdown, wait=True)
                shutdown.callback(self.writers.close)
                if self.forwards_end is not None:
                    self.end = self._wait_for_the_end(self.forwards_end)
                for f in self.commits:
                    f.result()
        except BaseException:
            self._discard_uncommitted()
            raise
        if failed:
            self._discard_uncommitted()
        self._report_backpressure(time.perf_counter() - self.started)

    def _discard_uncommitted(self) -> None:
        """Remove the parts that never reached the manifest (every thread writing them is done:
        `close` waited for them)."""
        for part, commit in self.submitted.values():
            if commit is None or (commit.done() and commit.exception() is not None):
                discard(part)
            elif not commit.done():  # a wait cut short (Ctrl-C once more)
                log.warning("part of unit %d is still being committed: left as it is", part.unit)
        self.submitted.clear()

    def mark_forwards_end(self) -> None:
        """The last forward has ended (the device synchronized): `close` then measures what the
        time after it went to (`self.end`)."""
        self.forwards_end = time.perf_counter()
        if self.disk is not None:
            self.disk_backlog, self.disk_waited_then = self.disk.pending, self.disk.waited_s

    def _wait_for_the_end(self, since: float) -> EndClocks:
        """Wait for the writer threads, the disk queue and the commits in turn (failures are
        raised by `close` after), noting when each was over."""
        self.writers.wait_idle()
        writers = time.perf_counter() - since
        written = blocked = None
        if self.disk is not None:
            blocked = self.disk.waited_s - self.disk_waited_then
            self.disk.wait_idle()
            written = time.perf_counter() - since
        wait(self.commits)
        committed = time.perf_counter() - since
        return EndClocks(writers, written, committed, self.disk_backlog, blocked)

    def _report_backpressure(self, wall_s: float) -> None:
        waited, disk = self.staging.waited_s, self.disk
        log.info(
            "the device waited %.1f s of %.1f s for a free staging buffer and %.1f s for "
            "parts to commit (at most %d await it)",
            waited,
            wall_s,
            self.commit_waited_s,
            PARTS_AWAITING_COMMIT,
        )
        log.info(
            "writer threads: busy %.1f s of their %d x %.1f s, %.1f s of it on a core "
            "(compressing; the rest waiting for copies to land, room in the disk queue, the GIL "
            "or a free core)",
            self.writers.busy_s,
            self.threads,
            wall_s,
            self.writers.cpu_s,
        )
        if self.staging.pinned:
            side_s, longest = self.staging.side_stream_s()
            log.info(
                "side stream: the batches' payloads (%s) and copies to the host ended %.1f s "
                "after their forwards in all (the longest %.0f ms); the writer threads waited "
                "%.1f s of their time for the copies",
                self.job.store,
                side_s,
                longest * 1e3,
                self.staging.landing_waited_s,
            )
        if disk is not None:
            log.info(
                "disk: %.1f GB written by %d threads in %.1f s of their time (%.1f s on a core); "
                "the writer threads waited %.1f s for the queue, which held at most %.1f GB "
                "(%.1f allowed)",
                disk.written / 1e9,
                disk.threads,
                disk.busy_s,
                disk.cpu_s,
                disk.waited_s,
                disk.peak / 1e9,
                disk.budget / 1e9,
            )
        clocks = RankClocks(
            wall_s=wall_s,
            staging_waited_s=waited + self.commit_waited_s,  # both: waiting on the writes
            writer_threads=self.threads,
            out=str(self.job.out),
            tokens=self.counters.counts["tokens"],
            disk_waited_s=None if disk is None else disk.waited_s,
            store=self.job.store,
            written=0 if disk is None else disk.written,
        )
        warning = limit_warning(clocks)
        if warning is not None:
            log.warning("%s", warning)


def _hidden(capture: LayerCapture) -> int:
    cfg = capture.body.config
    return int(getattr(cfg, "hidden_size", None) or cfg.text_config.hidden_size)
