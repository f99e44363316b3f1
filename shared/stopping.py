"""Graceful stops (SIGTERM, SIGINT) and child processes that never outlive their parent.

A job scheduler sends SIGTERM before it kills a job; Ctrl-C sends SIGINT to every process of
the terminal's foreground group. Either one only sets a flag (`StopRequest`): the stage acts on
it where its state is consistent (extract between parts; train after the step in progress, or
with several ranks at its next log step, where they agree through a collective they make
anyway) and exits non-zero, saying how to resume. In a process that launched ranks, a second
signal stops them at once.

After `kill -9` of a process nothing runs in it, so its children must notice by themselves:
spawned ranks get the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), and DataLoader
workers, whose parent is multiprocessing's forkserver (which lives as long as they do), watch
the rank's pid. With those gone the forkserver and the resource tracker end on their own (their
pipes reach end-of-file).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import re
import select
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from shared.lock import pid_alive
from shared.oom import oom_kills, process_started
from shared.ranks import launching_parent

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRun(RuntimeError):
    """An error meant for the user, raised on a rank: `shared.dist.launch` re-raises it in the
    launching process with its class and message (spawned ranks pass them back), not as a
    rank's traceback."""


class Stopped(StopRun):
    """Stopped by a signal at a consistent point; the same command resumes."""


