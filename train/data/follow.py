"""A cache that an extraction is still writing, as training sees it.

The manifest is the only signal of a committed part: a run uses the manifest's committed prefix
(units 0, 1, 2, ... up to the first one not recorded, `Manifest.committed_prefix`) and opens
nothing else, neither a part being written (`part-N.tmp`) nor one renamed into place but not yet
recorded. A `CacheView` is that prefix with each part's sample lengths; `ManifestWatch` re-reads
the manifest when its file changes and grows the view. Whether the extraction still runs is read
from the lock it holds on the cache (`shared.lock`), for messages only.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.lock import holder_running, read_holder
from shared.manifest import CacheMismatch, Manifest, PartRecord, manifest_path, read_manifest
from shared.stopping import StopRun
from train.data.catalog import PartInfo, load_catalog

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a waiting run looks at the manifest file (one stat)


class CacheChanged(StopRun):
    """The cache a run follows changed in a way the run cannot continue on; the message says
    what changed and what to do."""


@dataclass(frozen=True)
class CacheView:
    """The parts a run may read: the manifest's committed prefix, in unit order."""

    records: tuple[PartRecord, ...]
    parts: tuple[PartInfo, ...]
    num_units: int
    total_rows: int  # source rows the extraction reads in all
    complete: bool  # every unit recorded: the view will not grow

    @property
    def lengths(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p.lengths for p in self.parts)

    @property
    def rows_read(self) -> int:
        """Source rows the view's parts cover (kept or rejected)."""
        return sum(r.rows_read for r in self.records)

    def describe(self) -> str:
        samples = sum(len(p.lengths) for p in self.parts)
        return f"{len(self.parts)} of {self.num_units} parts committed, {samples:,} samples"

    def record(self) -> list[list[Any]]:
        """The view as a checkpoint records it: each part's name, kept rows and tokens."""
        return [[r.name, r.rows_kept, r.tokens] for r in self.records]


def changed_parts(recorded: list[list[Any]], manifest: Manifest) -> list[str]:
    """The parts of a checkpoint's view that the manifest now records otherwise (other rows or
    tokens): the plan read them as they were, so the run cannot continue exactly."""
    now = {p.name: (p.rows_kept, p.tokens) for p in manifest.parts}
    return [
        f"{name}: {rows} rows and {tokens} tokens when the run read it, now {now[name][0]} "
        f"and {now[name][1]}"
        for name, rows, tokens in recorded
        if name in now and now[name] != (rows, tokens)
    ]


def read_view(cache: Path, manifest: Manifest, known: CacheView | None = None) -> CacheView:
    """The committed prefix of `manifest` with its parts' sample lengths, opening only parts
    `known` does not hold. A part of `known` that the manifest no longer records (dropped by
    `python -m extract.verify --repair`, or being redone by a resume) keeps the view at `known`
    until it is recorded again; one recorded with other counts raises CacheChanged."""
    prefix = manifest.committed_prefix()
    old = known.records if known is not None else ()
    problems = changed_parts([[r.name, r.rows_kept, r.tokens] for r in old], manifest)
    if problems:
        raise CacheChanged(_changed_message(cache, problems))
    if len(prefix) < len(old):
        return known
    parts, problems = load_catalog(cache, manifest, prefix[len(old) :])
    if problems:
        raise CacheMismatch(cache, problems)
    return CacheView(
        records=prefix,
        parts=(known.parts if known is not None else ()) + tuple(parts),
        num_units=manifest.num_units,
        total_rows=manifest.total_rows,
        complete=manifest.all_recorded and len(prefix) == len(manifest.parts),
    )


def _changed_message(cache: Path, problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return (
        f"{cache} changed under this run: parts it has read are recorded otherwise now:\n"
        f"{lines}\nThe run cannot continue exactly on it: start a new --out (or restore the cache)"
    )


class ManifestWatch:
    """The manifest of a cache being written, re-read whenever its file changes."""

    def __init__(self, cache: Path, identity: dict[str, Any]) -> None:
        self.cache, self.identity = Path(cache), identity
        self._stamp: tuple[int, int, int] | None = None

    def _current(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(manifest_path(self.cache))
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def read(self) -> Manifest | None:
        """The manifest if its file changed since the last read, else None."""
        stamp = self._current()
        if stamp is None or stamp == self._stamp:
            return None
        manifest = read_manifest(self.cache)
        if manifest.identity() != self.identity:
            raise CacheChanged(
                f"{self.cache} now holds another cache (its manifest names other settings than "
                "when this run started, e.g. after an extract --overwrite): start a new --out"
            )
        self._stamp = stamp
        return manifest

    def grow(self, view: CacheView) -> CacheView:
        """`view`, grown by what the manifest records now."""
        manifest = self.read()
        return view if manifest is None else read_view(self.cache, manifest, view)

    def wait(self, seconds: float) -> None:
        """Return once the manifest file changes, or after `seconds`."""
        end = time.monotonic() + seconds
        while self._current() == self._stamp and time.monotonic() < end:
            time.sleep(min(POLL_S, max(0.0, end - time.monotonic())))


def is_extraction(command: str) -> bool:
    """Whether a lock's command line is an extraction's (`python -m extract ...`), not another
    stage of the package holding the cache for a moment (`extract.verify --repair`).

    >>> is_extraction("python -m extract --out /c"), is_extraction("python -m extract.verify /c")
    (True, False)
    """
    words = command.split()
    return any(a == "-m" and b == "extract" for a, b in zip(words, words[1:], strict=False))


def extraction_state(cache: Path) -> str:
    """Whether an extraction runs on `cache`, in words, from the lock it holds there."""
    info = read_holder(cache)
    if not info or not is_extraction(str(info.get("command", ""))):
        return "no extraction is running on it"
    running = holder_running(info)
    who = f"pid {info.get('pid')} on {info.get('host')}"
    if running is None:
        return f"an extraction holds it from another host ({who}), which cannot be checked here"
    if not running:
        return f"its extraction ({who}) is no longer running"
    return f"an extraction is writing it ({who})"


def is_running(state: str) -> bool:
    return state.startswith("an extraction")
