"""Whether the kernel ended a process for want of memory. Its out-of-memory killer ends the
largest process with SIGKILL and nothing runs in it after: the process cannot say so itself, but
the kernel's log names it ("Out of memory: Killed process 4242 (python)", or "Memory cgroup out
of memory: ..." where a container's limit was reached; on 4.x kernels "Killed process 4242
(python)" alone). The log is read from /dev/kmsg, which root can read (others where
kernel.dmesg_restrict is 0); elsewhere nothing is known."""

from __future__ import annotations

import errno
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

KMSG = "/dev/kmsg"
# "Out of memory: Killed process 4242 (python) total-vm:..." on 5.x kernels (the cgroup's:
# "Memory cgroup out of memory: ..."); on 4.x, a line of its own after the choice ("Out of
# memory: Kill process 4242 (python) score 990 or sacrifice child"): "Killed process 4242
# (python) total-vm:...", which names the process killed (a child, where one was sacrificed).
_KILLED = re.compile(r"\bKilled process (\d+) \([^)]*\)")
# The log's clock (the kernel's, since boot) and the monotonic clock that dates it here (slewed
# by NTP) drift apart with uptime (by NTP's 500 ppm bound, at most 43 s a day; far less as a
# rule): a kill logged more than this before a process started was of an older process of the
# same pid (on a machine up for weeks, a kill in a process's first minute may then be missed).
_SLACK_S = 60.0
_INIT_PID_NS = 0xEFFFFFFC  # the initial pid namespace's inode (PROC_PID_INIT_INO)


@dataclass(frozen=True)
class OomKill:
    when: float  # wall-clock time
    line: str  # the kernel's line, up to the process's name

    def describe(self) -> str:
        """
        >>> OomKill(0.0, "Out of memory: Killed process 7 (python)").describe()[:44]
        "ended by the kernel's out-of-memory killer a"
        """
        at = time.strftime("%H:%M:%S", time.localtime(self.when))
        return (
            f"ended by the kernel's out-of-memory killer at {at}, its log says: {self.line}; the "
            "same settings may run out of memory again"
        )


def kernel_log(path: str = KMSG) -> list[tuple[float, str]] | None:
    """The records still in the kernel's log buffer as (seconds since boot, first line), oldest
    first; None where the log cannot be read, or where its pids are not this process's (a
    container's own pid namespace: the log names the host's pids)."""
    try:
        if os.stat("/proc/self/ns/pid").st_ino != _INIT_PID_NS:
            return None
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records = []
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as e:
                if e.errno == errno.EPIPE:
                    continue  # a record overwritten while reading: the next one follows
                return None if not records else records
            head, _, text = record.decode(errors="replace").partition(";")
            fields = head.split(",")
            if len(fields) >= 3 and fields[2].isdigit():
                records.append((int(fields[2]) / 1e6, text.split("\n", 1)[0]))
    finally:
        os.close(fd)
    return records


def oom_kill(pid: int, since: float, log: list[tuple[float, str]] | None) -> OomKill | None:
    """The out-of-memory kill of process `pid` (started at wall-clock time `since`) in `log`
    (`kernel_log()`), or None."""
    boot = time.time() - time.monotonic()
    for seconds, line in reversed(log or []):
        m = _KILLED.search(line)
        if m and int(m.group(1)) == pid and boot + seconds >= since - _SLACK_S:
            return OomKill(boot + seconds, line[: m.end()])
    return None


def oom_kills(pids: list[int], since: float) -> tuple[list[OomKill], bool]:
    """The out-of-memory kills of processes `pids` (started after wall-clock time `since`) in
    the kernel's log, and whether that log could be read (no kill found means none then)."""
    log = kernel_log()
    if log is None:
        return [], False
    return [k for k in (oom_kill(pid, since, log) for pid in pids) if k is not None], True


def process_started(pid: int | str = "self") -> float:
    """When a process of this host started (wall clock), from /proc; now where it cannot be
    read (a kill is then looked for from now on: none is found)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # starttime, field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
