"""What a new page costs this machine: memory touched for the first time against memory touched
again, and again after idling.

    python bench/page_touch.py [--gib 2] [--idle 6] [--dir /tmp]

Three passes each: allocate --gib GiB of anonymous memory and write one byte a page (time per
page), free it; then write --gib GiB to a file under --dir through the page cache (GB/s and
CPU seconds), delete it. Pass 0 takes what the kernel has, pass 1 follows at once (pages just
freed), pass 2 follows --idle seconds of sleep. A virtual machine whose host takes back memory
its guest leaves idle (free page reporting) shows passes 0 and 2 several times slower than pass
1: the cost `shared.writeback.DropBehind` keeps a cache's writes from paying for every page.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

PAGE = 4096


def anonymous(nbytes: int) -> float:
    """Seconds to allocate `nbytes` and write one byte a page."""
    start = time.perf_counter()
    a = np.empty(nbytes, np.uint8)
    a[::PAGE] = 1
    seconds = time.perf_counter() - start
    del a
    return seconds


def page_cache(nbytes: int, folder: str) -> tuple[float, float]:
    """(seconds, CPU seconds) to write `nbytes` to a new file in `folder` (then deleted)."""
    block = np.ones(64 << 20, np.uint8)
    fd, path = tempfile.mkstemp(prefix="page-touch-", dir=folder)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        for _ in range(max(1, nbytes // block.size)):
            os.write(fd, block)
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--idle", type=float, default=6.0, help="seconds asleep before pass 2")
    p.add_argument("--dir", default=tempfile.gettempdir())
    args = p.parse_args()
    n = int(args.gib * (1 << 30))
    for k in range(3):
        if k == 2:
            time.sleep(args.idle)
        s = anonymous(n)
        print(f"anonymous memory, pass {k}: {s / (n / PAGE) * 1e6:.2f} us a page", flush=True)
    for k in range(3):
        if k == 2:
            time.sleep(args.idle)
        s, cpu = page_cache(n, args.dir)
        rate = f"{n / s / 1e9:.2f} GB/s ({cpu / s:.0%} CPU)"
        print(f"page cache writes, pass {k}: {rate}", flush=True)


if __name__ == "__main__":
    main()
