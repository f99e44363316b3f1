"""One progress bar fed by every rank, through small per-rank counter files.

Each rank writes its running counters to `<folder>/rank-N.json` (atomically, from a
background thread, twice a second); whoever draws the bar (the launching parent, or rank 0
under torchrun) sums the files.
Files work across processes and nodes alike, with no extra collective in the hot loop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from shared.fsio import replace_file_bytes

log = logging.getLogger(__name__)


class RankCounters:
    """Counters of one rank, written to its file by a background thread every `every` seconds.

    `add` only updates memory, so the caller (the loop that feeds the device) never waits for
    the file system; the file is replaced atomically but not fsynced (see
    `shared.fsio.replace_file_bytes`). `close` stops the thread and writes the final counts.
    """

    def __init__(self, folder: Path, rank: int, *, every: float = 0.5):
        self.path = Path(folder) / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.counts: Counter[str] = Counter()
        self.every = every
        self._lock = threading.Lock()  # guards counts: the commit thread adds too
        self._write_lock = threading.Lock()  # one file write at a time, newest counts last
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._written: dict[str, float] | None = None

    def add(self, **increments: float) -> None:
        with self._lock:
            self.counts.update(increments)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name=f"counters-{self.path.stem}", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        """Write the counts now (from any thread); skipped when unchanged since the last write.
        The counts are copied under their lock and written outside it, so `add` never waits for
        the file system."""
        with self._write_lock:
            with self._lock:
                counts = dict(self.counts)
            if counts == self._written:
                return
            replace_file_bytes(self.path, (json.dumps(counts) + "\n").encode())
            self._written = counts

    def close(self) -> None:
        """Stop the background writer and write the final counts."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.flush()
        except OSError as e:  # advisory, as in _run: a full disk is reported by the writers
            log.debug("progress counters not written: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.flush()
            except OSError as e:  # progress is advisory: a full disk shows up in the writers
                log.debug("progress counters not written: %s", e)


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
