"""A rank's units through its part pipeline: read and tokenize on a thread, one unit ahead
(the first one while the target loads), submit in order, stop between parts on request."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from extract.commit import OpenPart, discard
from extract.data import Rejected, Tokenized, iter_rows
from extract.job import Job
from extract.pipeline import PartPipeline
from shared.stopping import StopRequest

# A unit's rows read and tokenized: those kept, and those rejected.
Reader = Callable[[int], tuple[list[Tokenized], list[Rejected]]]


def run_units(
    pipeline: PartPipeline,
    units: Sequence[int],
    *,
    read: Reader,
    after_part: Callable[[], None] | None = None,
    stop: StopRequest | None = None,
) -> int:
    """`units` through `pipeline`, in order; returns how many were submitted (fewer than all
    when `stop` was requested: the part read ahead is then discarded, never half-committed).
    Reading and tokenizing a unit's rows (`read`) and opening its part run on a reader
    thread, one unit ahead: on the thread that feeds the device they would leave the GPU idle
    at every part boundary."""

    def prepare(unit: int) -> OpenPart:
        return pipeline.open(unit, *read(unit))

    reader = ThreadPoolExecutor(1, thread_name_prefix="read")
    submitted = 0
    ahead: Future | None = None
    try:
        ahead = reader.submit(prepare, units[0]) if units else None
        for k in range(len(units)):
            part, ahead = ahead.result(), None
            if stop is not None and stop.requested:
                discard(part)
                break
            if k + 1 < len(units):
                ahead = reader.submit(prepare, units[k + 1])
            pipeline.submit(part, last=k + 1 == len(units))
            submitted += 1
            if after_part is not None:
                after_part()
    finally:
        reader.shutdown(wait=True, cancel_futures=True)
        # a failure left the part read ahead opened (its .tmp folder on disk) and never submitted
        if ahead is not None and ahead.done() and not ahead.cancelled():
            if ahead.exception() is None:
                discard(ahead.result())
    return submitted


def reader_reading_ahead(
    job: Job,
    tokenizer,
    units: Sequence[int],  # noqa: ANN001
) -> Reader:
    """`_read_unit` for this rank's `units`, the first one's rows already being read and
    tokenized on a thread while the target loads: the first forward would otherwise wait for
    them after the load, with the device idle (the timed run starts after the load)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="read-first")
    early: Future | None = pool.submit(_read_unit, job, tokenizer, units[0]) if units else None
    pool.shutdown(wait=False)

    def read(unit: int) -> tuple[list[Tokenized], list[Rejected]]:
        nonlocal early
        if early is not None and unit == units[0]:
            first, early = early, None
            return first.result()
        return _read_unit(job, tokenizer, unit)

    return read


def _read_unit(job: Job, tokenizer, unit: int) -> tuple[list[Tokenized], list[Rejected]]:  # noqa: ANN001
    """The unit's source rows, tokenized: (kept samples, rejected rows), in row order. The
    job's row index lets the reader seek near the unit's first row instead of reading every
    line before it (which made a whole run's reading quadratic in the dataset's rows)."""
    rows = job.unit_rows(unit)
    items = list(
        iter_rows(list(job.files), tokenizer, max_length=job.max_length, rows=rows, index=job.index)
    )
    kept = [x for x in items if isinstance(x, Tokenized)]
    return kept, [x for x in items if isinstance(x, Rejected)]
