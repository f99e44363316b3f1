"""How full extraction's packed rows are, by count: the long-tailed mix of `bench/e2e_gpu.py`
packed part by part as `python -m extract` packs it, in rows of one size against the sizes of
`extract.packing.row_sizes` (a row filling no more than a half or a quarter runs at that size);
and how much of the attention's work flex_attention computes is masked out: the query-key pairs
of the blocks the document mask visits (`extract.packed_attention.document_block_mask`, blocks
of `--mask-blocks` tokens) against the samples' causal pairs.

    python bench/packing_fill.py [--tokens 1000000 250000] [--batch-tokens 16384]

No model and no device: a count of the tokens the target's forward computes (real + padding).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e_inputs import long_tailed_lengths  # noqa: E402

from extract.batching import length_order  # noqa: E402
from extract.packing import chunk_size, fitting_size, pack_rows, row_sizes  # noqa: E402


def visited_pairs(fills: list[list[int]], sizes: tuple[int, ...], block: int) -> int:
    """Query-key pairs in the blocks the document mask visits, over packed rows whose samples
    have the lengths `fills` (each row at the smallest of `sizes` that holds it; its pad tail
    one more document, as `extract.packing.packed_inputs` makes it)."""
    total = 0
    for row in fills:
        n = fitting_size(sizes, sum(row))
        doc_N = np.repeat(np.arange(len(row) + 1), [*row, n - sum(row)])
        first, last = doc_N[::block], doc_N[block - 1 :: block]
        q = np.arange(len(first))
        visible = (q[None, :] <= q[:, None]) & (last[None, :] >= first[:, None])
        total += int(visible.sum()) * block * block
    return total


def slots(
    lengths: list[int], *, chunk: int, rows_per_part: int
) -> tuple[int, int, list[int], list[list[int]]]:
    """(slots with one row size, slots with row_sizes, each part's last row's fill, every
    row's sample lengths)."""
    sizes, one, several, last, rows = row_sizes(chunk), 0, 0, [], []
    for u in range(0, len(lengths), rows_per_part):
        part = lengths[u : u + rows_per_part]
        part = [part[i] for i in length_order(part)]
        packed = [[part[i] for i in c] for c in pack_rows(part, chunk_tokens=chunk)]
        rows += packed
        fills = [sum(r) for r in packed]
        one += chunk * len(fills)
        several += sum(fitting_size(sizes, f) for f in fills)
        last.append(fills[-1])
    return one, several, last, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 300_000, 250_000])
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--rows-per-part", type=int, default=512)
    p.add_argument("--mask-blocks", type=int, nargs="+", default=[128, 64])
    args = p.parse_args()
    chunk = chunk_size(args.batch_tokens, args.max_length)
    print(f"rows of {chunk:,} tokens, then {row_sizes(chunk)[1:]}; parts of {args.rows_per_part}")
    for n in args.tokens:
        lengths = long_tailed_lengths(n, seed=0)
        real = sum(lengths)
        one, several, last, rows = slots(lengths, chunk=chunk, rows_per_part=args.rows_per_part)
        print(
            f"{real:,} tokens in {len(lengths):,} rows: {one:,} slots ({real / one:.1%} full) "
            f"against {several:,} ({real / several:.1%} full): {1 - several / one:.1%} fewer; "
            f"the parts' last rows held {', '.join(f'{f:,}' for f in last)} tokens"
        )
        causal = sum(n * (n + 1) // 2 for n in lengths)
        for block in args.mask_blocks:
            pairs = visited_pairs(rows, row_sizes(chunk), block)
            print(
                f"  attention in {block}-token mask blocks: {pairs:,} query-key pairs computed "
                f"for {causal:,} causal ones ({causal / pairs:.1%} of the work kept)"
            )


if __name__ == "__main__":
    main()
