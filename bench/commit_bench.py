"""Commit time of a zarr part: one syncfs of the file system against an fsync per file.

    python bench/commit_bench.py --out-root /path/on/the/cache/disk --repeats 3

Writes the same part (random bf16 states, K=5, H=4096, six samples of 700..2000 rows) with
the shared part writer, then times `commit()` (the durable flush, the part checksum, the
rename) with `shared.writeback.sync_tree`'s syncfs path and with its per-file fallback, alternating.
Random data: real file counts and sizes, not a real compression ratio.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shared.writeback as writeback  # noqa: E402
from shared.cache import open_part_writer  # noqa: E402

K, H = 5, 4096
ROWS = (900, 1200, 700, 1500, 1100, 2000)


def commit_seconds(out: Path, states: list[torch.Tensor], *, per_file: bool) -> float:
    writer = open_part_writer(
        out, 0, fmt="zarr", store="bf16", lengths=ROWS, num_layers=K, hidden_size=H
    )
    for n, h in enumerate(states):
        writer.write(
            n,
            sample_index=n,
            input_ids=np.zeros(ROWS[n], np.int32),
            loss_mask=np.ones(ROWS[n], np.uint8),
            hidden=h,
        )
    syncfs = writeback._syncfs
    if per_file:
        # the fallback: an fsync per file and folder
        writeback._syncfs = lambda path, fd=None: False
    try:
        start = time.perf_counter()
        writer.commit()
        return time.perf_counter() - start
    finally:
        writeback._syncfs = syncfs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-root", type=Path, default=None, help="a folder on the disk to test")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="commit-bench-", dir=args.out_root))
    gen = torch.Generator().manual_seed(0)
    states = [(torch.randn(r, K, H, generator=gen) * 2).to(torch.bfloat16) for r in ROWS]
    times: dict[str, list[float]] = {"syncfs": [], "per_file": []}
    try:
        for i in range(args.repeats):
            for mode in ("per_file", "syncfs"):
                out = root / f"{mode}-{i}"
                times[mode].append(commit_seconds(out, states, per_file=mode == "per_file"))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {
        "bench": "commit",
        "raw_GB": sum(ROWS) * K * H * 2 / 1e9,
        "commit_s_syncfs": float(np.median(times["syncfs"])),
        "commit_s_per_file_fsync": float(np.median(times["per_file"])),
        "runs": times,
    }
    res["ratio"] = res["commit_s_per_file_fsync"] / res["commit_s_syncfs"]
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