class Terminated(BaseException):
    """SIGTERM raised where it came (`sigterm_raises`), as Python raises KeyboardInterrupt on
    SIGINT: a BaseException, so that no `except Exception` takes it for a failure."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises Terminated in the block (main thread only), where its default action
    would end the process at once without a word; the handler before is restored after. A
    handler installed within the block (`StopRequest.install`) takes it while it is in place."""

    def terminated(_signum: int, _frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """The block runs to its end through Ctrl-C and SIGTERM (work that must not be cut off half
    way, such as an engine's shutdown); a signal that came meanwhile is raised again after it,
    to the handler before (a second signal's message, or SIGTERM's default). Main thread only:
    elsewhere the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {s: signal.signal(s, lambda n, _f: came.append(n)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(came):
            signal.raise_signal(s)


def resume_command(stage: str) -> str:
    """The command line that resumes this run: the same one."""
    return shlex.join(["python", "-m", stage, *sys.argv[1:]])


def rank_died(
    rank: int, pid: int, code: int, signal_name: str | None, since: float | None = None
) -> str:
    """What to tell of a spawned rank that ended without a word (killed, crashed); `since`: when
    it started (wall clock), to look for its kill in the kernel's log (`shared.oom`).

    >>> rank_died(1, 4242, -9, "SIGKILL")[:60]
    'rank 1 (pid 4242) was killed by SIGKILL (most often the kern'
    >>> rank_died(0, 7, 3, None)[:60]
    'rank 0 (pid 7) exited with code 3 without a message; the oth'
    """
    if signal_name == "SIGKILL":
        how = _killed(pid, since)
    elif signal_name:
        how = f"was killed by {signal_name}"
    else:
        how = f"exited with code {code} without a message"
    return (
        f"rank {rank} (pid {pid}) {how}; the other ranks were stopped. What was saved before "
        "(committed parts, checkpoints) is kept, the work in progress is not"
    )


def _killed(pid: int, since: float | None) -> str:
    """How a process ended by SIGKILL was killed, as far as the kernel's log tells."""
    kills, read = oom_kills([pid], since) if since is not None else ([], False)
    if kills:
        return f"was {kills[0].describe()}"
    if read:
        return (
            "was killed by SIGKILL, not by the kernel's out-of-memory killer (its log names no "
            "such kill): by `kill -9` or a job scheduler?"
        )
    return "was killed by SIGKILL (most often the kernel's out-of-memory killer: `dmesg` says)"


def worker_died(error: BaseException) -> str | None:
    """What to tell of a DataLoader worker that ended without a word (torch raises a bare
    RuntimeError naming its pid), or None for any other error.

    >>> worker_died(RuntimeError("DataLoader worker (pid(s) 42) exited unexpectedly"))[:53]
    'a data loader worker (pid(s) 42) exited unexpectedly '
    >>> worker_died(RuntimeError("shape mismatch")) is None
    True
    """
    text = str(error).split("\n")[0]
    if not (isinstance(error, RuntimeError) and text.startswith("DataLoader worker (pid")):
        return None
    pids = [int(p) for p in re.findall(r"\d+", text.split(")")[0])]
    kills, read = oom_kills(pids, process_started())  # the workers started after this process
    if kills:
        how = f"(it was {kills[0].describe()})"
    elif read:
        how = "(not by the kernel's out-of-memory killer: its log names no such kill)"
    else:
        how = "(most often killed by the kernel's out-of-memory killer: `dmesg` says)"
    return (
        f"a data loader worker {text.removeprefix('DataLoader worker ')} {how}. What was saved "
        "before (checkpoints) is kept, the work in progress is not: the same command resumes"
    )


def error_kind(error: StopRun) -> str:
    """How a rank names its error to the launching process: its class's module and qualified
    name (two subclasses of one name in two modules stay apart)."""
    return f"{type(error).__module__}.{type(error).__qualname__}"


def stop_class(kind: str) -> type[StopRun]:
    """The StopRun subclass `kind` names (`error_kind`'s, or a bare class name); StopRun for
    none.

    >>> stop_class("shared.stopping.Stopped").__name__, stop_class("Stopped").__name__
    ('Stopped', 'Stopped')
    """
    todo, named, bare = [StopRun], {}, {}
    while todo:
        cls = todo.pop()
        named[f"{cls.__module__}.{cls.__qualname__}"] = cls
        bare.setdefault(cls.__name__, cls)
        todo += cls.__subclasses__()
    return named.get(kind) or bare.get(kind, StopRun)


def stop_error(kind: str, message: str) -> StopRun:
    """The StopRun subclass `kind` names (a rank's error, passed back by name) with `message`."""
    return stop_class(kind)(message)


_PR_SET_PDEATHSIG = 1


class StopRequest:
    """Set by the first SIGTERM or SIGINT after `install()`. A later one calls `on_repeat`
    (the launching process stops its ranks at once), raises KeyboardInterrupt in a process
    started by hand, and is only logged in a rank our launcher spawned."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.on_repeat: Callable[[], None] | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self, what: str | Callable[[], str]) -> StopRequest:
        """Handle the stop signals in this process (main thread only) until `restore()`.
        `what` the first signal starts, in words (a callable: worked out when it comes)."""
        self.what = what
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        what = self.what() if callable(self.what) else self.what
        if self.signal_name is None:
            self.signal_name = name
            log.warning("%s: %s", name, what)
        elif self.on_repeat is not None:
            log.warning("%s again: stopping now", name)
            self.on_repeat()
        elif multiprocessing.parent_process() is None:
            raise KeyboardInterrupt  # a process run by hand: the second Ctrl-C is at once
        else:
            # A rank of our launcher: the launcher passes signals on (a second one here is
            # that copy) and stops the ranks itself on a second one of its own.
            log.warning("%s again: already stopping (%s)", name, what)


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent ends (Linux; a no-op
    elsewhere). Also covers a parent that ended before the call: give its pid as `parent`
    where the call comes late (a spawned rank's, after its imports), since by then this
    process may have another parent already."""
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # reparented already: the parent is gone
        os.kill(os.getpid(), sig)


def watch_process(
    pid: int, *, poll_s: float = 1.0, then: Callable[[], None] = lambda: os._exit(1)
) -> None:
    """Call `then` (default: end this process, os._exit) as soon as process `pid` ends: a
    daemon thread waits on a pidfd where Linux has them, else polls every `poll_s`."""

    def wait_for_it() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_alive(pid):
                threading.Event().wait(poll_s)
        then()

    threading.Thread(target=wait_for_it, name=f"watch-{pid}", daemon=True).start()


def stop_with_parent() -> None:
    """One SIGTERM to this process when its parent ends (a torchrun rank whose agent was killed
    by -9: it stops as on a signal). Not the kernel's parent-death signal, which comes again
    for every thread of a multi-threaded parent as it dies (torchrun's agent: the second
    copy would stop the rank at once, before its checkpoint). The parent is the one the
    process had early in start-up (`shared.ranks.launching_parent`): one that died since is
    not watched in the process that adopted this one. Once per process."""
    if not _WATCHING_PARENT:
        _WATCHING_PARENT.append(launching_parent())
        watch_process(_WATCHING_PARENT[0], then=lambda: os.kill(os.getpid(), signal.SIGTERM))


_WATCHING_PARENT: list[int] = []


def loader_worker_init(rank_pid: int, _worker_id: int) -> None:
    """`worker_init_fn` of the DataLoader (with functools.partial binding the rank's pid):
    the stop signals are the rank's to handle (a worker ending on Ctrl-C would fail the rank's
    next fetch instead of a clean stop), and the worker ends when its rank does."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    watch_process(rank_pid)
