"""A file that another process cannot open until the test lets it: a Linux write lease, which
makes the kernel hold such an `open()` and signal the lease holder (SIGIO). A test then knows,
without sleeping or polling, that a child process has reached the point where it opens that
file, and holds it there. A FIFO cannot do this for the files transformers reads: it checks
that each is a regular file first.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def held_file(path: Path) -> Iterator[Callable[[float], None]]:
    """Hold `path` until the block ends: another process's `open()` of it waits until then (or
    the kernel's lease-break-time, 45 s by default). Yields `opened(timeout)`, which returns once
    a process is waiting in that `open()`. Skips where the file system takes no lease. The
    block must not open `path` itself."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    handler = signal.signal(signal.SIGIO, lambda *_: None)  # SIGIO would end this process
    wakeup = signal.set_wakeup_fd(wake_w)  # any thread's SIGIO reaches the pipe
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            pytest.skip(f"no file lease on {path} ({e})")

        def opened(timeout: float) -> None:
            while True:
                ready, _, _ = select.select([wake_r], [], [], timeout)
                if not ready:
                    raise AssertionError(f"no process opened {path} in {timeout} s")
                if signal.SIGIO in os.read(wake_r, 64):  # one byte per signal, its number
                    return

        yield opened
    finally:
        os.close(fd)  # the lease goes with it: the waiting open() goes on
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGIO, handler)
        os.close(wake_r)
        os.close(wake_w)


def interrupted_at_open(
    module: str,
    args: list[str],
    path: Path,
    *,
    said: Sequence[str] = (),
    again: bool = False,
    sig: int = signal.SIGINT,
) -> subprocess.CompletedProcess:
    """`python -m module args` (of this project, on one intra-op thread) run until it opens
    `path`, sent `sig` (Ctrl-C's SIGINT unless told) while that `open()` waits, held there
    until its standard error has said each of `said` (one line each, in any order), then with
    `again` sent `sig` a second time, then let go on to its end: its exit code and output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with held_file(path) as opened:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ctrl_c_as_at_a_terminal,
        )
        try:
            opened(timeout=120)
            proc.send_signal(sig)
            seen = _lines_saying(proc, said)
        except BaseException as e:
            proc.kill()
            e.add_note(f"python -m {module} said:\n{proc.communicate()[1][-3000:]}")
            raise
        if again:
            proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, seen + stderr)


def ctrl_c_as_at_a_terminal() -> None:
    """SIGINT back to its default in the child, which Python then turns into KeyboardInterrupt as
    at a terminal: a test run in the background of a non-interactive shell (as CI may be) has it
    ignored, and a child inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lines_saying(proc: subprocess.Popen, said: Sequence[str]) -> str:
    """The standard error of `proc`, read line by line (the pipe blocks: no sleeping) until a
    line held each of `said`, one line each."""
    left, seen = list(said), []
    while left:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"the process ended before it said {left}:\n{''.join(seen)}")
        seen.append(line)
        hit = next((s for s in left if s in line), None)
        if hit is not None:
            left.remove(hit)
    return "".join(seen)
