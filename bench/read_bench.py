"""Reading and tokenizing one work unit of extraction, with and without the row index.

    python bench/read_bench.py --copies 200 --rows-per-part 128

Writes a JSONL file of `--copies` copies of the shipped demo chats (480 rows each) under --out,
builds the row index once (`extract.data.index_rows`, as `python -m extract` does), and times
reading + tokenizing (the embedded tiny target's tokenizer and chat template) the first unit and
the last unit of `--rows-per-part` rows: with the index (the reader seeks near the unit) and
without it (every line before the unit is read first). This is the work extraction's reader
thread does for each part while the device runs the previous one. The demo rows are short and
the tiny tokenizer is small: real chats and a 150K-token BPE cost more per row. Also times
opening the unit's zarr part (its folder and metadata; the reader thread does that too). CPU
only, one thread: on a GPU host the writer threads compete for the GIL.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoTokenizer  # noqa: E402

from extract.data import Tokenized, index_rows, iter_rows  # noqa: E402
from extract.tiny import tiny_target  # noqa: E402
from shared.cache import open_part_writer  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "extract" / "data" / "demo.jsonl"


def time_unit(files, tokenizer, rows: range, index, repeats: int) -> float:
    """Median seconds to read and tokenize `rows`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        items = list(iter_rows(files, tokenizer, max_length=3072, rows=rows, index=index))
        times.append(time.perf_counter() - start)
        assert len(items) == len(rows)
    return sorted(times)[len(times) // 2]


def time_open(out: Path, kept: list[Tokenized], repeats: int) -> float:
    """Median seconds to open a zarr part for `kept` (Qwen3-8B shape: 5 layers of 4096)."""
    times = []
    for unit in range(repeats):
        start = time.perf_counter()
        open_part_writer(
            out,
            unit,
            fmt="zarr",
            store="bf16",
            num_layers=5,
            hidden_size=4096,
            lengths=[len(k.input_ids) for k in kept],
        )
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--copies", type=int, default=200, help="copies of the 480 demo rows")
    p.add_argument("--rows-per-part", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="scratch folder (default: a temp one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(dir=args.out))
    try:
        data = work / "chats.jsonl"
        demo = DEMO.read_bytes()
        with open(data, "wb") as f:
            for _ in range(args.copies):
                f.write(demo)
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_target()))
        start = time.perf_counter()
        index = index_rows([data])
        index_s = time.perf_counter() - start
        total = index.counts[0]
        units = {
            "first": range(0, args.rows_per_part),
            "last": range(total - args.rows_per_part, total),
        }
        res = {
            "bench": "read",
            "rows": total,
            "file_MB": data.stat().st_size / 1e6,
            "rows_per_part": args.rows_per_part,
            "index_s": index_s,
        }
        for name, rows in units.items():
            for how, idx in (("index", index), ("scan", None)):
                res[f"{name}_unit_{how}_s"] = time_unit([data], tokenizer, rows, idx, args.repeats)
        kept = list(iter_rows([data], tokenizer, max_length=3072, rows=units["first"]))
        res["open_part_s"] = time_open(work / "cache", kept, max(args.repeats, 5))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res))
    print(
        f"{total:,} rows ({res['file_MB']:.0f} MB), index built in {index_s:.2f} s; one unit of "
        f"{args.rows_per_part} rows read and tokenized: first {res['first_unit_index_s']:.3f} s; "
        f"last {res['last_unit_index_s']:.3f} s with the index, {res['last_unit_scan_s']:.3f} s "
        f"reading every line before it; opening its zarr part {res['open_part_s']:.3f} s"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
