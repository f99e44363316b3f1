"""extract.backpressure: which side held a rank back, from its clocks."""

from __future__ import annotations

from extract.backpressure import RankClocks, limit_warning


def clocks(**kw) -> RankClocks:
    base = dict(wall_s=100.0, forwards_s=99.0, staging_waited_s=0.0, writer_threads=8, out="shards")
    return RankClocks(**{**base, **kw})


def test_a_rank_at_its_own_speed_gets_no_warning():
    assert limit_warning(clocks()) is None
    assert limit_warning(clocks(staging_waited_s=9.0, disk_waited_s=9.0)) is None  # under 10%
    assert limit_warning(clocks(wall_s=0.0, forwards_s=0.0)) is None


def test_the_device_waiting_for_writers_that_wait_for_the_disk_names_the_disk():
    w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=20.0))
    assert w is not None and w.startswith("the disk limited this rank")
    assert "30%" in w and "shards" in w and "--store fp8" in w


def test_the_device_waiting_for_busy_writers_names_compression():
    for disk_waited in (None, 1.0):  # no disk queue (webdataset), or one that kept up
        w = limit_warning(clocks(staging_waited_s=30.0, disk_waited_s=disk_waited))
        assert w is not None and w.startswith("compression and writing limited this rank")
        assert "8 writer threads" in w and "--writer-threads" in w


def test_a_long_end_writing_the_disk_queue_names_the_disk_and_its_rates():
    """The 27B slice's run: 8.5 GB, forwards over at 7.35 s of 11.22 s, 2 GB still queued."""
    w = limit_warning(
        clocks(
            wall_s=11.22,
            forwards_s=7.35,
            disk_waited_s=0.0,
            disk_written=int(8.5e9),
            disk_backlog=int(2.0e9),
        )
    )
    assert w is not None and w.startswith("the disk limited this rank's end")
    assert "2.0 GB" in w and "3.9 s later" in w and "34%" in w
    assert "1.16 GB/s" in w and "0.76 GB/s" in w  # made over the forwards, written over the run


def test_a_long_end_with_nothing_queued_for_the_disk_is_not_blamed_on_it():
    assert limit_warning(clocks(forwards_s=50.0, disk_waited_s=0.0, disk_backlog=0)) is None
    short_tail = clocks(forwards_s=95.0, disk_waited_s=0.0, disk_written=10, disk_backlog=5)
    assert limit_warning(short_tail) is None


def test_doctests():
    import doctest

    import extract.backpressure

    assert doctest.testmod(extract.backpressure).failed == 0
