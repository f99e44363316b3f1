"""Part-writer throughput from 1..N threads against plain Blosc on the same data.

    python bench/write_bench.py --samples 6 --rows 2048 --threads 1,2,4,8

Random bf16 states [rows, K=5, H=4096] per sample (random data: real speed, not a real
compression ratio). Prints raw GB/s (uncompressed bytes per second), the cores kept busy and
the ratio, for plain Blosc with the cache's settings on the zarr writer's pieces (64 rows of one
layer, so every thread count has work for all threads) and for the zarr and wds part writers
(`shared.cache.open_part_writer`) with one sample per task (at most --samples threads busy),
commit included.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.cache import open_part_writer  # noqa: E402
from shared.codec import numcodecs_blosc  # noqa: E402

K, H = 5, 4096


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=6)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--threads", default="1,2,4,8")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="write-bench-"))
    import numcodecs
    import zarr

    print(
        f"zarr {zarr.__version__}, numcodecs {numcodecs.__version__}, torch {torch.__version__},"
        f" {os.cpu_count()} cores"
    )
    g = torch.Generator().manual_seed(0)
    hs = [
        (torch.randn(args.rows, K, H, generator=g) * 2).to(torch.bfloat16)
        for _ in range(args.samples)
    ]
    ids, mask = np.zeros(args.rows, np.int32), np.ones(args.rows, np.uint8)
    gb = args.samples * args.rows * K * H * 2 / 1e9
    # Plain Blosc on the zarr writer's own pieces (64 rows of one layer), so that every thread
    # count has work for all its threads; the part writers take one sample per task.
    pieces = [
        np.ascontiguousarray(h.view(torch.uint16).numpy()[r : r + 64, k])
        for h in hs
        for r in range(0, args.rows, 64)
        for k in range(K)
    ]
    codec = numcodecs_blosc(2)
    threads = [int(t) for t in args.threads.split(",")]
    if max(threads) > args.samples:
        print(f"note: part writers keep at most --samples {args.samples} threads busy")
    for nt in threads:
        t, c = time.perf_counter(), cpu_seconds()
        with ThreadPoolExecutor(nt) as pool:
            sizes = list(pool.map(lambda a: len(codec.encode(a)), pieces))
        dt = time.perf_counter() - t
        print(
            f"raw blosc threads={nt:2d}: {gb / dt:6.2f} GB/s, cores busy "
            f"{(cpu_seconds() - c) / dt:5.2f}, ratio {gb * 1e9 / sum(sizes):.2f}"
        )
    for fmt in ("zarr", "wds"):
        for nt in threads:
            shutil.rmtree(out, ignore_errors=True)
            w = open_part_writer(
                out,
                0,
                fmt=fmt,
                store="bf16",
                num_layers=K,
                hidden_size=H,
                lengths=[args.rows] * args.samples,
            )
            t, c = time.perf_counter(), cpu_seconds()

            def write(n: int, w=w) -> None:
                w.write(n, sample_index=n, input_ids=ids, loss_mask=mask, hidden=hs[n])

            with ThreadPoolExecutor(nt) as pool:
                list(pool.map(write, range(args.samples)))
            stats = w.commit()
            dt = time.perf_counter() - t
            print(
                f"{fmt:4s} part threads={nt:2d}: {gb / dt:6.2f} GB/s with commit, cores busy "
                f"{(cpu_seconds() - c) / dt:5.2f}, ratio {gb * 1e9 / stats.nbytes:.2f}"
            )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
