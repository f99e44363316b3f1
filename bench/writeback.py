"""Does early writeback work on the disk under DIR? Writes files as the shard writers do, once
per way of starting their writeback, and prints how much of the written data the kernel still
held dirty just after (the machine's Dirty in /proc/meminfo, so other writers add noise) and how
long the sync that a part's commit makes then took.

    python bench/writeback.py DIR [--files 600] [--file-mb 2] [--threads 4] [--rounds 3]

Ways: `none` (left to the commit's sync), `fadvise` (posix_fadvise POSIX_FADV_DONTNEED),
`sync_file_range` (SYNC_FILE_RANGE_WRITE, which does nothing through overlayfs) and `product`
(`shared.writeback.start_writeback`: sync_file_range, or fadvise on overlayfs). Linux only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import writeback  # noqa: E402
from shared.fsio import filesystem_type  # noqa: E402
from shared.writeback import start_writeback, sync_tree  # noqa: E402


def dirty_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Dirty line in /proc/meminfo")


def _sync_file_range(fd: int) -> None:
    # the product's, cached
    writeback._sync_file_range()(fd, 0, 0, writeback._SYNC_FILE_RANGE_WRITE)


def _fadvise(fd: int) -> None:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


WAYS = {
    "none": lambda fd: None,
    "fadvise": _fadvise,
    "sync_file_range": _sync_file_range,
    "product": start_writeback,
}


def run(root: Path, way: str, files: int, data: bytes, threads: int) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"writeback-{way}-", dir=root))
    try:
        os.sync()
        before = dirty_mb()

        def write(i: int) -> None:
            fd = os.open(folder / f"c.{i}.0.0", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                WAYS[way](fd)
            finally:
                os.close(fd)

        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, range(files)))
        written = time.perf_counter() - start
        left = dirty_mb() - before
        start = time.perf_counter()
        sync_tree(folder)
        synced = time.perf_counter() - start
    finally:
        shutil.rmtree(folder)
    return {"write_s": written, "dirty_mb_left": left, "sync_s": synced}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--files", type=int, default=600)
    p.add_argument("--file-mb", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=4, help="writing at once (the disk queue's 4)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    data = os.urandom(int(args.file_mb * (1 << 20)))
    total = args.files * len(data) / (1 << 20)
    fs = filesystem_type(args.dir) or "file system unknown"
    print(f"{args.dir}: {fs}; {total:,.0f} MB a way, {args.rounds} rounds, the ways' order turned")
    ways = list(WAYS)
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for k in range(args.rounds):
        for way in ways[k % len(ways) :] + ways[: k % len(ways)]:
            runs[way].append(run(args.dir, way, args.files, data, args.threads))
    for way in ways:
        median = {key: statistics.median(r[key] for r in runs[way]) for key in runs[way][0]}
        each = ", ".join(f"{r['write_s']:.2f}" for r in runs[way])
        print(
            f"{way:>16}: written in {median['write_s']:.2f} s ({each}), "
            f"{median['dirty_mb_left']:,.0f} MB left dirty, then synced in "
            f"{median['sync_s']:.2f} s (medians)",
            flush=True,
        )


if __name__ == "__main__":
    main()
