"""Where an extraction writer thread's time goes: the codec, the write path around it, waiting.

    python bench/writer_cost.py [--rows 4096] [--samples 8] [--threads 1,4,8,12] [--out DIR]
                                [--page-cache drop|keep|both] [--pause S]

Random bf16 states staged as extraction stages them (layer-major `planes`, `shared.planes`),
written by the extraction's own zarr part writer in its tasks (pieces of PIECE_ROWS rows, one
task each, as `extract.pipeline` submits them), with 1..N threads at once. For each thread
count: raw GB/s, the process's CPU seconds per raw GB, and the threads' time in their tasks
split into CPU (the thread's own clock) and the rest (waiting: for the GIL, for a core shared
with another thread, for the disk queue). The first line is the codec alone (`planes_frames`
on the same 64-row chunks, one thread): the least a byte can cost. A host whose writer threads
were slow in `bench/e2e_gpu.py` runs this beside it: CPU per GB far above the codec's says the
write path or the cores, busy far above CPU says the threads wait.

--page-cache: `drop` (the product's: each shard file's pages leave the page cache once the disk
has them, `shared.writeback.DropBehind`), `keep` (left cached), or `both`, one after the other for
each thread count; --pause S waits S seconds before each run, long enough for a virtual machine
that returns idle memory to its host to have done so (its new pages then cost what a long
extraction's do). The process's CPU seconds are split into user and system (the kernel: page
cache, page faults) per raw GB.

Random data: real speed of the codec within a factor, not a real compression ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shared.zarr_part  # noqa: E402
from extract.pipeline import PIECE_ROWS  # noqa: E402
from shared.cache import open_part_writer  # noqa: E402
from shared.codec import CHUNK_ROWS, Bf16Planes  # noqa: E402
from shared.diskqueue import DiskQueue  # noqa: E402
from shared.planes import planes_frames, split_planes  # noqa: E402

K, H = 5, 4096  # the 8B shape's five taps


def process_cpu_s() -> tuple[float, float]:
    """(user, system) CPU seconds of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def staged(rows: int, seed: int) -> Bf16Planes:
    """[rows, K, H] planes as views of layer-major [K, rows, H] buffers (the staging layout)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, rows, H, generator=g) * torch.rand(1, rows, 1, generator=g) * 4
    p = split_planes(x.to(torch.bfloat16))
    return Bf16Planes(p.exponent.transpose(0, 1), p.sign_mantissa.transpose(0, 1))


def codec_alone(sample: Bf16Planes) -> float:
    """CPU seconds of `planes_frames` on every 64-row chunk of one layer of `sample`."""
    e, sm = sample.exponent.numpy(), sample.sign_mantissa.numpy()
    start = time.thread_time()
    for k in range(K):
        for r in range(0, len(sample), CHUNK_ROWS):
            planes_frames(Bf16Planes(e[r : r + CHUNK_ROWS, k], sm[r : r + CHUNK_ROWS, k]))
    return time.thread_time() - start


def write_all(out: Path, samples: list[Bf16Planes], threads: int) -> dict:
    """The samples through one zarr part writer on `threads` threads, piece by piece."""
    rows = len(samples[0])
    io = DiskQueue()
    writer = open_part_writer(
        out, 0, fmt="zarr", store="bf16", num_layers=K, hidden_size=H,
        lengths=[rows] * len(samples), io=io,
    )  # fmt: skip
    ids, mask = np.arange(rows, dtype=np.int32), np.ones(rows, np.uint8)
    busy, cpu, lock = [0.0], [0.0], threading.Lock()

    def task(n: int, piece: slice) -> None:
        wall, own = time.perf_counter(), time.thread_time()
        writer.write(
            n, sample_index=n, input_ids=ids[piece], loss_mask=mask[piece],
            hidden=samples[n][piece], rows=piece,
        )  # fmt: skip
        with lock:
            busy[0] += time.perf_counter() - wall
            cpu[0] += time.thread_time() - own

    tasks = [
        (n, slice(r, min(r + PIECE_ROWS, rows)))
        for n in range(len(samples))
        for r in range(0, rows, PIECE_ROWS)
    ]
    start, c0 = time.perf_counter(), process_cpu_s()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(task, n, piece) for n, piece in tasks]:
            f.result()
    io.wait_idle()  # every shard file on disk (`close` would drop the writes not started)
    wall, (user, system) = time.perf_counter() - start, process_cpu_s()
    user, system = user - c0[0], system - c0[1]
    writer.commit()
    io.close()
    return {
        "wall_s": wall, "process_cpu_s": user + system, "user_s": user, "system_s": system,
        "busy_s": busy[0], "cpu_s": cpu[0],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="rows a sample")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--threads", default="1,4,8,12")
    p.add_argument("--out", type=Path, default=None, help="where the parts go (default: /tmp)")
    p.add_argument("--page-cache", choices=("drop", "keep", "both"), default="drop")
    p.add_argument("--pause", type=float, default=0.0, help="seconds idle before each run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    samples = [staged(args.rows, seed) for seed in range(args.samples)]
    gb = args.samples * args.rows * K * H * 2 / 1e9
    codec_s = codec_alone(samples[0]) * args.samples
    print(f"{gb:.2f} GB of raw bf16; codec alone, one thread: {codec_s / gb:.2f} CPU s/GB")
    result = {"raw_gb": gb, "codec_cpu_s_per_gb": codec_s / gb, "threads": {}}
    root = Path(tempfile.mkdtemp(prefix="writer-cost-", dir=args.out))
    try:
        modes = ("drop", "keep") if args.page_cache == "both" else (args.page_cache,)
        for n in (int(t) for t in args.threads.split(",")):
            for mode in modes:
                shared.zarr_part.DROP_BEHIND = mode == "drop"
                time.sleep(args.pause)
                r = write_all(root / f"t{n}", samples, n)
                shutil.rmtree(root / f"t{n}", ignore_errors=True)
                waiting = 1 - r["cpu_s"] / r["busy_s"]
                print(
                    f"{n:2d} threads, page cache {mode}: {gb / r['wall_s']:5.2f} GB/s, "
                    f"{r['process_cpu_s'] / gb:5.2f} CPU s/GB (process; user "
                    f"{r['user_s'] / gb:.2f}, system {r['system_s'] / gb:.2f}), tasks busy "
                    f"{r['busy_s']:6.1f} s of which CPU {r['cpu_s']:6.1f} s ({waiting:.0%} "
                    "waiting)",
                    flush=True,
                )
                result["threads"][f"{n} {mode}"] = r
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
