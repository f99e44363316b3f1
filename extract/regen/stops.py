"""What a stop of `python -m extract.regen` tells the user where it comes before the run's own
handling of it: that it came while the run was planned, nothing written
(`stop_while_planning`); or when it came (`stopped_before_any_chunk`), then what the output
holds and how to go on (`stops_said`). The local route's ranks load the target, then rank 0
prepares --out; `--engine vllm` starts vLLM, then prepares --out, then reads the tokenizer;
`--server` contacts the server, then prepares --out, then reads the tokenizer. An output whose
chunks are all done is resumed on every route without any of that (`resumed_complete`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from extract.regen.config import RegenConfig
from extract.regen.driver import RegenStopped, prepare
from extract.regen.job import Job, finish_output
from extract.regen.state import RegenState, StateError, read_state, settings_mismatches
from extract.stops import stopped_while_planning
from shared.stopping import Stopped, Terminated, sigterm_raises

# When a stop came, in words (`stopped_before_any_chunk`).
WHILE_LOADING = "while the target loaded, before any chunk"
BEFORE_PREPARING = "after the target loaded, before --out was prepared"
WHILE_VLLM_LOADS = "while vLLM loaded the target, before any chunk"
WHILE_PREPARING = "while --out was prepared, before any chunk"
AFTER_PREPARING = "after --out was prepared, before any chunk"
WHILE_CONTACTING = "while the server was first contacted, before any chunk"
WHILE_FINISHING = "while the complete output was resumed"


def stopped_before_any_chunk(how: str, when: str) -> Stopped:
    """The stop of a signal (`how`: "by SIGTERM", "at once by ...") that came `when` (one of
    the phrases above), no chunk begun: its first words, to which `stops_said` adds what the
    output holds.

    >>> print(stopped_before_any_chunk("by SIGTERM", BEFORE_PREPARING))
    stopped by SIGTERM after the target loaded, before --out was prepared
    """
    return Stopped(f"stopped {how} {when}")


@contextlib.contextmanager
def stop_while_planning(out: Path) -> Iterator[None]:
    """Ctrl-C or SIGTERM in the block, where the run is planned (nothing written yet; no
    handler of the run's own waits for either), as RegenStopped saying so, as `python -m
    extract` says it."""
    try:
        with sigterm_raises():
            yield
    except KeyboardInterrupt:
        raise RegenStopped(stopped_while_planning(out, "regeneration")) from None
    except Terminated:
        raise RegenStopped(stopped_while_planning(out, "regeneration", "SIGTERM")) from None


@contextlib.contextmanager
def signals_stop(when: str) -> Iterator[None]:
    """Ctrl-C or SIGTERM in the block (no handler of the run's own waits for either: SIGINT
    raises KeyboardInterrupt, and SIGTERM, a job scheduler's, would end the process without a
    word) stops the run at once, as the Stopped saying which came `when`. SIGTERM is made to
    raise KeyboardInterrupt in the block (main thread only), so that it ends what runs there
    as Ctrl-C does."""
    came: list[str] = []

    def on_sigterm(_signum: int, _frame: object) -> None:
        came.append("SIGTERM")
        raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        yield
    except KeyboardInterrupt:
        name = came[0] if came else "SIGINT"
        raise stopped_before_any_chunk(f"at once by {name}", when) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stops_said(
    job: Job,
    settings: dict[str, Any],
    *,
    unknown: Collection[str] = (),
    at_once: str = "stopped at once by SIGINT",
) -> Iterator[None]:
    """A stop in the block as RegenStopped saying what the run kept and how to resume it, or
    that it stopped before it prepared the output (its state is not this run's), or that every
    chunk is committed. The stop: a Stopped (its message says when), or Ctrl-C or SIGTERM that
    no handler of the run's own took (SIGTERM raises in the block, `sigterm_raises`), said as
    `at_once` and "stopped at once by SIGTERM". `unknown`: keys of `settings` not known yet (a
    server's), left out where the output's settings are compared with them."""
    try:
        with sigterm_raises():
            yield
    except (Stopped, KeyboardInterrupt, Terminated) as e:
        if isinstance(e, Stopped):
            why = str(e)
        else:
            why = "stopped at once by SIGTERM" if isinstance(e, Terminated) else at_once
        try:
            state = read_state(job.parts)
        except StateError:
            state = None
        if state is None or settings_mismatches(state.settings, settings, unknown):
            raise RegenStopped(
                f"{why}. The output was not touched: run the same command to start it."
            ) from None
        left = job.pending(state)
        if not left:
            raise RegenStopped(
                f"{why}. Every chunk is committed in {job.parts}: run the same command to finish "
                "the output."
            ) from None
        rows = sum(len(job.chunk_rows(c)) for c in left)
        raise RegenStopped(
            f"{why}. The committed chunks are kept in {job.parts}; {len(left)} chunks ({rows:,} "
            "rows) are still to do: run the same command to resume."
        ) from None


def resumed_complete(
    cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job, *, where: str
) -> RegenState:
    """An output whose chunks are all done, resumed (nothing to generate): its state updated,
    then OUT merged where it is not their merge already. Ctrl-C or SIGTERM there stops it at
    once, saying that every chunk is kept."""
    with stops_said(job, settings), signals_stop(WHILE_FINISHING):
        job = prepare(cfg, settings, config, job, where=where)
        return finish_output(cfg.out, job, regenerated=False)
