"""A part's end: its commit once its writes are done (the record in the manifest, the log line,
the counters), or its removal when it will not be committed."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from extract.data import Rejected, Tokenized
from extract.job import Job
from shared.cache import part_name
from shared.codec import codec_description
from shared.diskqueue import drain
from shared.manifest import (
    MAX_LISTED_REJECTS,
    PartRecord,
    RejectedRow,
    update_manifest,
)
from shared.progress import RankCounters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenPart:
    """A unit ready for the device: its kept samples longest first, its rejected rows, its source
    rows and its part writer."""

    unit: int
    kept: list[Tokenized]
    rejected: list[Rejected]
    rows: range
    writer: object


_STEP_NAMES = {
    "samples": "the samples' writers",
    "writes": "the last file writes",
    "sync": "finishing and syncing",
    "checksum": "the checksum",
    "rename": "the rename",
    "manifest": "the manifest",
}


def commit_steps(seconds: dict[str, float]) -> str:
    """Where a part's commit spent its time, the longest step first (steps under 5 ms left out).

    >>> print(commit_steps({"samples": 0.2, "sync": 3.81, "rename": 0.001}))
    its commit took 4.01 s (finishing and syncing 3.81 s, the samples' writers 0.20 s)
    """
    steps = sorted(seconds.items(), key=lambda kv: -kv[1])
    said = [f"{_STEP_NAMES.get(k, k)} {v:.2f} s" for k, v in steps if v >= 0.005]
    took = f"its commit took {sum(seconds.values()):.2f} s"
    return took + (f" ({', '.join(said)})" if said else "")


def commit_part(part: OpenPart, job: Job, futures: list[Future], counters: RankCounters) -> None:
    unit, writer, kept, rejected, rows = part.unit, part.writer, part.kept, part.rejected, part.rows
    start = time.perf_counter()
    drain(futures)  # a failed write is raised: the part is not committed
    samples_s = time.perf_counter() - start
    stats = writer.commit()
    reasons: dict[str, int] = {}
    for r in rejected:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    record = PartRecord.committed(
        stats,
        name=part_name(unit, job.format),
        unit=unit,
        rows=rows,
        layout=job.layout_record,
        rows_truncated=sum(k.truncated for k in kept),
        rejected=reasons,
        rejected_rows=tuple(RejectedRow.of(r) for r in rejected[:MAX_LISTED_REJECTS]),
    )
    codec = codec_description(job.store)
    start = time.perf_counter()
    update_manifest(job.out, lambda m: m.with_part(record.with_codec(codec, m.codec)))
    steps = {"samples": samples_s, **writer.commit_seconds}
    steps["manifest"] = time.perf_counter() - start
    log.info(
        "committed %s: %d rows kept, %d rejected, %d tokens, %.1f MB; %s",
        record.name,
        record.rows_kept,
        len(rejected),
        record.tokens,
        record.nbytes / 1e6,
        commit_steps(steps),
    )
    counters.add(
        rows=len(rows),
        done_rows=len(rejected),  # the kept ones were counted per forward batch
        parts=1,
        stored_bytes=stats.nbytes,
        # bf16 bytes of the same tokens: the bar's ratio compares committed parts only (raw
        # bytes counted per batch against bytes stored per part showed 2.5 for a 1.45 cache)
        stored_raw_bytes=stats.tokens * writer.num_layers * writer.hidden_size * 2,
        kept=len(kept),
        rejected=len(rejected),
    )
    counters.flush()


def discard(part: OpenPart) -> None:
    """Remove a part that will not be committed; a failure to is logged, never raised (it would
    hide the error that stopped the run)."""
    if part.writer is None:
        return
    try:
        part.writer.abort()
    except Exception as e:  # noqa: BLE001
        log.warning("part of unit %d could not be removed: %s", part.unit, e)
