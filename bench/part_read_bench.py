"""Training's reads of a zarr cache on one thread: our shards read directly against zarr.

    python bench/part_read_bench.py --cache CACHE [--layers 0,2] [--repeats 3]

Reads every sample of every part (`shared.cache.open_part(...).read`, what the loader workers
do), all layers or `--layers` (positions in the cache's layer list), once with the reader's own
shard decoding (`shared.zarr_shards.ShardFiles`) and once through zarr, alternating, and prints
the raw payload GB/s of each (the best of `--repeats`) and their ratio. The files come from the
page cache after the first pass: this measures decoding CPU, not the disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.cache import open_part  # noqa: E402
from shared.manifest import read_manifest  # noqa: E402


def read_all(cache: Path, names: list[str], layers, direct: bool) -> tuple[float, int]:
    nbytes, start = 0, time.perf_counter()
    for name in names:
        reader = open_part(cache / name)
        if not direct:
            reader._shards = None  # the reader's zarr path
        for n in range(reader.num_samples):
            nbytes += reader.read(n, layers=layers).hidden.nbytes
    return time.perf_counter() - start, nbytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--layers", default=None, help="comma-separated layer positions (default all)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    manifest = read_manifest(args.cache)
    if manifest.format != "zarr":
        raise SystemExit(f"{args.cache}: format {manifest.format}, this compares zarr reads")
    names = [rec.name for rec in manifest.parts]
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.repeats):
        for direct in (True, False):
            seconds, nbytes = read_all(args.cache, names, layers, direct)
            best[direct] = min(best[direct], seconds)
    print(f"{args.cache}: {len(names)} parts, {nbytes / 1e6:,.1f} MB of payload, layers "
          f"{'all' if layers is None else layers}, one thread, best of {args.repeats}")  # fmt: skip
    for direct, label in ((True, "direct shard reads"), (False, "through zarr")):
        print(f"  {label:20s} {nbytes / best[direct] / 1e9:.3f} GB/s ({best[direct]:.2f} s)")
    print(f"  direct / zarr: {best[False] / best[True]:.2f}x")


if __name__ == "__main__":
    main()
