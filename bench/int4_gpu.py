"""The int4 store's encoder and decoder on one device: GB/s of bf16 states, and where the time goes.

    python bench/int4_gpu.py [--hidden 4096] [--tokens 16384] [--layers 5] [--profile]

One extraction forward's states ([layers x tokens, hidden] bf16, random normal with 1% of the
vectors holding one massive channel, as real targets' are) through `shared.int4.encode_int4`,
eager and compiled (the product's encoder on a GPU), then `decode_int4` of the records: the
median of 10 calls after 2 warm-ups, as milliseconds per forward's states and GB/s of bf16
input. `--profile`: the compiled encoder's kernels by device time (top 12). Random values:
real speed, not real errors (`bench/real_target.sh` measures those).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.int4 import Int4Scheme, decode_int4, encode_int4  # noqa: E402


def timed_ms(fn, device: torch.device, reps: int = 10) -> float:  # noqa: ANN001
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernels(fn, top: int = 12) -> list[tuple[str, float]]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    events.sort(key=lambda e: -e.device_time_total)
    return [(e.key[:90], e.device_time_total / total) for e in events[:top]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=16384, help="one forward's tokens")
    p.add_argument("--layers", type=int, default=5, help="captured layers")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/int4_gpu.py needs a GPU")
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    rows = args.layers * args.tokens
    h = torch.randn(rows, args.hidden, device=device, generator=g).to(torch.bfloat16)
    massive = torch.randperm(rows, device=device, generator=g)[: rows // 100]
    h[massive, 7] = 3e4
    scheme = Int4Scheme(hidden=args.hidden)
    gb = h.numel() * 2 / 1e9
    figures = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        figures[f"encode {name}"] = timed_ms(
            lambda compiled=compiled: encode_int4(h, scheme, compiled=compiled), device
        )
    records = encode_int4(h, scheme)
    figures["decode"] = timed_ms(lambda: decode_int4(records, scheme), device)
    where = torch.cuda.get_device_name()
    print(f"{rows:,} vectors of hidden {args.hidden} ({gb:.2f} GB of bf16) on {where}")
    for name, ms in figures.items():
        print(f"  {name:17s} {ms:8.2f} ms  {gb / ms * 1e3:7.1f} GB/s")
    if args.profile:
        print("compiled encoder, kernels by device time:")
        for name, share in kernels(lambda: encode_int4(h, scheme)):
            print(f"  {share:6.1%}  {name}")


if __name__ == "__main__":
    main()
