"""How fast the disk under DIR takes shard files as extraction's disk queue writes them.

    python bench/shard_write.py DIR [--gb 8] [--file-mb 1.7] [--threads 1,2,4,8]

Extraction's zarr parts are one file per 64 rows (all captured layers), written by
`shared.diskqueue.DiskQueue`'s threads with `shared.zarr_part.write_buffers` (os.writev, then the
file's writeback started) and made durable by one syncfs at the part's commit
(`shared.writeback.sync_tree`). This writes --gb of incompressible files of --file-mb (an 8B
target's bf16 shard is about 1.7 MB, its int4 one about 0.6 MB) the same way with each thread
count, in each layout of --layouts: `flat`, the files in one folder (``hidden/c.<i>.0.0``, the
cache's keys), and `folders`, each file in two new folders of its own (``hidden/c/<i>/0/0``, the
keys parts had before); then syncs, and prints GB/s with and without the sync and the threads'
mean milliseconds a file. `bash bench/disk_write.sh DIR` gives the disk's rate for
large streams; this, the rate for extraction's files, which the disk queue's thread count
(`shared.diskqueue.DEFAULT_THREADS`) sets.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.diskqueue import DEFAULT_THREADS  # noqa: E402
from shared.fsio import filesystem_type  # noqa: E402
from shared.writeback import sync_tree  # noqa: E402
from shared.zarr_part import write_buffers  # noqa: E402
from shared.zarr_shards import shard_key  # noqa: E402


def write_file(root: str, i: int, pieces: list[bytes], flat: bool) -> float:
    """One shard file as `ZarrPartWriter._write_shards` writes it (`flat`: under a '.'-separated
    key, in the array's own folder, no folders made); returns its seconds."""
    start = time.perf_counter()
    key = shard_key(i, "." if flat else "/")
    if not flat:
        folder = f"{root}/{key}"[: -len("/0")]
        os.mkdir(folder[: -len("/0")])
        os.mkdir(folder)
    write_buffers(f"{root}/{key}", pieces)
    return time.perf_counter() - start


def shard_pieces(file_mb: float) -> list[bytes]:
    """One shard file's incompressible bytes of `file_mb` MB, in the pieces `write_buffers`
    gets: per layer a few frames and a checksum, then the index (16 pieces)."""
    size = int(file_mb * 1e6)
    data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
    cuts = np.linspace(0, size, 17).astype(int)
    return [data[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def run(dir_: Path, threads: int, files: int, pieces: list[bytes], flat: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="shard-write-", dir=dir_))
    try:
        (root / "hidden").mkdir()
        if not flat:
            (root / "hidden" / "c").mkdir()
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            seconds = list(pool.map(lambda i: write_file(str(root), i, pieces, flat), range(files)))
        written = time.perf_counter()
        sync_tree(root)
        synced = time.perf_counter()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = files * sum(map(len, pieces))
    return {
        "threads": threads,
        "GB_s_written": nbytes / (written - start) / 1e9,
        "GB_s_synced": nbytes / (synced - start) / 1e9,
        "ms_a_file": 1e3 * sum(seconds) / files,
    }


def disk_rate(work: Path, gb: float) -> dict[str, Any] | None:
    """The cache's disk, before anything else is written: `gb` GB of incompressible 1.7 MB shard
    files (an 8B target's) written as the disk queue writes them (its default thread count, the
    files' writeback started as written, one syncfs at the end). None where skipped (`gb` 0,
    or under twice that free)."""
    free = shutil.disk_usage(work).free
    if gb <= 0 or free < 2 * gb * 1e9:
        if gb > 0:
            print(f"disk not measured: {free / 1e9:.1f} GB free under {work}", flush=True)
        return None
    pieces = shard_pieces(1.7)
    size = sum(map(len, pieces))
    files = max(1, int(gb * 1e9 // size))
    r = run(work, DEFAULT_THREADS, files, pieces, flat=True)
    disk = {"gb": files * size / 1e9, "threads": DEFAULT_THREADS, "gb_s": r["GB_s_synced"]}
    print(f"disk {disk['gb_s']:.2f} GB/s ({disk['gb']:.1f} GB of shard files, synced)", flush=True)
    return disk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--gb", type=float, default=8.0)
    p.add_argument("--file-mb", type=float, default=1.7)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument(
        "--layouts",
        default="folders,flat",
        help="flat: hidden/c.<i>.0.0 (the cache's keys); folders: hidden/c/<i>/0/0 (before)",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"{args.dir}: {filesystem_type(args.dir) or 'file system unknown'}", flush=True)
    pieces = shard_pieces(args.file_mb)
    files = max(1, int(args.gb * 1e9 // sum(map(len, pieces))))
    out = []
    for threads in [int(t) for t in args.threads.split(",")]:
        for layout in args.layouts.split(","):
            r = {"layout": layout, **run(args.dir, threads, files, pieces, layout == "flat")}
            out.append(r)
            print(
                f"{threads} threads, {files} files of {args.file_mb} MB, {layout}: "
                f"{r['GB_s_written']:.2f} GB/s written, {r['GB_s_synced']:.2f} GB/s synced, "
                f"{r['ms_a_file']:.2f} ms a file",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"bench": "shard_write", "runs": out}, indent=2))


if __name__ == "__main__":
    main()
