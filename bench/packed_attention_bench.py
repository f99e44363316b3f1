"""Attention over one packed row, kernel by kernel, side by side in one process.

    python bench/packed_attention_bench.py [--heads 32] [--kv-heads 8] [--head-dim 128]

The queries, keys and values of a packed row of 16,384 tokens holding the long-tailed mix of
`bench/e2e_gpu.py` (whole samples, first fit decreasing), bf16, random. Times per packed row:
- flex: `extract.packed_attention`'s flex_attention with the document BlockMask, compiled, with
  Inductor's default kernel options and each candidate of CANDIDATES;
- fa2 / cudnn varlen: aten's FlashAttention-2 and cuDNN varlen kernels on the same segments
  (cu_seqlens; also with a fixed segment count and the row's length as the longest);
- groups: `extract.packed_attention.grouped_attention`, the samples gathered into padded batches
  for sdpa and scattered back (what `python -m extract --attention sdpa` runs);
- sdpa padded: the samples of the row as padded batches, as eager extraction runs them
  (cuDNN / flash through scaled_dot_product_attention, causal).
Prints ms per row, TFLOP/s by count (causal pairs only) and each one's largest difference
from flex's output. A diagnostic of the forward's attention share, not a goal figure.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e_inputs import long_tailed_lengths  # noqa: E402

from extract.batching import length_order, make_batches  # noqa: E402
from extract.packed_attention import document_block_mask, document_mask_mod  # noqa: E402
from extract.packing import pack_rows, packed_inputs  # noqa: E402

CANDIDATES = [
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"USE_TMA": True},
    {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "USE_TMA": True},
    {"BACKEND": "FLASH"},  # flash-attention 4's CuTeDSL kernels (the flash-attn-4 package)
]
# Over a BlockMask without full blocks, whose key blocks are one run per query block (what
# BLOCKS_ARE_CONTIGUOUS needs; with full blocks a sample's partial blocks need not be adjacent).
_SAFE = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True}
_B64 = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
CANDIDATES_RUNS = [{}, _SAFE, _SAFE | _B64]
# The same candidates over a BlockMask of 64-token blocks (less masked work computed at the
# samples' edges; the kernel's blocks at most 64).
CANDIDATES_64 = [
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": True},
]


def timed(fn, reps: int = 10) -> float:  # noqa: ANN001
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16384)
    args = p.parse_args()
    dev, n = torch.device("cuda"), args.chunk
    lengths = long_tailed_lengths(200_000, seed=0)[:512]
    lengths = [lengths[i] for i in length_order(lengths)]
    chunks = pack_rows(lengths, chunk_tokens=n)
    # a typical row: the median count of samples (the first rows hold the longest, block-aligned
    # samples of 3,072 tokens; a typical row has samples across block edges)
    chunk = sorted(chunks[:-1], key=len)[len(chunks) // 2]
    rows = [np.zeros(lengths[i], np.int64) for i in chunk]
    packed = packed_inputs(rows, chunk_tokens=n, pad_id=0)
    doc = torch.from_numpy(packed.doc_ids.astype(np.int64)).to(dev)
    cu = torch.from_numpy(packed.cu_seqlens).to(dev, torch.int32)
    seg = np.diff(packed.cu_seqlens)
    pairs = float(sum(k * (k + 1) / 2 for k in seg))
    flops = 4.0 * args.heads * args.head_dim * pairs
    gen = torch.Generator(dev).manual_seed(0)
    shape = lambda h: (1, h, n, args.head_dim)  # noqa: E731
    q = torch.randn(shape(args.heads), device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(shape(args.kv_heads), device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape(args.kv_heads), device=dev, dtype=torch.bfloat16, generator=gen)
    mask = document_block_mask(doc, document_mask_mod(doc))
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 64  # a graph per candidate, none falling back to eager
    flex = torch.compile(flex_attention, dynamic=False)
    print(f"one packed row: {len(seg)} segments of {seg.min()}..{seg.max()} tokens")
    ref = flex(q, k, v, block_mask=mask, enable_gqa=True)
    results = [
        (
            "flex, Inductor's options",
            timed(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True)),
            ref,
        )
    ]
    mask64 = document_block_mask(doc, document_mask_mod(doc), block_size=64)
    tried = [(opts, mask, "") for opts in CANDIDATES]
    tried += [(opts, mask64, "mask 64, ") for opts in CANDIDATES_64]
    runs = document_block_mask(doc, document_mask_mod(doc), full_blocks=False)  # one run each
    tried += [(opts, runs, "no full blocks, ") for opts in CANDIDATES_RUNS]
    for opts, m, tag in tried:
        try:
            fn = lambda o=opts, m=m: flex(q, k, v, block_mask=m, enable_gqa=True, kernel_options=o)  # noqa: E731
            results.append((f"flex {tag}{opts}", timed(fn), fn()))
        except Exception as e:  # a configuration the kernel rejects
            print(f"flex {tag}{opts}: {type(e).__name__}: {str(e)[:600]}")
    # The same through flash-attention 4 with the inputs laid out token by token ([B, N, H, D]
    # in memory, as a model's projections make them and as its kernels read them).
    q_t, k_t, v_t = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    try:
        o = {"BACKEND": "FLASH"}
        fn = lambda: flex(q_t, k_t, v_t, block_mask=mask, enable_gqa=True, kernel_options=o)  # noqa: E731
        results.append((f"flex {o}, token-major inputs", timed(fn), fn()))
    except Exception as e:
        print(f"flex FLASH, token-major inputs: {type(e).__name__}: {str(e)[:600]}")
    qt, kt, vt = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # [T, H, D]

    # aten's FlashAttention-2 and cuDNN's varlen kernels (cuDNN's is the one nested tensors
    # reach through sdpa): [T, H, D] with cu_seqlens, as they are and with cu_seqlens padded to
    # a fixed count by empty segments and the row's length as the longest (what a graph
    # compiled once would pass); cuDNN with the kv heads repeated (nested sdpa's path) or
    # grouped as they are.
    group = args.heads // args.kv_heads
    fixed = torch.full((len(cu) + 64,), n, device=dev, dtype=torch.int32)
    fixed[: len(cu)] = cu

    def fa2(cu_q: torch.Tensor, longest: int) -> Callable:
        def run() -> torch.Tensor:
            out = torch.ops.aten._flash_attention_forward(
                qt, kt, vt, cu_q, cu_q, longest, longest, 0.0, True, False
            )[0]
            return out.transpose(0, 1)[None]

        return run

    def cudnn(kv_rep: bool, cu_q: torch.Tensor, longest: int) -> Callable:
        def run() -> torch.Tensor:
            kk, vv = kt, vt
            if kv_rep and group > 1:
                kk, vv = (x.repeat_interleave(group, dim=1) for x in (kt, vt))
            out = torch.ops.aten._cudnn_attention_forward(
                qt, kk, vv, None, cu_q, cu_q, longest, longest, False, 0.0, True, False
            )[0]
            return out.transpose(0, 1)[None]

        return run

    longest = int(seg.max())
    for name, fn in [
        ("fa2 varlen (aten)", fa2(cu, longest)),
        ("fa2 varlen, fixed segments and longest", fa2(fixed, n)),
        ("cudnn varlen, kv heads repeated", cudnn(True, cu, longest)),
        ("cudnn varlen, grouped kv heads", cudnn(False, cu, longest)),
        ("cudnn varlen, kv repeated, fixed segments and longest", cudnn(True, fixed, n)),
        ("cudnn varlen, grouped kv, fixed segments and longest", cudnn(False, fixed, n)),
    ]:
        try:
            results.append((name, timed(fn), fn()))
        except Exception as e:  # a kernel this build or GPU lacks
            print(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    from extract.packed_attention import SampleGroups, grouped_attention
    from extract.packing import sample_groups

    groups = SampleGroups(
        [
            tuple(torch.from_numpy(a).to(dev) for a in g)
            for g in sample_groups(list(seg[: len(chunk)]), packed.cu_seqlens[:-1], budget=n)
        ]
    )
    grouped = lambda: grouped_attention(q, k, v, groups, None).transpose(1, 2)  # noqa: E731
    out = grouped()[:, :, : packed.real]
    results.append(("groups (gather, sdpa per group, scatter)", timed(grouped), None))
    diff = (out.float() - ref[:, :, : packed.real].float()).abs().max().item()
    print(f"groups: max |diff| vs flex on real tokens {diff:.2e}")
    # eager extraction's padded batches: the row's samples, longest first, in batches of n
    batches = make_batches(list(seg[: len(chunk)]), batch_tokens=n)
    starts = packed.cu_seqlens

    padded_qk = []
    for b in batches:
        width = int(seg[b.start])
        qb = torch.zeros(len(b), args.heads, width, args.head_dim, device=dev, dtype=q.dtype)
        kb = torch.zeros(len(b), args.kv_heads, width, args.head_dim, device=dev, dtype=q.dtype)
        for j, i in enumerate(b):
            a, e = starts[i], starts[i + 1]
            qb[j, :, : e - a] = q[0, :, a:e]
            kb[j, :, : e - a] = k[0, :, a:e]
        padded_qk.append((qb, kb))

    def padded() -> None:
        for qb, kb in padded_qk:
            F.scaled_dot_product_attention(qb, kb, kb, is_causal=True, enable_gqa=True)

    results.append(("sdpa padded batches", timed(padded), None))
    for name, seconds, out in results:
        real = packed.real
        diff = (
            ""
            if out is None
            else "  max |diff| vs flex on real tokens "
            f"{(out[:, :, :real].float() - ref[:, :, :real].float()).abs().max().item():.2e}"
        )
        rate = flops / seconds / 1e12
        print(f"{name[:110]:110s} {seconds * 1e3:7.2f} ms  {rate:6.0f} TFLOP/s{diff}")


if __name__ == "__main__":
    main()
