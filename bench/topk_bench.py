"""DFlash2's top-K over the vocabulary: torch.topk against train.drafters.topk.block_topk.

    python bench/topk_bench.py [--rows 2048] [--vocab 151936] [--k 16] [--json PATH]

The fused selector loss (train/drafters/dflash2_fused.py) takes the top-K of every row of a chunk of
logits [rows, V] (rows = --ce-chunk-blocks x (block size - 1)). Times one torch.topk (aten's
radix select), `block_topk` with each block width that divides V (its default and the others
train.drafters.topk could take), on random bf16 rows: the median of --repeats
(`speculate_bench.median_ms`, a synchronised clock). Checks every variant returns the plain
topk's values; prints ms per call and the ratio to the plain topk.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculate_bench import median_ms  # noqa: E402

import train.drafters.topk  # noqa: E402


def blocks(x: torch.Tensor, k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_topk` with blocks of `width` columns."""
    saved, train.drafters.topk.BLOCK_WIDTHS = train.drafters.topk.BLOCK_WIDTHS, (width,)
    try:
        return train.drafters.topk.block_topk(x, k)
    finally:
        train.drafters.topk.BLOCK_WIDTHS = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    x = torch.randn(args.rows, args.vocab, device=device).to(torch.bfloat16)

    def timed(fn) -> float:  # noqa: ANN001
        return median_ms(fn, lambda: None, device=device, warmup=2, repeats=args.repeats)

    plain_values = x.topk(args.k, dim=-1).values
    default_width = train.drafters.topk.block_width(args.vocab, args.k)
    variants = {"torch.topk": lambda: x.topk(args.k, dim=-1)}
    for width in (32, 64, 128, 256, 512):
        if train.drafters.topk.block_width(args.vocab, args.k, (width,)) == width:
            name = f"blocks of {width}" + (" (default)" if width == default_width else "")
            variants[name] = functools.partial(blocks, x, args.k, width)
    rows = []
    for name, fn in variants.items():
        if not torch.equal(fn()[0], plain_values):
            raise SystemExit(f"{name} changed the top-{args.k} values")
        rows.append({"variant": name, "ms": timed(fn)})
    base = rows[0]["ms"]
    print(f"top-{args.k} of [{args.rows}, {args.vocab}] bf16 on {device}:")
    for r in rows:
        print(f"  {r['variant']:<24} {r['ms']:8.3f} ms  {r['ms'] / base:6.3f}")
    result = {
        "rows": args.rows,
        "vocab": args.vocab,
        "k": args.k,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "variants": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
