"""One progress bar fed by every rank, through small per-rank counter files.

Each rank writes its running counters to `<folder>/rank-N.json` (atomically, from a
background thread, twice a second); whoever draws the bar (the launching parent, or rank 0
under torchrun) sums the files.
Files work across processes and nodes alike, with no extra collective in the hot loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
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
        # Called after each background write: the bar of a process that draws its own.
        self.listener: Callable[[], object] | None = None

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
            if self.listener is not None:
                self.listener()


def _version(path: Path) -> tuple[str, int, int]:
    """One written version of a counter file: a rank replaces its file whole (a new file,
    written later), so a version never comes back."""
    st = path.stat()
    return path.name, st.st_ino, st.st_mtime_ns


def counter_files(folder: Path) -> frozenset[tuple[str, int, int]]:
    """The versions of the counter files in `folder` now. Taken by a launcher before it starts
    its ranks, they are an earlier run's, which rank 0 deletes only once every rank holds the
    target (minutes on a big one): `read_counters(earlier=...)` leaves them out meanwhile."""
    versions = set()
    for path in Path(folder).glob("rank-*.json"):
        with contextlib.suppress(OSError):  # deleted meanwhile
            versions.add(_version(path))
    return frozenset(versions)


def read_counters(folder: Path, *, earlier: frozenset = frozenset()) -> Counter[str]:
    """The counters of every rank summed, leaving out the file versions in `earlier`
    (`counter_files` of an earlier run)."""
    total: Counter[str] = Counter()
    for path in Path(folder).glob("rank-*.json"):
        try:
            if _version(path) not in earlier:
                total.update(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a file being replaced right now: the next refresh reads it
    return total


# Without a terminal (a job's log file) one plain line this often replaces the bar's redraws.
LINE_EVERY_S = 30.0


def on_terminal() -> bool:
    return sys.stderr.isatty()


class LineProgress:
    """tqdm's interface as far as the stages use it (n, update, set_postfix, set_postfix_str,
    refresh, close), written as one log line every `every` seconds and at the end: a log file
    gets readable lines instead of carriage-return redraws."""

    def __init__(
        self,
        *,
        total: int,
        desc: str,
        unit: str = "it",
        initial: int = 0,
        disable: bool = False,
        every: float | None = None,
    ):
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.disable, self.postfix = disable, ""
        self.every = LINE_EVERY_S if every is None else every
        self.start = self.last = time.monotonic()
        self.initial = initial

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh(only_when_due=True)

    def set_postfix(self, refresh: bool = False, **values: object) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.postfix = text

    def refresh(self, only_when_due: bool = False) -> None:
        now = time.monotonic()
        if self.disable or (only_when_due and now - self.last < self.every):
            return
        self.last = now
        elapsed = now - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.n) / rate if rate > 0 else float("nan")
        pct = 100 * self.n / self.total if self.total else 100.0
        log.info(
            "%s: %d/%d %s (%.0f%%), %.1f s elapsed, %s left%s",
            self.desc,
            self.n,
            self.total,
            self.unit,
            pct,
            elapsed,
            f"{left:.0f} s" if left == left else "?",
            f", {self.postfix}" if self.postfix else "",
        )

    def close(self) -> None:
        self.refresh()
        self.disable = True


def progress_bar(
    *, total: int, desc: str, unit: str = "it", initial: int = 0, disable: bool = False
) -> tqdm | LineProgress:
    """A tqdm bar on a terminal, else a LineProgress."""
    if on_terminal():
        return tqdm(
            total=total, desc=desc, unit=unit, initial=initial, disable=disable, dynamic_ncols=True
        )
    return LineProgress(total=total, desc=desc, unit=unit, initial=initial, disable=disable)


# Seconds of forwards after the first tokens before the rate is taken for the time estimate.
RATE_AFTER_S = 10.0


class SummedBar:
    """A progress bar over `total` units of `unit_key`, with rates of the other counters.

    With `expected_tokens` (an estimate of the tokens to do), the time the whole run takes is
    logged once, at the rate measured over the first `RATE_AFTER_S` seconds after the first
    tokens (set-up and the target's loading left out). `earlier`: counter files of an earlier
    run, left out (`counter_files`)."""

    def __init__(
        self,
        folder: Path,
        *,
        total: int,
        unit_key: str,
        desc: str,
        disable: bool = False,
        expected_tokens: int = 0,
        earlier: frozenset = frozenset(),
    ):
        self.folder, self.unit_key, self.earlier = Path(folder), unit_key, earlier
        self.start = time.monotonic()
        self.bar = progress_bar(total=total, desc=desc, unit="rows", disable=disable)
        self._lock = threading.Lock()  # refreshed by the launcher's loop or a counters thread
        self.expected_tokens = expected_tokens
        self._first: tuple[float, float] | None = None  # (time, tokens) when tokens first came

    def _estimate_time(self, tokens: float) -> None:
        """Log once how long the run takes at the measured rate."""
        if not self.expected_tokens or tokens <= 0:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (now, tokens)
            return
        since, first_tokens = self._first
        if now - since < RATE_AFTER_S or tokens <= first_tokens:
            return
        rate = (tokens - first_tokens) / (now - since)
        left = max(self.expected_tokens - tokens, 0) / rate
        log.info(
            "time estimate: %s tok/s over the first %.0f s of forwards; about %s tokens left "
            "(of about %s estimated) take about %.0f s more",
            f"{rate:,.0f}",
            now - since,
            f"{max(self.expected_tokens - tokens, 0):,.0f}",
            f"{self.expected_tokens:,}",
            left,
        )
        self.expected_tokens = 0  # once

    def refresh(self) -> Counter[str]:
        with self._lock:
            counts = read_counters(self.folder, earlier=self.earlier)
            self.bar.n = int(counts.get(self.unit_key, 0))
            elapsed = max(time.monotonic() - self.start, 1e-6)
            self._estimate_time(counts.get("tokens", 0))
            raw, stored = counts.get("stored_raw_bytes", 0), counts.get("stored_bytes", 0)
            self.bar.set_postfix_str(
                f"{counts.get('tokens', 0) / elapsed:,.0f} tok/s, "
                f"{stored / elapsed / 1e6:,.1f} MB/s written, "
                f"{stored / raw if raw else 0:.3f} of raw bf16",
                refresh=False,
            )
            if isinstance(self.bar, LineProgress):
                self.bar.refresh(only_when_due=True)
            else:
                self.bar.refresh()
        return counts

    def close(self) -> Counter[str]:
        counts = self.refresh()
        self.bar.close()
        return counts
