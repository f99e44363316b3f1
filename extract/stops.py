"""What a rank's stop by a signal tells the user: how far the rank had got, and so what --out
holds now (untouched, begun with no part, or the parts committed kept for a resume); and the
output prepared by rank 0 once every rank holds its target, unless a signal came first (as
`python -m extract.regen` prepares its own)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from shared.dist import broadcast_object
from shared.progress import RankCounters
from shared.stopping import Stopped, StopRun

T = TypeVar("T")

# How far a rank got, in order: loading its target; loaded (the others may still load);
# preparing --out (rank 0 clears the cache to replace and begins it anew, the others wait);
# prepared (compiling, probing: no part begun); extracting (a part in progress).
STAGES = ("loading", "loaded", "preparing", "prepared", "extracting")

WHILE_LOADING = "while the target loaded, before any part"
BEFORE_PREPARING = "after the target loaded, before --out was prepared"
_WHEN = {
    "loading": WHILE_LOADING,
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


def stopped_while_planning(out: Path, work: str, signal_name: str | None = None) -> str:
    """What a stop at once while the run was planned says: `work` ("extraction", say) not
    begun, nothing written to --out `out`; `signal_name` where it was not Ctrl-C (SIGTERM).

    >>> stopped_while_planning(Path("c"), "extraction")
    'stopped while planning, before extraction began: no part of c was written in this run'
    >>> stopped_while_planning(Path("c"), "extraction", "SIGTERM")[:36]
    'stopped by SIGTERM while planning, b'
    """
    how = f" by {signal_name}" if signal_name else ""
    return (
        f"stopped{how} while planning, before {work} began: no part of {out} was written in this "
        "run"
    )


def stopped_while_loading(out: Path, signal_name: str, *, replaces: bool, before: int) -> Stopped:
    """The stop of a signal that came while the target loaded (on any rank): no part extracted,
    --out as the run found it (or, for a new cache, begun with no part); `before`: the parts
    committed before this run."""
    kept = kept_text(out, touched=False, replaces=replaces, before=before, now=0)
    return Stopped(f"stopped by {signal_name} {WHILE_LOADING}: {kept}.")


def stopped_before_preparing(out: Path, signal_name: str) -> Stopped:
    """The stop of a signal that reached rank 0 after every rank loaded the target, before it
    prepared --out (cleared the cache to replace and began it anew): that cache untouched.

    >>> str(stopped_before_preparing(Path("c"), "SIGTERM"))[:72]
    'stopped by SIGTERM after the target loaded, before --out was prepared: t'
    """
    kept = kept_text(out, touched=False, replaces=True, before=0, now=0)
    return Stopped(f"stopped by {signal_name} {BEFORE_PREPARING}: {kept}.")


def prepared_unless_stopped(
    is_main: bool,
    prepare: Callable[[], T] | None,
    *,
    signal_name: str | None,
    stopped: Callable[[str], StopRun],
) -> T | None:
    """What rank 0 hands every rank once all hold their target (each rank calls this; the
    others wait in it): `prepare()` run by rank 0 alone, unless a stop signal reached it first
    (`signal_name`, None for none), then `stopped(signal_name)` raised on every rank with
    `prepare` not run, so that an output the run would replace stays. What `prepare` returns is
    returned on every rank, the StopRun it raises (why it could not prepare the output) raised
    on every rank. `prepare` None: nothing to prepare, None on every rank.

    >>> prepared_unless_stopped(True, lambda: "begun", signal_name=None, stopped=Stopped)
    'begun'
    """
    outcome = None
    if is_main and prepare is not None:
        if signal_name is not None:
            outcome = stopped(signal_name)
        else:
            try:
                outcome = prepare()
            except StopRun as e:
                outcome = e
    outcome = broadcast_object(outcome)
    if isinstance(outcome, StopRun):
        raise outcome
    return outcome


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
