"""The journaled run of `python -m extract.regen` with a server or an in-process engine: rows
handed out in order, every finished conversation appended at once to its chunk's journal,
`OUT.parts/chunk-NNNNNN.journal` (a JSON line of the output row, or of the row's rejection), and
a chunk committed as the Hugging Face path commits it (`extract.regen.state.commit_chunk`) when
its rows are all there; its journal then goes. A rerun reads the journals and asks only for the
rows they lack: after a crash or `kill -9` only the conversations that were in flight are asked
again, and Ctrl-C (or SIGTERM) first lets those finish and records them (a second one stops at
once).

`Journal` keeps that record; the routes drive it (`extract.regen.served`: threads waiting on a
server; `extract.regen.engine`: one loop stepping vLLM) and hand it each conversation's outcome:
kept, rejected, or failed (counted by reason and left out: its chunk stays pending and the next
run asks for it again; a failure that stops the run ends the handing out of rows).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from extract.data import Rejected
from extract.regen.config import Chat, RegenConfig, RegenError, iter_chats
from extract.regen.job import Job, finish_output
from extract.regen.journal import OpenChunk, drop_committed
from extract.regen.report import RowBar
from extract.regen.state import (
    DISK_FULL_RERUN,
    PROGRESS_DIR,
    STATE,
    RegenState,
    commit_chunk,
    existing_state,
    init_output,
    parts_dir,
    update_state,
)
from extract.regen.turns import Conversation, Prompter
from shared.fsio import os_error_text
from shared.progress import RankCounters
from shared.space import full_disk_stops

log = logging.getLogger(__name__)


class RegenStopped(RegenError):
    """The run stopped before its end (server gone, requests refused, vLLM failing, a signal);
    resumable."""


@dataclass(frozen=True)
class Kept:
    row: dict[str, Any]
    turns: int
    at_limit: int
    new_tokens: int
    retokenized: int
    from_text: bool = False  # a server gave text only: ids are its tokenization


@dataclass(frozen=True)
class Failed:
    reason: str
    detail: str
    stops_run: bool  # the server is gone, refuses requests or is another model; vLLM aborted


Outcome = Kept | Rejected | Failed


def kept(conv: Conversation, prompter: Prompter, new_tokens: int, *, from_text: bool) -> Kept:
    """The outcome of a conversation whose turns are all generated."""
    retokenized = conv.retokenized(prompter)
    turns, at_limit = len(conv.generated), len(conv.at_limit)
    return Kept(conv.row(), turns, at_limit, new_tokens, retokenized, from_text)


def turn_seed(seed: int, row: int, turn: int) -> int:
    """A request's sampling seed, fixed by the run's seed, the source row and the turn: the
    same draw whatever the order or concurrency, and again after a resume."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class RunReport:
    """What one run did: failures by reason, and why it stopped early (None: it did not)."""

    failed: Counter = field(default_factory=Counter)
    stopped: str | None = None
    requested: int = 0  # conversations started
    from_text: int = 0  # conversations whose ids came from a server's text


class Journal:
    """The pending chunks of `job`, their journals, progress counters and bar; `stop` is set
    by a failure that stops the run or a first signal (no new conversation is started);
    `finishing`: how long the conversations in flight may take then, for the signal's message."""

    def __init__(self, job: Job, stop: threading.Event, *, finishing: str = ""):
        self.job, self.stop, self.finishing = job, stop, finishing
        self.chunks = {c: OpenChunk.load(job.parts, c, job.chunk_rows(c)) for c in job.chunks}
        self.report = RunReport()
        self.counters = RankCounters(job.parts / PROGRESS_DIR, 0)
        done = sum(len(c.entries) for c in self.chunks.values())
        if done:
            log.info("%d rows of unfinished chunks were done before: not requested again", done)
        self.bar = RowBar(self.counters.path.parent, total=job.pending_rows - done)
        self.last_draw = 0.0
        self.signals = 0

    def work(self) -> Iterator[tuple[int, Chat]]:
        """The rows to ask for, in order; rejected and complete ones recorded on the way."""
        for chunk, open_chunk in self.chunks.items():
            if open_chunk.complete:  # a crash between its last journal line and its commit
                self.commit(open_chunk)
                continue
            first = min(set(open_chunk.rows) - open_chunk.entries.keys())
            rows = range(first, open_chunk.rows.stop)
            for item in iter_chats(self.job.files, rows, self.job.index):
                if item.row in open_chunk.entries:
                    continue
                if isinstance(item, Rejected):
                    self.record(chunk, {"row": item.row, "rejected": asdict(item)})
                else:
                    yield chunk, item

    def record(self, chunk: int, entry: dict[str, Any]) -> None:
        open_chunk = self.chunks[chunk]
        open_chunk.add(entry)
        self.counters.add(rows=1, new_tokens=entry.get("new_tokens", 0))
        if open_chunk.complete:
            self.commit(open_chunk)
        self.draw()

    def draw(self) -> None:
        now = time.monotonic()
        if now - self.last_draw >= 0.5:
            self.last_draw = now
            self.bar.refresh()

    def commit(self, open_chunk: OpenChunk) -> None:
        open_chunk.close()
        commit_chunk(self.job.parts, open_chunk.chunk, open_chunk.rows, open_chunk.result())
        open_chunk.path.unlink(missing_ok=True)

    def handle(self, chunk: int, chat: Chat, outcome: Outcome) -> None:
        if isinstance(outcome, Kept):
            entry = {"row": chat.row, "kept": outcome.row, "turns": outcome.turns}
            entry.update(at_limit=outcome.at_limit, new_tokens=outcome.new_tokens)
            self.record(chunk, {**entry, "retokenized": outcome.retokenized})
            self.report.from_text += outcome.from_text
        elif isinstance(outcome, Rejected):
            self.record(chunk, {"row": chat.row, "rejected": asdict(outcome)})
        elif outcome.stops_run:
            if self.report.stopped is None:
                self.report.stopped = f"{outcome.reason}: {outcome.detail}"
                self.stop.set()
        else:
            self.report.failed[outcome.reason] += 1
            self.counters.add(failed=1)  # not recorded: the next run asks for it again
            log.warning("row %d failed (%s): %s", chat.row, outcome.reason, outcome.detail)
            self.draw()

    def on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        if self.signals > 1:
            raise KeyboardInterrupt
        self.stop.set()
        log.warning(
            "%s: finishing the conversations in flight%s; again to stop at once",
            signal.Signals(signum).name,
            f" ({self.finishing})" if self.finishing else "",
        )

    def close(self) -> RunReport:
        for open_chunk in self.chunks.values():
            open_chunk.close()
        self.counters.close()
        self.bar.close()
        if self.signals and self.report.stopped is None:
            self.report.stopped = "stopped by a signal"
        return self.report


