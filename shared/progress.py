"""One progress bar fed by every rank, through small per-rank counter files.

Each rank writes its running counters to `<folder>/rank-N.json` (atomically, at most twice a
second); whoever draws the bar (the launching parent, or rank 0 under torchrun) sums the files.
Files work across processes and nodes alike, with no extra collective in the hot loop.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from shared.fsio import atomic_write_json


class RankCounters:
    """Counters of one rank, flushed to its file now and then."""

    def __init__(self, folder: Path, rank: int, *, every: float = 0.5):
        self.path = Path(folder) / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()
        self.every = every
        self._last = 0.0
        self._lock = threading.Lock()  # the commit thread adds too

    def add(self, **increments: float) -> None:
        with self._lock:
            self.counts.update(increments)
            due = time.monotonic() - self._last >= self.every
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            counts, self._last = dict(self.counts), time.monotonic()
            atomic_write_json(self.path, counts)


def read_counters(folder: Path) -> Counter[str]:
    total: Counter[str] = Counter()
    for path in Path(folder).glob("rank-*.json"):
        try:
            total.update(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a file being replaced right now: the next refresh reads it
    return total


class SummedBar:
    """A tqdm bar over `total` units of `unit_key`, with rates of the other counters."""

    def __init__(
        self, folder: Path, *, total: int, unit_key: str, desc: str, disable: bool = False
    ):
        self.folder, self.unit_key = Path(folder), unit_key
        self.start = time.monotonic()
        self.bar = tqdm(total=total, desc=desc, unit=unit_key, dynamic_ncols=True, disable=disable)

    def refresh(self) -> Counter[str]:
        counts = read_counters(self.folder)
        self.bar.n = int(counts.get(self.unit_key, 0))
        elapsed = max(time.monotonic() - self.start, 1e-6)
        raw, stored = counts.get("raw_bytes", 0), counts.get("stored_bytes", 0)
        self.bar.set_postfix_str(
            f"{counts.get('tokens', 0) / elapsed:,.0f} tok/s, "
            f"{stored / elapsed / 1e6:,.1f} MB/s written, "
            f"ratio {raw / stored if stored else 0:.2f}",
            refresh=False,
        )
        self.bar.refresh()
        return counts

    def close(self) -> Counter[str]:
        counts = self.refresh()
        self.bar.close()
        return counts
