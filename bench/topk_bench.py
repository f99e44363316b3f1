"""DFlash2's top-K over the vocabulary: one torch.topk against `segmented_topk`, side by side.

    python bench/topk_bench.py [--rows 2048] [--vocab 151936] [--k 16] [--json PATH]

The fused selector loss (train/selector_fused.py) takes the top-K of every row of a chunk of
logits [rows, V] (rows = --ce-chunk-blocks x (block size - 1)); Inductor leaves that topk to
aten. Times it, `segmented_topk` with each number of segments that divides V, and on CUDA with
Triton `train.topk_triton.row_topk` (a radix select, one program per row), on random bf16 rows
(the values do not change the work of a radix select much): the median of --repeats
(`speculate_bench.median_ms`, a synchronised clock). Checks every variant returns the plain
topk's values; prints ms per call and the ratio to the plain topk; `best_segments` in the JSON
is the fastest of torch.topk and the segmented ones (None: plain).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speculate_bench import median_ms  # noqa: E402

from train.selector_fused import segmented_topk  # noqa: E402
from train.topk_triton import available, row_topk  # noqa: E402


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
    rows = [{"segments": None, "ms": timed(lambda: x.topk(args.k, dim=-1))}]
    for s in (2**i for i in range(1, 12)):
        if args.vocab % s or args.vocab // s < args.k:
            continue
        values, _ = segmented_topk(x, args.k, s)
        if not torch.equal(values, plain_values):
            raise SystemExit(f"segmented_topk with {s} segments changed the top-{args.k} values")
        ms = timed(lambda s=s: segmented_topk(x, args.k, s))
        rows.append({"segments": s, "ms": ms})
    if available(x):  # CUDA with Triton (or Triton's interpreter)
        values, _ = row_topk(x, args.k)
        if not torch.equal(values, plain_values):
            raise SystemExit(f"train.topk_triton.row_topk changed the top-{args.k} values")
        ms = timed(lambda: row_topk(x, args.k))
        rows.append({"segments": None, "kernel": "triton", "ms": ms})
    base = rows[0]["ms"]
    print(f"top-{args.k} of [{args.rows}, {args.vocab}] bf16 on {device}:")
    for r in rows:
        name = "torch.topk" if r["segments"] is None else f"{r['segments']} segments"
        if r.get("kernel") == "triton":
            name = "triton radix"
        print(f"  {name:<14} {r['ms']:8.3f} ms  {r['ms'] / base:6.3f}")
    best = min((r for r in rows if "kernel" not in r), key=lambda r: r["ms"])
    result = {
        "rows": args.rows,
        "vocab": args.vocab,
        "k": args.k,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "variants": rows,
        "best_segments": best["segments"],  # among torch.topk and segmented_topk
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