def signals_to(journal: Journal) -> dict[int, Any]:
    """SIGINT and SIGTERM to `journal.on_signal` (main thread only); the old handlers, for
    `restore`."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, journal.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore(handlers: dict[int, Any]) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def prepare(
    cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job, *, where: str
) -> Job:
    """The output prepared or resumed (journals of committed chunks dropped): `job` with its
    pending chunks. A full disk raises DiskFull; any other file-system error (an old file that
    cannot be removed) RegenError naming the file, and saying what is left of an old output
    that was being removed then, as a stop at once while it was removed does (`_begun`)."""
    try:
        with full_disk_stops(job.parts, rerun=DISK_FULL_RERUN):
            resume = existing_state(cfg.out, settings, overwrite=cfg.overwrite)
            state = _begun(cfg.out, settings, config, resume)
            drop_committed(job.parts, state.chunks)
    except OSError as e:
        raise RegenError(os_error_text(e, job.parts)) from None
    job = dataclasses.replace(job, chunks=job.pending(state))
    log.info("%s: %d of %d chunks to do on %s", cfg.out, len(job.chunks), job.num_chunks, where)
    return job


def _begun(
    out: Path, settings: dict[str, Any], config: dict[str, Any], resume: RegenState | None
) -> RegenState:
    """`init_output`; a stop at once (KeyboardInterrupt: a second Ctrl-C, or the first where
    no handler waits for it) or a file that cannot be removed (any file-system error but a full
    disk) while it replaces an old output raised as RegenError saying that this output may be
    partly removed: its state file, replaced last, is still the old one, so the same command
    replaces what is left."""
    replaces = resume is None and (parts_dir(out) / STATE).is_file()
    try:
        return init_output(out, settings, config, resume)
    except KeyboardInterrupt:
        if not replaces:
            raise
        raise RegenError(
            f"stopped at once while the old output in --out {out} was removed, before any "
            "chunk: it may be partly removed; run the same command to replace what is left"
        ) from None
    except OSError as e:
        if not replaces or e.errno in (errno.ENOSPC, errno.EDQUOT):  # DiskFull says those
            raise
        raise RegenError(
            f"{os_error_text(e, parts_dir(out))}. The old output in --out {out} may be partly "
            "removed: once that file can be removed, the same command replaces what is left"
        ) from None


def to_do(cfg: RegenConfig, settings: dict[str, Any], job: Job) -> tuple[int, ...]:
    """The chunks that `prepare` will leave pending, read from the output as it is (nothing
    written): all of them where it starts afresh (no output yet, or one --overwrite replaces).
    Raises where --out holds something this run may not resume or replace."""
    resume = existing_state(cfg.out, settings, overwrite=cfg.overwrite)
    return tuple(range(job.num_chunks)) if resume is None else job.pending(resume)


def conclude(out: Path, job: Job, report: RunReport, source: str, hint: str = "") -> RegenState:
    """The run's failures recorded, then the output merged, or `RegenStopped` saying what is
    kept and how to resume (`hint`: what to do first)."""
    log.info("%s: %d conversations asked for in this run", source, report.requested)
    failed = dict(report.failed)
    state = update_state(job.parts, lambda s: dataclasses.replace(s, failed=failed))
    if report.stopped is not None:
        left = job.pending(state)
        rows = sum(len(job.chunk_rows(c)) for c in left)
        raise RegenStopped(
            f"{source}: the run stopped ({report.stopped}). The finished conversations are "
            f"kept in {job.parts} ({len(left)} chunks, {rows} rows, not complete); "
            f"{hint}run the same command to resume."
        )
    return finish_output(out, job, regenerated=True)
