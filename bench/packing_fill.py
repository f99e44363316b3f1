"""How full extraction's packed rows are, by count: the long-tailed mix of `bench/e2e_gpu.py`
packed part by part as `python -m extract` packs it, in rows of one size against the sizes of
`extract.packing.row_sizes` (a row filling no more than a half or a quarter runs at that size).

    python bench/packing_fill.py [--tokens 1000000 250000] [--batch-tokens 16384]

No model and no device: a count of the tokens the target's forward computes (real + padding).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e_inputs import long_tailed_lengths  # noqa: E402

from extract.batching import length_order  # noqa: E402
from extract.packing import chunk_size, fitting_size, pack_rows, row_sizes  # noqa: E402


def slots(lengths: list[int], *, chunk: int, rows_per_part: int) -> tuple[int, int, list[int]]:
    """(slots with one row size, slots with row_sizes, each part's last row's fill)."""
    sizes, one, several, last = row_sizes(chunk), 0, 0, []
    for u in range(0, len(lengths), rows_per_part):
        part = lengths[u : u + rows_per_part]
        part = [part[i] for i in length_order(part)]
        fills = [sum(part[i] for i in c) for c in pack_rows(part, chunk_tokens=chunk)]
        one += chunk * len(fills)
        several += sum(fitting_size(sizes, f) for f in fills)
        last.append(fills[-1])
    return one, several, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 300_000, 250_000])
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--rows-per-part", type=int, default=512)
    args = p.parse_args()
    chunk = chunk_size(args.batch_tokens, args.max_length)
    print(f"rows of {chunk:,} tokens, then {row_sizes(chunk)[1:]}; parts of {args.rows_per_part}")
    for n in args.tokens:
        lengths = long_tailed_lengths(n, seed=0)
        real = sum(lengths)
        one, several, last = slots(lengths, chunk=chunk, rows_per_part=args.rows_per_part)
        print(
            f"{real:,} tokens in {len(lengths):,} rows: {one:,} slots ({real / one:.1%} full) "
            f"against {several:,} ({real / several:.1%} full): {1 - several / one:.1%} fewer; "
            f"the parts' last rows held {', '.join(f'{f:,}' for f in last)} tokens"
        )


if __name__ == "__main__":
    main()
