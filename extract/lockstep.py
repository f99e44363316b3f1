"""Forwards in lock-step across the ranks of a sharded target.

Under tensor, fully sharded or expert parallel layouts every forward runs collectives over
ranks that hold other parts of the model, so every rank must run the same number of forwards,
whatever its share of the work. Before each forward the ranks exchange two flags on a CPU
(gloo) group, which never waits for a device: whether each still has a real batch, and whether
any was asked to stop. A rank out of work then runs dummy forwards of one token until no rank
has work left (`drain`): a padded batch of one token, or under packed rows a row of the
smallest size (a quarter of the packed row: the compiled graphs have no other shapes). A stop
signal is acted on only once every rank knows of it, so the ranks of an input group (which run
the same batches) stop at the same part boundary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from shared.stopping import StopRequest


class LockStep:
    """The per-forward agreement of a sharded run; passed to `run_units` as its stop request
    (`requested` is the agreed stop, not this rank's own signal)."""

    def __init__(self, group: object, stop: StopRequest):
        self.group, self.local = group, stop
        self.agreed = False
        self.forwards = self.dummies = 0

    @property
    def requested(self) -> bool:
        return self.agreed

    @property
    def signal_name(self) -> str:
        return self.local.signal_name or "a stop signal on another rank"

    def _step(self, working: bool) -> bool:
        """Exchange the flags (every rank, once per forward); True while any rank has work."""
        flags = torch.tensor([int(working), int(self.local.requested)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        self.agreed = self.agreed or bool(flags[1])
        return bool(flags[0])

    def before_forward(self) -> None:
        """Called before each real forward."""
        self._step(True)
        self.forwards += 1

    def drain(self, dummy: Callable[[], None]) -> int:
        """Run `dummy` forwards until no rank has work left; returns how many ran here."""
        while self._step(False):
            dummy()
            self.dummies += 1
        return self.dummies


def cpu_group() -> object:
    """A gloo group over all ranks for the flags (the default group where it is gloo already);
    every rank must call this, in the same order as its other group creations."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def agree_max(values: list[float], group: object) -> list[float]:
    """The largest of each of `values` over the ranks of `group` (every rank calls it)."""
    largest = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return largest.tolist()
