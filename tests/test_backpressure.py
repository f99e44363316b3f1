"""extract.backpressure: which side held a rank back, and what its end went to."""

from __future__ import annotations

import doctest

import extract.backpressure
from extract.backpressure import EndClocks, RankClocks, describe_end, limit_warning


def clocks(**kw) -> RankClocks:
    return RankClocks(
        **{
            **dict(wall_s=100.0, staging_waited_s=0.0, writer_threads=8, out="shards", tokens=1000),
            **kw,
        }
    )


def test_a_rank_at_its_own_speed_gets_no_warning():
    assert limit_warning(clocks()) is None
    assert limit_warning(clocks(staging_waited_s=9.0, disk_waited_s=9.0)) is None  # under 10%
    assert limit_warning(clocks(wall_s=0.0)) is None


def test_a_rank_that_extracted_nothing_gets_no_warning():
    """Parts whose rows were all rejected: the device ran no forward, so its waits (for their
    commits) say nothing about compression or the disk."""
    assert limit_warning(clocks(staging_waited_s=53.0, tokens=0)) is None
    assert limit_warning(clocks(staging_waited_s=53.0)) is not None


def test_the_device_waiting_for_writers_that_wait_for_the_disk_names_the_disk():
    w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=20.0))
    assert w is not None and w.startswith("the disk limited this rank")
    assert "30%" in w and "shards" in w and "--store fp8" in w
    assert "GB/s" not in w  # no bytes counted: no rates
    # 35 GB in the 100 s: 0.35 GB/s taken; the forwards ran 70 s of them, making 0.50 GB/s.
    w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=20.0, written=35 * 10**9))
    assert "shards (it took 35.0 GB in 100 s, 0.35 GB/s; the forwards made 0.50 GB/s" in w


def test_the_device_waiting_for_busy_writers_names_compression():
    for disk_waited in (None, 1.0):  # no disk queue (webdataset), or one that kept up
        w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=disk_waited))
        assert w is not None and w.startswith("compression and writing limited this rank")
        assert "8 writer threads" in w and "--writer-threads" in w


def test_the_remedy_names_only_stores_smaller_than_the_rank_s():
    for store, named, not_named in (
        ("bf16", ("--store fp8", "--store int4"), ()),
        ("fp8", ("--store int4",), ("--store fp8",)),
        ("int4", (), ("--store fp8", "--store int4")),
    ):
        for disk_waited in (20.0, None):  # the disk's warning and the writers'
            w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=disk_waited, store=store))
            assert w is not None and w.endswith("would let it run at its own speed.")
            assert all(x in w for x in named) and not any(x in w for x in not_named)


def test_the_end_names_each_step_and_the_disk_queue_only_where_there_is_one():
    zarr = describe_end(EndClocks(0.5, 1.25, 2.0, disk_backlog=300_000_000, writers_blocked_s=0.2))
    assert "writer threads finished 0.50 s" in zarr and "(0.20 s of their time waiting" in zarr
    assert "(0.30 GB then) emptied 1.25 s" in zarr
    assert zarr.endswith("the last commit 2.00 s later")
    wds = describe_end(EndClocks(0.5, None, 2.0))
    assert "disk queue" not in wds and "writer threads finished 0.50 s" in wds


def test_doctests():
    result = doctest.testmod(extract.backpressure)
    assert result.failed == 0 and result.attempted > 0
