"""The model FLOPs of a drafter training step and its MFU, for `bench/train_bench.py`.

Model FLOPs of one micro-batch (`step_flops`), 2 per multiply-add: fc on the context tokens;
per drafter layer the q/o projections and the SwiGLU MLP on the block tokens, the k/v
projections on context + block tokens, and attention (QK^T and PV) over the visible keys only:
per block query, the context keys before its anchor (the mean over the batch's anchor
candidates, which anchors are drawn uniformly from) plus the 16 keys of its block; lm_head on
the block tokens; for dflash2 also each layer's two convolutions (kernel_projection and the
per-channel taps) and the selector (hidden_projection and the rank-r scores of the K
candidates); for dspark also the Markov bias (W2 on the rank-r embedding of every block token),
the confidence head; for dspark and a --loss against the target's distribution the target's
lm_head on its last hidden state at the distinct rows each loss chunk reads (blocks overlap; the
step runs it once per distinct state of a chunk: `mean_target_rows`, the mean over draws of the
step's own anchor sampler; no gradient: counted once, forward only).
`mfu` = 3 x forward FLOPs / step time / 989 TFLOP/s (H200 dense bf16, datasheet);
`mfu_of_ceiling` the same against the bf16 8192^3 matmul measured in the same run
(`forward_modes.matmul_tflops`), what the device's matmuls reach in practice.
Activation-checkpoint recomputation is not counted. `mfu_needed` counts only the backward work
the step has to do: the frozen lm_head needs no weight gradient and fc no input gradient, so
those two count 2x instead of 3x.
"""

from __future__ import annotations

from typing import Any

import torch

from train.drafters.anchors import block_rows, sample_anchors
from train.drafters.config import DrafterConfig
from train.drafters.objective import TARGET_LOSSES
from train.drafters.target_rows import chunk_reads

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16, datasheet


def mean_context_keys(mask_S: torch.Tensor, *, anchors: int, block_size: int) -> float:
    """Mean keys a block query sees: context before its anchor plus its block (kept blocks);
    a dropped block (fewer candidates than anchors) sees only itself."""
    mask_S = mask_S.bool()
    cand = torch.nonzero(mask_S[:-1] & mask_S[1:]).flatten().double()
    blocks = min(anchors, mask_S.numel())
    kept = min(blocks, cand.numel())
    seen = kept * (float(cand.mean()) + block_size) if kept else 0.0
    return (seen + (blocks - kept)) / blocks


def mean_target_rows(
    mask_BS: torch.Tensor,
    *,
    anchors: int,
    block_size: int,
    chunk_rows: int,
    shift: int,
    draws: int = 16,
) -> float:
    """Mean rows of the target's lm_head in a micro-batch of one sample per row: per loss chunk
    of `chunk_rows` slots, the distinct rows its blocks read (a + k - 1 + shift, as the step),
    over `draws` draws of the step's anchor sampler.

    >>> mask = torch.ones(1, 4, dtype=torch.uint8)  # anchors 0, 1, 2: blocks 0-1, 1-2, 2-3
    >>> [mean_target_rows(mask, anchors=3, block_size=2, chunk_rows=c, shift=1) for c in (6, 2)]
    [4.0, 6.0]
    """
    gen = torch.Generator().manual_seed(0)
    doc_ids_BS = torch.zeros_like(mask_BS, dtype=torch.long)
    seq = mask_BS.shape[1]
    total = 0
    for _ in range(draws):
        anchors_BN, _ = sample_anchors(mask_BS, doc_ids_BS, num_anchors=anchors, generator=gen)
        rows_BQ = block_rows(anchors_BN - 1 + shift, block_size=block_size).clamp(0, seq - 1)
        index_N = (rows_BQ + seq * torch.arange(rows_BQ.shape[0])[:, None]).flatten()
        total += sum(u.numel() for u, _ in chunk_reads(index_N, mask_BS.numel(), chunk_rows))
    return total / draws


def step_flops(
    cfg: DrafterConfig,
    *,
    batch: int,
    seq_len: int,
    anchors: int,
    keys_per_query: float,
    loss: str = "ce",
    target_rows: float | None = None,
) -> dict[str, float]:
    """Forward FLOPs of one micro-batch by part (see the module docstring); `target_rows` the
    rows of the target's lm_head (`mean_target_rows`; None: one per block slot)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    ctx = batch * seq_len
    blk = batch * min(anchors, seq_len) * cfg.block_size  # sample_anchors' N = min(anchors, S)
    per_layer = {
        "q_o_proj": 2 * 2 * blk * h * q_dim,
        "k_v_proj": 2 * 2 * (ctx + blk) * h * kv_dim,
        "mlp": 2 * 3 * blk * h * cfg.intermediate_size,
        "attention": 2 * 2 * blk * keys_per_query * q_dim,
    }
    if cfg.drafter_type == "dflash2":
        # Two convolutions per layer: kernel_projection (H -> 2kG), and per side and tap a
        # multiply-add of (base + dynamic) kernel and input per channel.
        taps, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
        per_layer["conv"] = 2 * (2 * blk * h * 2 * taps * groups + 2 * taps * 3 * blk * h)
    out = {k: cfg.num_layers * v for k, v in per_layer.items()}
    out["fc"] = 2 * ctx * cfg.num_context_layers * h * h
    out["lm_head"] = 2 * blk * h * cfg.vocab_size
    if cfg.drafter_type == "dflash2":
        # hidden_projection, the predecessor product and the K candidates' rank-r dot products.
        r = cfg.selector_rank
        out["selector"] = 2 * blk * h * r + blk * r + 2 * blk * cfg.selector_top_k * r
    if cfg.drafter_type == "dspark":
        r = cfg.markov_rank
        out["markov"] = 2 * blk * r * cfg.vocab_size
        out["confidence"] = 2 * blk * (h + r) if cfg.enable_confidence_head else 0
    if cfg.drafter_type == "dspark" or loss in TARGET_LOSSES:
        rows = blk if target_rows is None else target_rows
        out["target_lm_head"] = 2 * rows * h * cfg.vocab_size  # forward only
    return out


def flops_summary(
    flops: dict[str, float], step_s: float, *, tokens: int, ceiling_tflops: float | None = None
) -> dict[str, Any]:
    """Throughput and MFU of a step of `step_s` seconds with forward FLOPs `flops`, against the
    datasheet peak and, given `ceiling_tflops`, against a matmul measured in the same run."""
    forward = sum(flops.values())
    target_head = flops.get("target_lm_head", 0.0)  # no gradient at all: once, not 3x
    done = 3 * forward - 2 * target_head
    needed = done - flops["lm_head"] - flops["fc"]
    return {
        "context_tok_s": tokens / step_s,
        "forward_gflop": {k: round(v / 1e9, 3) for k, v in flops.items()},
        "tflops": done / step_s / 1e12,
        "mfu": done / step_s / PEAK_BF16_FLOPS,
        "tflops_needed": needed / step_s / 1e12,
        "mfu_needed": needed / step_s / PEAK_BF16_FLOPS,
        **(
            {
                "ceiling_tflops": ceiling_tflops,
                "mfu_of_ceiling": done / step_s / (ceiling_tflops * 1e12),
                "mfu_needed_of_ceiling": needed / step_s / (ceiling_tflops * 1e12),
            }
            if ceiling_tflops
            else {}
        ),
    }
