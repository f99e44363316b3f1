"""Atomic file writes, removal and an advisory lock (every file the project writes goes through
here), and a file-system error in words for the user."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def unwritable_reason(out: Path) -> str | None:
    """Why no folder can be made or written at `out`, naming the path at fault (None when one
    can): `out` is a file, or the nearest existing folder above it is not writable (a
    read-only file system included). Said before any work, beside the option that named it.

    >>> unwritable_reason(Path("/proc/version/run"))
    '/proc/version is a file, not a folder'
    """
    probe = Path(out)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK):
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        return f"{probe} is not a writable folder" + (" (a read-only file system)" * read_only)
    return None


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unescape(field: str) -> str:
    r"""A mountinfo path with its octal escapes (\040 for a space, \134 for a backslash) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount this process sees, in mount order, from
    /proc/self/mountinfo (empty where it is missing: not Linux)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        fields, _, rest = line.partition(" - ")
        fields = fields.split()
        if len(fields) >= 5 and rest:
            mounts.append((_unescape(fields[4]), rest.split()[0]))
    return mounts


def filesystem_type(path: Path) -> str | None:
    """The type of the file system holding `path` ("ext4", "overlay", "tmpfs", ...): that of
    the mount point that is the longest prefix of its real path (the last mounted, where several
    share it). None where no mount is known.

    >>> filesystem_type(Path("/proc/self")) in ("proc", None)
    True
    """
    probe = Path(path).resolve()
    best, kind = -1, None
    for point, fstype in _mounts():
        if (probe == Path(point) or Path(point) in probe.parents) and len(point) >= best:
            best, kind = len(point), fstype
    return kind


def named(e: OSError, path: Path | str) -> OSError:
    """`e` naming `path` where the call that raised it left it nameless (a write, tarfile's
    appends), so that a full or failing disk's message says which file; `e` itself otherwise."""
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror, str(path))


def os_error_text(e: OSError, where: Path | str) -> str:
    """A file-system error as one line for the user: the file it names (else `where`, the
    folder being written) and why.

    >>> os_error_text(PermissionError(13, "Permission denied", "/out/part-000001"), "/out")
    '/out/part-000001: Permission denied'
    >>> os_error_text(OSError("no such device"), "/out")
    '/out: no such device'
    """
    return f"{e.filename or where}: {e.strerror or e}"


def remove_path(path: Path) -> None:
    """Remove a file or folder if it exists. An entry that cannot be removed is named by its
    path in the error (rmtree names it by its name alone before Python 3.13)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, **{_ONEXC: _raise_with_path})
    elif path.exists() or path.is_symlink():
        path.unlink()


_ONEXC = "onexc" if sys.version_info >= (3, 12) else "onerror"  # onerror: deprecated in 3.12


def _raise_with_path(_func: object, path: str, error: BaseException | tuple) -> None:
    """rmtree's error handler: its error raised again, naming `path` (the entry's path)."""
    e = error if isinstance(error, BaseException) else error[1]
    if isinstance(e, OSError) and e.errno is not None:
        raise OSError(e.errno, e.strerror, path) from None  # PermissionError etc. by errno
    raise e


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, never a part."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no temporary file is left behind
        _unlink_quietly(tmp)
        raise
    fsync_dir(path.parent)


def replace_file_bytes(path: Path, data: bytes) -> None:
    """Atomic but not durable: readers see the old file or the new one, and nothing waits for
    the disk. For files that are rewritten every second and worthless after a crash (progress
    counters): an fsync there can stall its caller for seconds while the file system commits
    other writers' data."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: Path) -> None:
    """Delete `path` if it can be: the error being raised is the one to report, not this."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")


_TMP = re.compile(r"^\..+\.tmp\.\d+\.\d+$")
STALE_TMP_S = 60.0  # an atomic write takes milliseconds: a temporary file this old was left


def is_atomic_tmp(name: str) -> bool:
    """Whether `name` is the temporary file of an atomic write (`.NAME.tmp.PID.TID`)."""
    return bool(_TMP.match(name))


def remove_stale_tmp(folder: Path, older_than_s: float = STALE_TMP_S) -> list[Path]:
    """Delete the temporary files of atomic writes in `folder` that a killed process left
    (older than `older_than_s`: a running write's is younger); returns them."""
    gone = []
    now = time.time()
    for entry in os.scandir(folder) if Path(folder).is_dir() else []:
        try:
            if _TMP.match(entry.name) and now - entry.stat().st_mtime > older_than_s:
                os.unlink(entry.path)
                gone.append(Path(entry.path))
        except OSError:  # gone already, or not ours to delete: best effort
            continue
    return gone


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it: for a moment every
    other thread would create files with another mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def public_modes(root: Path) -> None:
    """Files 0644 and folders 0755 under `root` (within the umask): what the user's own
    writes get. safetensors and tempfile.mkdtemp create private files and folders (0600,
    0700), which a serving process running as another user cannot read."""
    root = Path(root)
    mask = _umask()
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    for path in paths:
        if path.is_symlink():
            continue
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        if path.stat().st_mode & 0o777 != want:
            path.chmod(want)


def replace_dir(tmp: Path, final: Path) -> None:
    """Rename a finished folder `tmp` to `final`, replacing an older `final` if one exists (a
    `final.old` left by a kill between this function's two renames goes too)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
    else:
        os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(final.parent)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock on `path` (created if missing); serialises manifest updates."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def within(path: Path | str, folder: Path | str) -> bool:
    """Whether `path` is `folder` or lies inside it, both resolved.

    >>> within("/a/b/c", "/a/b"), within("/a/b", "/a/b"), within("/a/bc", "/a/b")
    (True, True, False)
    """
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents
