"""The first pass of a run that trains while the extraction is still writing the cache.

Parts are taken in unit order (units 0, 1, 2, ...: the manifest's committed prefix, see
`Manifest.committed_prefix`), never in the order they happen to be committed, and grouped into
*windows*: runs of consecutive parts holding at least `--shuffle-buffer` training samples (the last
window: whatever remains once every unit is recorded). A window's samples are shuffled together,
seeded by the run's seed and the window's number, and packed into rows as an epoch's are
(`pack_rows`). A window is planned once all its parts are committed and never changes after, so
every row of the pass is a function of the finished cache and the run's settings alone: neither
the moment a part was committed nor an interruption of either stage changes a row, and a resumed
run reads exactly the rows it would have read.

The pass's length is known only once the cache is complete, so its rows cannot be cut into
contiguous slices as an epoch's are (`train.data.plan.worker_rows`): row i goes to rank
i % world_size, and a rank's rows go to its loader workers in turn (`interleaved_rows`). Every rank
gets the same number of rows; at the end of the pass fewer than world_size rows are dropped.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from train.data.plan import SampleRef, epoch_samples, evenly_spaced, mix_seed, pack_rows


class GrowingPlan:
    """The rows of the first pass, planned window by window as parts are committed.

    >>> plan = GrowingPlan(seed=0, row_tokens=10, clip=10, window=3)
    >>> plan.extend([[4, 4], [4]], complete=False), len(plan.windows)
    (2, 1)
    >>> plan.extend([[4, 4], [4], [5]], complete=False)  # one sample: the window stays open
    0
    >>> plan.extend([[4, 4], [4], [5]], complete=True), plan.windows
    (1, [range(0, 2), range(2, 3)])
    """

    def __init__(self, *, seed: int, row_tokens: int, clip: int, window: int) -> None:
        self.seed, self.row_tokens, self.clip = seed, row_tokens, clip
        self.window = max(window, 1)  # training samples a window holds at least
        self.rows: list[list[SampleRef]] = []
        self.windows: list[range] = []  # the parts of each planned window
        self.complete = False

    @property
    def planned_parts(self) -> int:
        return self.windows[-1].stop if self.windows else 0

    def extend(self, lengths: Sequence[Sequence[int]], *, complete: bool) -> int:
        """Plan the windows that `lengths` closes, and with `complete` (every unit recorded) the
        rest too; returns the number of rows added. `lengths[p]`: the training sample lengths of
        unit p (0: held out), for every committed unit of the prefix; it only ever grows."""
        if len(lengths) < self.planned_parts:
            raise ValueError(f"{len(lengths)} parts, {self.planned_parts} already planned")
        before, start, count = len(self.rows), self.planned_parts, 0
        for p in range(start, len(lengths)):
            count += sum(1 for n in lengths[p] if n > 0)
            if count >= self.window:
                self._plan(lengths, range(start, p + 1))
                start, count = p + 1, 0
        if complete and start < len(lengths):
            self._plan(lengths, range(start, len(lengths)))
        self.complete = complete
        return len(self.rows) - before

    def _plan(self, lengths: Sequence[Sequence[int]], parts: range) -> None:
        samples = list(epoch_samples(parts, lengths, clip=self.clip))
        if self.window > 1:
            random.Random(mix_seed(self.seed, len(self.windows), 0x6A0E)).shuffle(samples)
        self.rows.extend(pack_rows(samples, row_tokens=self.row_tokens))
        self.windows.append(parts)

    def rank_rows(self, *, world_size: int) -> int:
        """Rows each rank has in the pass so far (every rank the same number)."""
        return len(self.rows) // world_size

    def share(self, *, rank: int, world_size: int, start: int) -> GrowingRows:
        """What `rank`'s loader reads of the pass planned so far, from its `start`-th row on."""
        stop = self.rank_rows(world_size=world_size) * world_size
        numbers = range(rank + world_size * start, stop, world_size)
        return GrowingRows(rows={i: self.rows[i] for i in numbers}, planned=len(self.rows))


@dataclass(frozen=True)
class GrowingRows:
    """The rows of the first pass a rank's loader still reads, by row number, and how many rows
    the pass had when they were taken (what `interleaved_rows` deals out)."""

    rows: dict[int, list[SampleRef]]
    planned: int


def interleaved_rows(num_rows: int, *, rank: int, world_size: int, workers: int) -> list[range]:
    """The row numbers each of `rank`'s workers reads in the first pass: the rank has rows
    rank, rank + world_size, ... (num_rows // world_size of them, as every rank), and its worker
    l every workers-th of those from its l-th on, so that taking the workers in turn (what
    DataLoader does, see `rank_schedule`) gives the rank's rows in order.

    >>> interleaved_rows(7, rank=1, world_size=2, workers=2)
    [range(1, 7, 4), range(3, 7, 4)]
    """
    stop = rank + world_size * (num_rows // world_size)
    step = world_size * workers
    return [range(rank + world_size * w, stop, step) for w in range(workers)]


def held_out(first: int, count: int, fraction: float) -> list[bool]:
    """Whether each of samples first .. first + count - 1 (in unit order) is held out while
    following: the samples where ceil(i * fraction) steps up, so that of the first n samples
    ceil(n * fraction) are held out whatever n is: every 1/fraction-th from the first where
    that is whole. The fraction is taken as the decimal it was written as, so no rounding
    moves a step.

    >>> [i for i, h in enumerate(held_out(0, 10, 0.25)) if h]
    [0, 4, 8]
    >>> [i for i, h in enumerate(held_out(0, 10, 0.7)) if h]
    [0, 1, 2, 4, 5, 7, 8]
    >>> sum(held_out(0, 1000, 0.3)), sum(held_out(0, 1000, 0.0)), held_out(4, 3, 0.25)
    (300, 0, [True, False, False])
    """
    q = Fraction(repr(fraction))
    num, den = q.numerator, q.denominator
    steps = [-(-i * num // den) for i in range(first, first + count + 1)]  # ceil(i * q)
    return [b > a for a, b in itertools.pairwise(steps)]


def growing_holdout(
    lengths: Sequence[Sequence[int]], *, fraction: float, parts: int, num_units: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """(train, eval) length tables of a cache still being written, by rules that do not depend
    on its final size: with `parts` > 0 the parts of `parts` units evenly spaced over the
    `num_units` the extraction writes; otherwise `fraction` of the samples in unit order, spread
    evenly from the first (`held_out`). Held-out samples have length 0 in the train table, the
    others 0 in the eval table.

    >>> growing_holdout([[5, 6], [7, 8, 9]], fraction=0.5, parts=0, num_units=4)
    (((0, 6), (0, 8, 0)), ((5, 0), (7, 0, 9)))
    """
    if parts > 0:
        units = set(evenly_spaced(num_units, parts))
        held = [[p in units] * len(ls) for p, ls in enumerate(lengths)]
    else:
        first, held = 0, []
        for ls in lengths:
            held.append(held_out(first, len(ls), fraction))
            first += len(ls)
    train = tuple(
        tuple(0 if h else int(x) for x, h in zip(ls, hs, strict=True))
        for ls, hs in zip(lengths, held, strict=True)
    )
    evals = tuple(
        tuple(int(x) if h else 0 for x, h in zip(ls, hs, strict=True))
        for ls, hs in zip(lengths, held, strict=True)
    )
    return train, evals
