"""An exclusive lock on an output folder: one extract or train process tree writes it at a time.

`<folder>/.lock` names its holder (pid, host, start time, and its command line as its user typed
it, `shared.stopping.resume_command`, so that a refusal says which run holds the folder; the
line is shortened past COMMAND_CHARS characters). It is made as a private file
that is flocked and then hard-linked into place: link(2) fails if the name exists, atomically
also on NFS, so of two processes only one gets it. The holder keeps an flock(2) on it for its
whole life; the kernel drops that lock when the process dies, even by `kill -9`.

A lock whose holder is gone (its host is this host and its flock is free) is stale: it is taken
over with a warning. A lock held from another host cannot be checked from here: it is refused,
and the message says which file to delete once that process is known to be gone.

The ranks of one run share the lock: the launching process takes it before it starts them
(under torchrun, rank 0 takes it and torchrun stops the job when rank 0 fails).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shared.oom import oom_kills

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
COMMAND_CHARS = 500  # of the holder's command line kept in its lock file; a refusal quotes it


class LockHeld(RuntimeError):
    """Another process holds the output folder; the message names it."""


def shortened(command: str, most: int = COMMAND_CHARS) -> str:
    """`command` as a lock file keeps it: where longer than `most` characters, the words that
    fit, then how many characters are left out.

    >>> shortened("python -m train --data /cache --out /runs/a", most=30)
    'python -m train --data /cache ... (14 more characters)'
    """
    if len(command) <= most:
        return command
    head = command[: most + 1].rsplit(" ", 1)[0][:most]
    return f"{head} ... ({len(command) - len(head)} more characters)"


def _holder_text(info: dict[str, Any]) -> str:
    """'pid N on host H (started T)'."""
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (started {when})"


def _running(info: dict[str, Any]) -> str:
    """', running:' and the holder's command on a line of its own; '.' where the lock names
    none."""
    command = info.get("command")
    return f", running:\n  {command}" if command else "."


def _busy(info: dict[str, Any], path: Path) -> LockHeld:
    return LockHeld(
        f"{path.parent} is in use by {_holder_text(info)}{_running(info)}\n"
        "Wait for it to finish, or use another output folder."
    )


def _unchecked(info: dict[str, Any], path: Path) -> LockHeld:
    """A lock of another host: its flock is not always visible here."""
    return LockHeld(
        f"{path.parent} is locked by {_holder_text(info)}{_running(info)}\n"
        f"This host cannot check that process: if it is gone, delete {path} and run again."
    )


def _read(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


def pid_alive(pid: Any) -> bool:
    """Whether a process of that pid runs on this host (one of another user counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _own_record(command: str) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.time(),
        "command": shortened(command or shlex.join(sys.argv)),
    }


def _make_private(folder: Path, record: dict[str, Any]) -> tuple[int, Path]:
    """A flocked file holding `record`, under a name only this process uses."""
    tmp = folder / f"{LOCK_FILE}.{record['host']}.{record['pid']}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, (json.dumps(record) + "\n").encode())
        os.fsync(fd)
    except BaseException:  # a full disk: no empty lock file is left in the folder
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd, tmp


