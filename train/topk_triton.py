"""The top-K of each row of a bf16 matrix by radix selection in one Triton program per row.

DFlash2's fused selector loss takes the top-K of every row of a chunk of logits [rows, V]
(train/selector_fused.py); aten's topk took 2.29 ms for 2048 x 151,936 bf16 on an H200
(bench/topk_bench.py), about 5% of an 8B DFlash2 step. Here each row is read three times, 16
bits a value and nothing written but the K results:

1. a histogram of the high byte of each value's order-preserving key finds the byte of the K-th
   largest value, and how many values lie above that byte;
2. a histogram of the low byte among the values with that high byte finds the K-th largest
   key itself (T) and how many keys are greater;
3. the keys greater than T, then the first keys equal to T by index up to K in all, are
   gathered by prefix sums into the K output slots.

The K values are then sorted, largest first (stable: among equal values the lower index first).
Measured on an H200 (2026-12-02, bench/topk_bench.py): 4.31 ms against aten's 2.35 ms for
2048 x 151,936, so it is not the default (train.selector_fused.TOPK_KERNEL).
The values equal aten's `topk` exactly; among equal values the ids may differ (aten's choice
among ties is unspecified). `row_topk` is a custom op, so `torch.compile` keeps it whole; off
CUDA, without Triton, or for another dtype it is aten's topk. Set TRITON_INTERPRET=1 to run
the kernel on a CPU (tests/test_topk_triton.py).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only torch build comes without Triton
    triton = None

# Values per tile of the row loop (a power of two).
BLOCK = 2048


def available(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for `x`: bf16 rows and Triton, on CUDA (or in Triton's
    interpreter, TRITON_INTERPRET=1, on any device)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return (
        triton is not None
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and (x.is_cuda or interpreted)
    )


if triton is not None:

    @triton.jit
    def _keys(bits):
        """bf16 bit patterns (int16) -> keys in [0, 65536) ordered as the values are."""
        b = bits.to(tl.int32)  # sign-extended
        return (b ^ ((b >> 15) & 0x7FFF)) + 32768

    @triton.jit
    def _kth_bin(hist, need):
        """(the bin of the need-th largest key, the count of keys in bins above it) from a
        256-bin histogram of key bytes."""
        from_top = tl.cumsum(tl.flip(hist, 0), 0)
        below = tl.sum((from_top < need).to(tl.int32), 0)
        above = tl.max(tl.where(from_top < need, from_top, 0), 0)
        return 255 - below, above

    @triton.jit
    def _row_topk_kernel(
        x_ptr, stride, bits_ptr, ids_ptr, V: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        # 1: the high byte of the K-th largest key
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            u = _keys(tl.load(base + idx, mask=idx < V, other=0))
            hist += tl.histogram(u >> 8, 256, mask=idx < V)
        high, above_high = _kth_bin(hist, K)
        # 2: its low byte, among the keys with that high byte
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            u = _keys(tl.load(base + idx, mask=idx < V, other=0))
            hist += tl.histogram(u & 255, 256, mask=(idx < V) & ((u >> 8) == high))
        low, above_low = _kth_bin(hist, K - above_high)
        threshold = high * 256 + low
        greater = above_high + above_low  # keys > threshold: fewer than K
        # 3: gather the keys above the threshold, then the first equal ones, into K slots
        out = row * K
        n_gt = 0
        n_eq = 0
        for start in range(0, V, BLOCK):
            idx = start + offs
            bits = tl.load(base + idx, mask=idx < V, other=0)
            u = _keys(bits)
            gt = (idx < V) & (u > threshold)
            eq = (idx < V) & (u == threshold)
            slot_gt = n_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
            slot_eq = greater + n_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
            slot = tl.where(gt, slot_gt, slot_eq)
            keep = gt | (eq & (slot_eq < K))
            tl.store(bits_ptr + out + slot, bits, mask=keep)
            tl.store(ids_ptr + out + slot, idx.to(tl.int64), mask=keep)
            n_gt += tl.sum(gt.to(tl.int32), 0)
            n_eq += tl.sum(eq.to(tl.int32), 0)


@torch.library.custom_op("dflash_offline::row_topk", mutates_args=())
def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of each row of x [n, V], largest first."""
    if not available(x) or not 1 <= k <= x.shape[1]:
        values, ids = x.topk(k, dim=-1)
        return values, ids
    x = x.contiguous()
    n, vocab = x.shape
    bits = torch.empty(n, k, dtype=torch.int16, device=x.device)
    ids = torch.empty(n, k, dtype=torch.long, device=x.device)
    if n:
        _row_topk_kernel[(n,)](
            x.view(torch.int16), x.stride(0), bits, ids, V=vocab, K=k, BLOCK=BLOCK, num_warps=8
        )
    values, order = bits.view(torch.bfloat16).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


@row_topk.register_fake
def _(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.long)
