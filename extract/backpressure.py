"""What held a rank back, from its clocks: one warning naming the slower side and what to do,
and what the time after the last forward went to.

The device runs ahead of the host until every staging buffer is taken; a rank whose device
waited for one was limited by compression (the writer threads) or by the disk (the writer
threads waiting in their turn for the disk queue). After the last forward a rank still
compresses the batches it staged, writes what the disk queue holds and commits its last part
(a durable sync of the file system, a checksum, a rename); on a short run that end is a large
share of the rate, so its log gives each step.
"""

from __future__ import annotations

from dataclasses import dataclass

SIGNIFICANT = 0.1  # a share of the rank's time worth a warning


@dataclass(frozen=True)
class RankClocks:
    wall_s: float  # from the pipeline's start to its last commit
    staging_waited_s: float  # the device waiting for a free staging buffer
    writer_threads: int
    out: str
    tokens: int  # the tokens the rank's forwards ran: none, and no wait was for its writes
    disk_waited_s: float | None = None  # writer threads waiting for the disk queue; None: none
    store: str = "bf16"  # what the rank stores: the remedy names only smaller stores
    written: int = 0  # bytes the disk queue wrote (0: not counted, webdataset)


def limit_warning(c: RankClocks) -> str | None:
    """The warning for a rank held back by its writers or its disk, or None.

    >>> clocks = RankClocks(wall_s=10, staging_waited_s=0.2, writer_threads=8, out="x", tokens=9)
    >>> limit_warning(clocks) is None
    True
    """
    waited = c.staging_waited_s
    if c.tokens == 0 or c.wall_s <= 0 or waited <= SIGNIFICANT * c.wall_s:
        return None
    share = f"{100 * waited / c.wall_s:.0f}%"
    if c.disk_waited_s is not None and c.disk_waited_s > 0.5 * waited:
        return (
            f"the disk limited this rank: the device waited {share} of the time while the "
            f"writer threads waited for the disk under {c.out}{disk_rates(c)}. A faster disk for "
            f"--out{smaller_stores(c.store)} would let it run at its own speed."
        )
    return (
        f"compression and writing limited this rank: the device waited {share} of the time "
        f"for the {c.writer_threads} writer threads. More cores per GPU (--writer-threads)"
        f"{smaller_stores(c.store)} would let it run at its own speed."
    )


def disk_rates(c: RankClocks) -> str:
    """What the disk took against what the forwards made, for the disk's warning: the bytes
    over the rank's time, and over its time less the device's waits (a floor of what a disk
    must take for the forwards to run unhindered).

    >>> disk_rates(RankClocks(50, 20, 8, "x", tokens=9, written=30_000_000_000))
    ' (it took 30.0 GB in 50 s, 0.60 GB/s; the forwards made 1.00 GB/s without their waits)'
    """
    if c.written <= 0 or c.wall_s <= c.staging_waited_s:
        return ""
    took, made = c.written / c.wall_s, c.written / (c.wall_s - c.staging_waited_s)
    return (
        f" (it took {c.written / 1e9:.1f} GB in {c.wall_s:.0f} s, {took / 1e9:.2f} GB/s; "
        f"the forwards made {made / 1e9:.2f} GB/s without their waits)"
    )


def smaller_stores(store: str) -> str:
    """The remedy's words for the stores that write fewer bytes than `store`.

    >>> smaller_stores("fp8"), smaller_stores("int4")
    (', or --store int4 (half the bytes of fp8; its error is in the README)', '')
    """
    if store == "bf16":
        return (
            ", or --store fp8 (half the bytes) or --store int4 (a quarter; its error is in the "
            "README)"
        )
    if store == "fp8":
        return ", or --store int4 (half the bytes of fp8; its error is in the README)"
    return ""


@dataclass(frozen=True)
class EndClocks:
    """Seconds after the last forward at which each step of the rank's end was over."""

    writers_s: float  # the writer threads' last task (compression; wds parts: the tar writes too)
    written_s: float | None  # the disk queue empty (None: no disk queue, webdataset)
    committed_s: float  # the last part committed
    disk_backlog: int = 0  # bytes queued for the disk when the last forward ended
    writers_blocked_s: float | None = None  # the writer threads' wait for the disk queue since


def describe_end(e: EndClocks) -> str:
    """One log line: what the time after the last forward went to.

    >>> print(describe_end(EndClocks(0.8, 2.5, 3.9, 2_100_000_000, 0.3)))
    ... # doctest: +NORMALIZE_WHITESPACE
    after the last forward: the writer threads finished 0.80 s later (0.30 s of their time
    waiting for the disk queue), the disk queue (2.10 GB then) emptied 2.50 s later, the last
    commit 3.90 s later
    """
    blocked = ""
    if e.writers_blocked_s is not None:
        blocked = f" ({e.writers_blocked_s:.2f} s of their time waiting for the disk queue)"
    disk = ""
    if e.written_s is not None:
        backlog = f"{e.disk_backlog / 1e9:.2f} GB then"
        disk = f", the disk queue ({backlog}) emptied {e.written_s:.2f} s later"
    return (
        f"after the last forward: the writer threads finished {e.writers_s:.2f} s later"
        f"{blocked}{disk}, the last commit {e.committed_s:.2f} s later"
    )
