"""A process the kernel killed for want of memory is named so: by the next command that finds
its lock, and by the launcher of a rank it was. The kills are real: a child in a memory cgroup of
64 MB allocates more (root and a memory cgroup needed, else skipped)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from shared.lock import LOCK_FILE, acquire, release
from shared.oom import kernel_log, oom_kill
from shared.stopping import rank_died

ROOT = Path(__file__).resolve().parent.parent
# The child: joins the cgroup (argv[1], its cgroup.procs; "" for none), takes the lock of the
# folder argv[2] as extraction would, says so, then allocates until killed (argv[3] == "grow")
# or waits on its stdin.
CHILD = """
import os, sys
from pathlib import Path
if sys.argv[1]:
    Path(sys.argv[1]).write_text(str(os.getpid()))
from shared.lock import acquire
acquire(Path(sys.argv[2]), "python -m extract")
print("held", flush=True)
if sys.argv[3] == "grow":
    blocks = [bytearray(16 << 20) for _ in range(64)]
sys.stdin.read()
"""


@pytest.fixture
def memory_cgroup():
    """The cgroup.procs file of a new memory cgroup limited to 64 MB (v1 or v2)."""
    if kernel_log() is None:
        pytest.skip("the kernel's log cannot be read here")
    name = f"dflash-test-{uuid.uuid4().hex[:8]}"
    for base, limit in [
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/unified"), "memory.max"),
    ]:
        group = base / name
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit).write_text(str(64 << 20))
        except OSError:
            group.rmdir()
            continue
        try:
            yield group / "cgroup.procs"
        finally:
            group.rmdir()  # its child was waited for: the group is empty
        return
    pytest.skip("no memory cgroup can be made here")


def _child(procs: str, folder: Path, grow: bool) -> tuple[subprocess.Popen, float]:
    started = time.time()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-c", CHILD, procs, str(folder), "grow" if grow else "wait"]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    assert p.stdout.readline() == "held\n"
    return p, started


def test_a_lock_left_by_an_out_of_memory_kill_is_named_so(tmp_path, memory_cgroup, caplog):
    folder = tmp_path / "c"
    p, started = _child(str(memory_cgroup), folder, grow=True)
    if p.wait() != -signal.SIGKILL:
        pytest.skip(f"the kernel did not kill the child (exit {p.returncode}): swap?")
    assert (folder / LOCK_FILE).is_file()  # nothing ran in it to release its lock
    with caplog.at_level(logging.WARNING, logger="shared.lock"):
        fd = acquire(folder)
    release(folder, fd)
    said = caplog.text
    assert f"pid {p.pid}" in said and "ended by the kernel's out-of-memory killer at" in said
    assert f"Killed process {p.pid} (python" in said and "may run out of memory again" in said
    died = rank_died(1, p.pid, -9, "SIGKILL", since=started)
    assert f"rank 1 (pid {p.pid}) was ended by the kernel's out-of-memory killer" in died
    assert oom_kill(p.pid, time.time() + 3600, kernel_log()) is None  # a later process's pid


def test_a_lock_left_by_kill_9_is_not_blamed_on_memory(tmp_path, memory_cgroup, caplog):
    folder = tmp_path / "c"
    p, started = _child("", folder, grow=False)
    p.kill()
    assert p.wait() == -signal.SIGKILL
    with caplog.at_level(logging.WARNING, logger="shared.lock"):
        fd = acquire(folder)
    release(folder, fd)
    assert "no longer running" in caplog.text and "out-of-memory" not in caplog.text
    died = rank_died(0, p.pid, -9, "SIGKILL", since=started)
    assert "not by the kernel's out-of-memory killer" in died


def test_the_kill_line_of_older_kernels_is_read():
    """4.x kernels log the choice ("Kill process N ... or sacrifice child"), then the kill on a
    line of its own ("Killed process N (name) total-vm:..."): that kill is found too."""
    now = time.monotonic()
    log = [
        (now - 1, "Out of memory: Kill process 4242 (python) score 990 or sacrifice child"),
        (now, "Killed process 4242 (python) total-vm:8500kB, anon-rss:7200kB, file-rss:0kB"),
    ]
    killed = oom_kill(4242, time.time() - 10, log)
    assert killed is not None and killed.line == "Killed process 4242 (python)"
    assert oom_kill(4243, time.time() - 10, log) is None


def test_a_pid_namespace_of_its_own_reads_no_kills(tmp_path):
    """In a container's pid namespace the kernel's log names the host's pids, not the ones a
    lock records: nothing is read there, so no kill is claimed or denied (root and unshare
    needed, else skipped)."""
    code = "from shared.oom import kernel_log; print(kernel_log() is None)"
    args = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    except FileNotFoundError:
        pytest.skip("no unshare here")
    if done.returncode != 0:
        pytest.skip(f"no pid namespace can be made here: {done.stderr.strip()}")
    assert done.stdout == "True\n"
