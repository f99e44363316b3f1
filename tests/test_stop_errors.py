"""A rank's StopRun travels to the launching process by name (`shared.stopping.error_kind`) and
is raised there as the same class, even where two classes share a name in two modules."""

from __future__ import annotations

import queue

from shared.dist import _queued
from shared.space import DiskFull
from shared.stopping import Stopped, StopRun, error_kind, stop_error


class Twin(StopRun):
    """One of two StopRun subclasses named Twin."""


ElsewhereTwin = type("Twin", (StopRun,), {"__module__": "tests.elsewhere"})


def test_a_ranks_error_comes_back_as_its_own_class_though_another_shares_its_name():
    for cls in (Twin, ElsewhereTwin, DiskFull, Stopped):
        error = stop_error(error_kind(cls("the message")), "the message")
        assert type(error) is cls and str(error) == "the message"


def test_the_launcher_raises_a_failure_before_a_signals_stop_whatever_the_ranks_order():
    q = queue.SimpleQueue()
    q.put((0, error_kind(Stopped("stopped")), "stopped"))
    q.put((1, error_kind(DiskFull("full")), "full"))
    error = _queued(q)
    assert type(error) is DiskFull and str(error) == "full"
