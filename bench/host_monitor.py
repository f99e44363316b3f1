"""Host activity while a benchmark runs, from Linux's /proc and /sys: busy cores, cores waiting
for I/O, dirty page cache and disk writes, sampled by a background thread.

    with HostMonitor() as mon:
        ...
    mon.summary()  # {} where /proc is missing

A sync that stalls the writer threads shows as samples with few busy cores, some I/O wait and a
burst of disk writes; steady writeback as a flat write rate and a small dirty cache.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _cpu_jiffies() -> tuple[int, int, int]:
    """(total, idle, iowait) jiffies of all cores since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3], fields[4]


def _dirty_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) * 1024
    return 0


def _written_bytes() -> int:
    """Bytes written to whole disks (not partitions, so nothing counts twice) since boot."""
    total = 0
    for dev in Path("/sys/block").iterdir():
        if dev.name.startswith(("loop", "ram", "zram")):
            continue
        fields = (dev / "stat").read_text().split()
        total += int(fields[6]) * 512  # sectors written
    return total


def _sample() -> tuple[float, int, int, int, int, int]:
    total, idle, iowait = _cpu_jiffies()
    return time.perf_counter(), total, idle, iowait, _dirty_bytes(), _written_bytes()


class HostMonitor:
    """Samples every `every` seconds between __enter__ and __exit__."""

    def __init__(self, every: float = 0.5):
        self.every = every
        self.rows: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-monitor", daemon=True)
        self._ok = Path("/proc/stat").exists() and Path("/sys/block").exists()
        self._start = 0.0

    def __enter__(self) -> HostMonitor:
        if self._ok:
            self._start = time.perf_counter()
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        prev = _sample()
        while not self._stop.wait(self.every):
            cur = _sample()
            dt = cur[0] - prev[0]
            total, idle, iowait = (cur[i] - prev[i] for i in (1, 2, 3))
            self.rows.append(
                {
                    "t": round(cur[0] - self._start, 2),
                    "busy_cores": round((total - idle - iowait) / hz / dt, 2),
                    "iowait_cores": round(iowait / hz / dt, 2),
                    "dirty_GB": round(cur[4] / 1e9, 3),
                    "write_GB_s": round((cur[5] - prev[5]) / 1e9 / dt, 3),
                }
            )
            prev = cur

    def summary(self) -> dict[str, object]:
        """Means and extremes of the samples, plus the samples; {} without any."""
        if not self.rows:
            return {}
        busy = sorted(r["busy_cores"] for r in self.rows)
        return {
            "busy_cores_mean": round(sum(busy) / len(busy), 2),
            "busy_cores_p10": busy[len(busy) // 10],
            "iowait_cores_max": max(r["iowait_cores"] for r in self.rows),
            "dirty_GB_max": max(r["dirty_GB"] for r in self.rows),
            "write_GB_s_mean": round(sum(r["write_GB_s"] for r in self.rows) / len(self.rows), 3),
            "write_GB_s_max": max(r["write_GB_s"] for r in self.rows),
            "samples": self.rows,
        }
