"""Does one matmul over concatenated weights beat a decoder layer's separate projections?

For a packed row of `--tokens` tokens of a target shape, times (CUDA events, median of `--repeat`)
the q/k/v projections as three matmuls against one over [Wq; Wk; Wv], and gate/up as two against
one over [Wg; Wu] (also compiled with the SiLU product after it), and the o and down projections,
beside a bf16 8192^3 matmul measured in the same run as the ceiling (first alone, last 20 back
to back: a sustained load's clock). A GPU diagnostic for `extract.packed`'s compiled layers.

    python bench/gemm_fusion.py --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES  # noqa: E402


def _time(fn, repeat: int) -> float:
    """Median milliseconds of `fn()` over `repeat` timed runs after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    cfg = SHAPES[args.shape]
    d, hd = cfg["hidden_size"], cfg.get("head_dim", 128)
    nq, nkv, ff = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["intermediate_size"],
    )
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(args.tokens, d, device=dev, dtype=dt)

    def w(n: int, k: int = d) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=dt) / k**0.5

    a = torch.randn(8192, 8192, device=dev, dtype=dt)
    ceiling_ms = _time(lambda: a @ a, args.repeat)
    ceiling = 2 * 8192**3 / ceiling_ms / 1e9
    wq, wk, wv, wg, wu = w(nq), w(nkv), w(nkv), w(ff), w(ff)
    wo, wd = w(d, nq), w(d, ff)
    xo = torch.randn(args.tokens, nq, device=dev, dtype=dt)
    xd = torch.randn(args.tokens, ff, device=dev, dtype=dt)
    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])

    def mlp_apart(x):  # noqa: ANN001, ANN202
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    def mlp_fused(x):  # noqa: ANN001, ANN202
        g, u = F.linear(x, wgu).split(ff, dim=-1)
        return F.silu(g) * u

    cases = {
        "q, k, v apart": (
            lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
            nq + 2 * nkv,
        ),
        "q, k, v fused": (lambda: F.linear(x, wqkv), nq + 2 * nkv),
        "gate, up apart": (lambda: (F.linear(x, wg), F.linear(x, wu)), 2 * ff),
        "gate, up fused": (lambda: F.linear(x, wgu), 2 * ff),
        "o (K = heads x head_dim)": (lambda: F.linear(xo, wo), nq),
        "down (K = intermediate)": (lambda: F.linear(xd, wd), ff),
    }
    for name, fn in (("apart", mlp_apart), ("fused", mlp_fused)):
        compiled = torch.compile(fn, dynamic=False)
        cases[f"silu(gate) * up {name}, compiled"] = (lambda c=compiled: c(x), 2 * ff)
    print(f"{args.shape}: {args.tokens} tokens; ceiling {ceiling:.0f} TFLOP/s (bf16 8192^3)")
    for name, (fn, n) in cases.items():
        ms = _time(fn, args.repeat)
        tflops = 2 * args.tokens * d * n / ms / 1e9
        print(f"{name:34s} {ms:7.3f} ms  {tflops:5.0f} TFLOP/s  {tflops / ceiling:.3f} of ceiling")
    sustained_ms = _time(lambda: [a @ a for _ in range(20)], args.repeat) / 20
    print(f"ceiling again, 20 back to back: {2 * 8192**3 / sustained_ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
