"""The part commit's checksum over a zarr part with thousands of shard files.

    python bench/checksum_bench.py --files 9000 --repeats 3 [--out DIR]

A default part (512 rows) of an 8B target holds about 9000 shard files. The commit thread
hashes each file's path and size and combines in the crc32c the writer took of its bytes
(`shared.checksum.part_checksum` with `known`), walking the folder once; that work is mostly Python
and holds the GIL, which the thread launching the forward pass then waits for. Builds a folder
of --files small files laid out like a part's shards (their real sizes are given as `known`, so
nothing is read back), then prints the median seconds of `part_checksum` and of 9000
`crc32c_combine` calls alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import crc32c

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.checksum import crc32c_combine, part_checksum  # noqa: E402
from shared.zarr_shards import shard_key  # noqa: E402


def make_part(root: Path, files: int) -> dict[str, tuple[int, int]]:
    """Shard-like files hidden/c.<i>.0.0; returns their (size, crc32c) by relative path."""
    rnd, known = random.Random(0), {}
    (root / "hidden").mkdir(parents=True)
    for i in range(files):
        data = rnd.randbytes(rnd.randint(100, 400))
        (root / shard_key(i)).write_bytes(data)
        known[shard_key(i)] = (len(data), crc32c.crc32c(data))
    return known


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--files", type=int, default=9000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder on the disk under test")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="checksum-bench-", dir=args.out))
    try:
        known = make_part(root, args.files)
        part_checksum(root, known)  # warm the directory cache
        checksum_s = median_seconds(lambda: part_checksum(root, known), args.repeats)
        sizes = [1_500_000 + 37 * i for i in range(args.files)]  # shard files are MBs
        combine_s = median_seconds(
            lambda: [crc32c_combine(12345, 678, n) for n in sizes], args.repeats
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res = {"bench": "checksum", "files": args.files, "part_checksum_s": checksum_s,
           "combine_s": combine_s, "cpus": os.cpu_count()}  # fmt: skip
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
