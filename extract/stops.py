"""What a rank's stop by a signal tells the user: how far the rank had got, and so what --out
holds now (untouched, begun with no part, or the parts committed kept for a resume)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.progress import RankCounters
from shared.stopping import Stopped

# How far a rank got, in order: loading its target; loaded (the others may still load);
# preparing --out (rank 0 clears the cache to replace and begins it anew, the others wait);
# prepared (compiling, probing: no part begun); extracting (a part in progress).
STAGES = ("loading", "loaded", "preparing", "prepared", "extracting")

_WHEN = {
    "loading": "while the target loaded, before any part",
    "loaded": "after the target loaded, before any part",
    "preparing": "while --out was prepared, before any part",
    "prepared": "after the target loaded, before any part",
    "extracting": "while extracting, no part left half-written",
}


@dataclass
class Reached:
    """How far this rank got (`STAGES`), and its counters once it has them: the parts it
    committed in this run."""

    stage: str = "loading"
    counters: RankCounters | None = None

    @property
    def committed(self) -> int:
        return int(self.counters.counts["parts"]) if self.counters is not None else 0


def kept_text(out: Path, *, touched: bool, replaces: bool, before: int, now: int) -> str:
    """What --out `out` holds after a stop, then what rerunning the same command does: the
    cache to replace not `touched` yet, or the parts committed `before` this run and `now`.

    >>> kept_text(Path("c"), touched=False, replaces=True, before=0, now=0)
    'the cache in --out c was not touched; rerun the same command to start it'
    >>> kept_text(Path("c"), touched=True, replaces=False, before=2, now=1)[:60]
    'the parts committed before (2) and in this run (1) are kept '
    """
    if replaces and not touched:
        kept, then = f"the cache in --out {out} was not touched", "start it"
    elif before and now:
        kept, then = f"the parts committed before ({before}) and in this run ({now})", "resume"
    elif before:
        kept, then = f"the parts committed before ({before})", "resume"
    elif now:
        kept, then = f"the parts committed in this run ({now})", "resume"
    else:
        kept, then = f"no part was written to {out}", "start it"
    if then == "resume":
        kept += f" are kept in {out}"
    return f"{kept}; rerun the same command to {then}"


def load_stop(out: Path, how: str, *, replaces: bool, before: int) -> Stopped:
    """The stop of a signal (`how`: which) that came while the target loaded, or since, before
    --out was prepared: no part extracted, --out as the run found it (or, for a new cache,
    begun with no part); `before`: the parts committed before this run."""
    kept = kept_text(out, touched=False, replaces=replaces, before=before, now=0)
    return Stopped(f"stopped {how} while the target loaded, before any part: {kept}.")


def stopped_at_once(out: Path, stage: str, *, replaces: bool, before: int, now: int) -> Stopped:
    """The stop of a second signal in a process started by hand (KeyboardInterrupt, raised
    wherever the rank was): `stage` says how far it had got (`STAGES`), `replaces` whether its
    run replaces the cache in `out` (cleared in the stage "preparing"), `before` and `now`
    the parts committed before this run and in it.

    >>> str(stopped_at_once(Path("c"), "prepared", replaces=True, before=0, now=0))[-78:]
    'before any part: no part was written to c; rerun the same command to start it.'
    """
    if replaces and stage == "preparing":
        kept = f"the cache in --out {out} may be partly removed; rerun the same command to start it"
    else:
        touched = STAGES.index(stage) >= STAGES.index("preparing")
        kept = kept_text(out, touched=touched, replaces=replaces, before=before, now=now)
    return Stopped(f"stopped at once by a second signal {_WHEN[stage]}: {kept}.")
