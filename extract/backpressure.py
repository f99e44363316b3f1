"""What held a rank back, from its clocks: one warning naming the slower side and what to do.

The device runs ahead of the host until every staging buffer is taken; a rank whose device
waited for one was limited by compression (the writer threads) or by the disk (the writer
threads waiting in their turn for the disk queue). A short run can also end long after its last
forward, writing what the disk queue still held: that time counts in the rate too.
"""

from __future__ import annotations

from dataclasses import dataclass

SIGNIFICANT = 0.1  # a share of the rank's time worth a warning


@dataclass(frozen=True)
class RankClocks:
    wall_s: float  # from the pipeline's start to its last commit
    forwards_s: float  # from the pipeline's start to the end of the last forward
    staging_waited_s: float  # the device waiting for a free staging buffer
    writer_threads: int
    out: str
    disk_waited_s: float | None = None  # writer threads waiting for the disk queue; None: none
    disk_written: int = 0  # bytes the disk queue wrote
    disk_backlog: int = 0  # bytes queued for the disk when the last forward ended


def limit_warning(c: RankClocks) -> str | None:
    """The warning for a rank held back by its writers or its disk, or None.

    >>> limit_warning(RankClocks(wall_s=10, forwards_s=10, staging_waited_s=0.2,
    ...                          writer_threads=8, out="shards"))
    """
    if c.wall_s <= 0:
        return None
    waited = c.staging_waited_s
    remedy = "--store fp8 (half the bytes) would let it run at its own speed."
    if waited > SIGNIFICANT * c.wall_s:
        if c.disk_waited_s is not None and c.disk_waited_s > 0.5 * waited:
            return (
                f"the disk limited this rank: the device waited {100 * waited / c.wall_s:.0f}% of "
                f"the time while the writer threads waited for the disk under {c.out}. A faster "
                f"disk for --out, or {remedy}"
            )
        return (
            f"compression and writing limited this rank: the device waited "
            f"{100 * waited / c.wall_s:.0f}% of the time for the {c.writer_threads} writer "
            f"threads. More cores per GPU (--writer-threads), or {remedy}"
        )
    tail = c.wall_s - c.forwards_s
    if tail > SIGNIFICANT * c.wall_s and c.disk_backlog > 0 and c.forwards_s > 0:
        made = c.disk_written / c.forwards_s
        return (
            f"the disk limited this rank's end: {c.disk_backlog / 1e9:.1f} GB were still queued "
            f"for {c.out} at the last forward, and the run ended {tail:.1f} s later "
            f"({100 * tail / c.wall_s:.0f}% of its time). The forwards made {made / 1e9:.2f} GB/s "
            f"of compressed states; the disk wrote {c.disk_written / c.wall_s / 1e9:.2f} GB/s over "
            f"the run. A longer run pays this once; a faster disk for --out, or {remedy}"
        )
    return None
