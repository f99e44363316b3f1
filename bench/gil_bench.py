"""How much the part writers slow a thread that launches many small torch ops.

    python bench/gil_bench.py --threads 1,2 --repeats 3

The extraction loop's thread launches the target's forward op by op; every torch op releases
the GIL and takes it back, and each writer thread takes the GIL between its Blosc, crc32c and
file calls. On an H200 host, extraction with writer threads ran the forward loop ~10% slower
than the plain forward, with fewer threads faring better (README, Results). This benchmark
reproduces that contention on any machine, no GPU needed: a "launcher" thread runs tiny CPU
torch ops (dispatch cost only) for --seconds, alone and then while N writer threads write zarr
parts of random bf16 states [rows, K=5, H=4096] (`shared.cache.open_part_writer`, the
extraction writer) as fast as they can. Prints ops/s alone and with writers (their ratio: 1.0
means the writers cost the launcher nothing) and the raw GB/s the writers delivered meanwhile.
--staged planes (the default) hands the writers bf16 planes split beforehand, as extraction
stages them for zarr parts; --staged values gives them the bf16 values (split on the host);
--staged int4 gives them int4 records encoded beforehand (`--store int4`, whose records
extraction encodes on the device); GB/s are raw bf16 bytes in every case.
On a machine with few cores the launcher also competes for cores: compare code versions or
settings on the same machine, not figures across machines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from extract.pipeline import sample_pieces  # noqa: E402
from shared import codec  # noqa: E402
from shared.cache import open_part_writer  # noqa: E402
from shared.int4 import Int4Scheme, encode_int4  # noqa: E402
from shared.planes import split_planes  # noqa: E402

K, H = 5, 4096


def launch_ops(seconds: float) -> float:
    """Tiny torch ops on one thread for `seconds`; returns ops per second."""
    a, b = torch.ones(8), torch.ones(8)
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(200):
            a.add_(b)
            a.mul_(0.5)
        done += 400
    return done / elapsed


def writer_loop(root: Path, payloads: list[torch.Tensor], stop: threading.Event, me: int,
                written: list[int], store: str, piece_rows: int) -> None:  # fmt: skip
    """Write parts of one sample each until `stop`, the sample in pieces of `piece_rows` rows
    (0: whole) as extraction's writer tasks write long ones; counts raw bytes into
    written[me]."""
    n = 0
    while not stop.is_set():
        payload = payloads[n % len(payloads)]
        rows = payload.shape[0]
        final = root / f"w{me}-{n}"
        ids, mask = np.zeros(rows, np.int32), np.ones(rows, np.uint8)
        with open_part_writer(final.parent, n + 1000 * me, fmt="zarr", store=store,
                              num_layers=K, hidden_size=H, lengths=[rows]) as writer:  # fmt: skip
            for p in sample_pieces(rows, piece_rows or rows):
                writer.write(0, sample_index=n, input_ids=ids[p], loss_mask=mask[p],
                             hidden=payload[p], rows=p)  # fmt: skip
            writer.commit()
        shutil.rmtree(writer.final, ignore_errors=True)
        written[me] += rows * K * H * 2  # raw bf16 bytes, whatever was staged
        n += 1


def with_writers(
    threads: int, seconds: float, payloads: list, out: Path | None, store: str, piece_rows: int
):
    """(launcher ops/s, writers' raw GB/s) while `threads` writers run."""
    root = Path(tempfile.mkdtemp(prefix="gil-bench-", dir=out))
    stop, written = threading.Event(), [0] * threads
    workers = [
        threading.Thread(
            target=writer_loop, args=(root, payloads, stop, i, written, store, piece_rows)
        )
        for i in range(threads)
    ]
    for w in workers:
        w.start()
    time.sleep(0.5)  # writers in their steady state before the launcher is timed
    before, start = sum(written), time.perf_counter()
    busy = launch_ops(seconds)
    raw_gb_s = (sum(written) - before) / (time.perf_counter() - start) / 1e9
    stop.set()
    for w in workers:
        w.join()
    shutil.rmtree(root, ignore_errors=True)
    return busy, raw_gb_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2", help="writer thread counts to measure")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3, help="alone / with writers pairs per count")
    p.add_argument("--rows", type=int, default=1024, help="tokens per written sample")
    p.add_argument("--piece-rows", type=int, default=0,
                   help="write each sample in pieces of this many rows (a multiple of 64), as "
                   "extraction's writer tasks write long samples (extract.pipeline.PIECE_ROWS); "
                   "0: whole")  # fmt: skip
    p.add_argument("--switch-interval", type=float, default=None)
    p.add_argument("--out", type=Path, default=None, help="folder on the disk under test")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--codec", choices=("planes", "blosc"), default=codec.BF16_CODEC,
                   help="the bf16 codec the writers use")  # fmt: skip
    p.add_argument("--staged", choices=("planes", "values", "int4"), default="planes",
                   help="what the writers get: bf16 planes split beforehand, as extraction "
                   "stages them for zarr parts, the bf16 values, or int4 records encoded "
                   "beforehand (--store int4, encoded on the device in extraction)")  # fmt: skip
    args = p.parse_args()
    codec.BF16_CODEC = args.codec  # read at each part's opening (shared.codec.hidden_codec)
    store = "int4" if args.staged == "int4" else "bf16"
    if args.staged == "planes" and args.codec != "planes":
        p.error("--staged planes needs --codec planes")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    torch.set_num_threads(1)
    # Layer-major like extraction's staging buffers: each sample is a [rows, K, H] view of
    # [K, rows, H] memory, so one layer's rows are contiguous.
    payloads = []
    for i in range(2):
        h = torch.randn(K, args.rows, H, generator=torch.Generator().manual_seed(i)).bfloat16()
        if args.staged == "planes":  # split where extraction splits them: before staging
            planes = split_planes(h)
            e, sm = (x.transpose(0, 1) for x in (planes.exponent, planes.sign_mantissa))
            payloads.append(codec.Bf16Planes(e, sm))
        elif args.staged == "int4":
            payloads.append(encode_int4(h, Int4Scheme(hidden=H)).transpose(0, 1))
        else:
            payloads.append(h.transpose(0, 1))
    launch_ops(0.5)  # warm-up
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        # Alone and with writers alternate, so a drifting machine shifts both alike.
        pairs = []
        for _ in range(args.repeats):
            alone = launch_ops(args.seconds)
            busy, raw_gb_s = with_writers(
                threads, args.seconds, payloads, args.out, store, args.piece_rows
            )
            pairs.append((busy / alone, alone, busy, raw_gb_s))
        ratio, alone, busy, raw_gb_s = sorted(pairs)[len(pairs) // 2]  # the median pair
        results.append(
            {
                "writer_threads": threads,
                "ratio": ratio,
                "ratios": [p[0] for p in pairs],
                "alone_ops_s": alone,
                "ops_s": busy,
                "raw_GB_s": raw_gb_s,
            }  # fmt: skip
        )
        print(
            f"writers={threads:2d}: launcher {ratio:.3f} of alone (median of "
            f"{' '.join(f'{p[0]:.3f}' for p in pairs)}; {busy:,.0f} vs {alone:,.0f} ops/s), "
            f"writers {raw_gb_s:.2f} GB/s raw"
        )
    res = {"bench": "gil", "switch_interval_s": sys.getswitchinterval(), "rows": args.rows,
           "piece_rows": args.piece_rows,
           "codec": args.codec, "staged": args.staged,
           "runs": results}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