def acquire(folder: Path, command: str = "") -> int:
    """Take the lock of `folder` (created if missing) for `command`, this process's command
    line as its user typed it (default: sys.argv as it is); return its fd, to pass to
    `release`. Raises LockHeld naming the holder and its command."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    record = _own_record(command)
    fd, tmp = _make_private(folder, record)
    try:
        for _ in range(100):  # a holder releasing at the same time: look again
            try:
                os.link(tmp, path)
                return fd
            except FileExistsError:
                pass
            if _take_over_stale(path, tmp, record):
                return fd
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    os.close(fd)
    raise LockHeld(f"{folder}: could not take {path}")


def _take_over_stale(path: Path, tmp: Path, record: dict[str, Any]) -> bool:
    """Replace `path` with `tmp` when its holder is gone; raise LockHeld when it is not.
    False when `path` changed meanwhile (try again)."""
    try:
        old = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        info = _read(old)
        if not _try_flock(old):
            raise _busy(info, path)
        if os.fstat(old).st_ino != _inode(path):
            return False  # released and replaced while we looked
        if info.get("host") not in (None, record["host"]):
            # The other host's process may be alive: an flock taken there is not always
            # visible here (NFS without lock support, or some FUSE file systems).
            raise _unchecked(info, path)
        state = _gone(info) if not pid_alive(info.get("pid")) else "not holding it"
        log.warning(
            "taking over the stale lock %s of %s, %s; its command: %s",
            path, _holder_text(info), state, info.get("command", "?"),
        )  # fmt: skip
        os.replace(tmp, path)
        return True
    finally:
        os.close(old)


def _gone(info: dict[str, Any]) -> str:
    """How the stale lock's holder ended, where the kernel's log tells (`shared.oom`)."""
    pid, started = info.get("pid"), info.get("started")
    if isinstance(pid, int) and isinstance(started, (int, float)):
        kills, _ = oom_kills([pid], started)
        if kills:
            return kills[0].describe()
    return "no longer running"


def _look(path: Path) -> tuple[dict[str, Any], bool] | None:
    """(the record in lock file `path`, whether a process holds its flock), taking nothing: a
    moment's flock, let go at once, only where the lock is free; None where there is no lock
    file, or none this process could read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        info = _read(fd)
        free = _try_flock(fd)
        if free:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return info, not free
    finally:
        os.close(fd)


def refuse_if_held(folder: Path) -> None:
    """Raise LockHeld, as `acquire` would, when a live process holds `folder`'s lock; take and
    change nothing. A command line calls it before its slow imports, so a second run on a busy
    folder is refused at once; `acquire` still decides (a stale lock passes here and is taken
    over there, with its warning)."""
    path = Path(folder) / LOCK_FILE
    looked = _look(path)
    if looked is None:  # no lock, or none this process could read: `acquire` will tell
        return
    info, held = looked
    if held:
        raise _busy(info, path)
    if info.get("host") not in (None, socket.gethostname()):
        raise _unchecked(info, path)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def read_holder(folder: Path) -> dict[str, Any] | None:
    """The record of whoever holds `folder`'s lock (pid, host, started, command), read without
    touching the lock (a reader's flock, however brief, could make a starting holder refuse);
    None when there is no lock file. The record stays after its holder is `kill -9`ed: see
    `holder_running`."""
    try:
        fd = os.open(Path(folder) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def holder_running(info: dict[str, Any]) -> bool | None:
    """Whether the holder named by `info` still runs: None when it is on another host (its
    process cannot be checked from here)."""
    if info.get("host") != socket.gethostname():
        return None
    return pid_alive(info.get("pid"))


def live_holder(folder: Path) -> dict[str, Any] | None:
    """The record (pid, host, started, command) of the live process of this host that holds
    `folder`'s lock; None where none does (no lock file, a stale one, one of another host,
    which cannot be checked from here). Looks as `refuse_if_held` does (`_look`)."""
    looked = _look(Path(folder) / LOCK_FILE)
    if looked is None or not looked[1] or not holder_running(looked[0]):
        return None
    return looked[0]


def release(folder: Path, fd: int) -> None:
    """Remove the lock file if it is still ours, then drop the flock."""
    path = Path(folder) / LOCK_FILE
    try:
        if _inode(path) == os.fstat(fd).st_ino:
            os.unlink(path)
    finally:
        os.close(fd)


@contextlib.contextmanager
def output_lock(folder: Path, command: str = "", *, enabled: bool = True) -> Iterator[None]:
    """Hold the lock of `folder` for the block, for `command` (`acquire`); a no-op when not
    `enabled` (ranks that share their launcher's lock). A folder that did not exist and is
    still empty is removed after."""
    if not enabled:
        yield
        return
    folder = Path(folder)
    created = not folder.exists()
    fd = acquire(folder, command)
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):  # the error in flight says more (a failing disk)
            release(folder, fd)
        raise
    else:
        release(folder, fd)
    finally:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
