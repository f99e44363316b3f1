"""Drafter attention masks: one mask function, rendered dense (sdpa) or as a flex BlockMask.

Query index q in [0, Q) is block j = q // block_size at offset k = q % block_size with anchor
a = anchors[b, j]; key index kv in [0, S + Q) is context row kv when kv < S, else block token
kv - S. In a packed row, s = starts[b, j] is the first row of the anchor's sample: context keys
of other samples are never visible. Visibility:

- full layers: context s <= kv < a (inside the sample, strictly before the anchor), and every
  key of the same block;
- sliding layers (window W): context max(s, a + k - (W - 1)) <= kv < a, and same-block keys at
  offsets k' <= k with k - k' < W (causal inside the block);
- `causal` overrides the layer type's default inside the block (None: sliding causal, full
  bidirectional): True keeps same-block keys k' <= k, False all with |k - k'| < W (DFlash2's
  published drafters slide non-causally);
- dropped blocks (keep False) see no real key. A softmax over an empty row is NaN in sdpa, so a
  dropped query sees exactly its own key instead; its loss weight is zero, so nothing leaks.

Every query row therefore sees at least its own key (a kept block always sees itself), and no
NaN can reach the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

log = logging.getLogger(__name__)

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# The only process-level singletons allowed (STYLE.md 5): compiled kernels, built once.
_compiled_flex_attention: Callable[..., Any] | None = None
_compiled_create_block_mask: Callable[..., BlockMask] | None = None


def make_mask_mod(
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    context_len: int,
    block_size: int,
    layer_type: str,
    sliding_window: int | None,
    starts_BN: torch.Tensor | None = None,
    causal: bool | None = None,
) -> MaskMod:
    """The mask function `mask_mod(b, h, q_idx, kv_idx) -> bool` (flex signature, broadcasts).

    >>> anchors, keep = torch.tensor([[2]]), torch.tensor([[True]])
    >>> mod = make_mask_mod(anchors, keep, context_len=4, block_size=2,
    ...                     layer_type="full_attention", sliding_window=None)
    >>> mod(torch.tensor(0), torch.tensor(0), torch.arange(2)[:, None], torch.arange(6)).int()
    tensor([[1, 1, 0, 0, 1, 1],
            [1, 1, 0, 0, 1, 1]], dtype=torch.int32)
    """
    if layer_type not in ("full_attention", "sliding_attention"):
        raise ValueError(f"layer_type must be full_attention or sliding_attention: {layer_type!r}")
    sliding = layer_type == "sliding_attention"
    if sliding and (sliding_window is None or sliding_window <= 0):
        raise ValueError(f"sliding_window must be positive for sliding layers: {sliding_window}")
    window = sliding_window or 0
    causal = sliding if causal is None else causal
    # A tensor, not a Python int: a compiled mask builder would otherwise recompile per length.
    # Filled on the device: torch.tensor(x, device=gpu) copies from pageable memory, which makes
    # the host wait for the device in every step.
    ctx_len = torch.full((), context_len, dtype=torch.int64, device=anchors_BN.device)
    if starts_BN is None:
        starts_BN = torch.zeros_like(anchors_BN)

    def mask_mod(b, h, q_idx, kv_idx):
        j, k = q_idx // block_size, q_idx % block_size
        anchor, keep, start = anchors_BN[b, j], keep_BN[b, j], starts_BN[b, j]
        in_ctx = kv_idx < ctx_len
        blk_idx = kv_idx - ctx_len
        ctx_ok = in_ctx & (kv_idx >= start) & (kv_idx < anchor)
        blk_ok = ~in_ctx & (blk_idx // block_size == j)
        k_key = blk_idx % block_size
        if sliding:
            ctx_ok = ctx_ok & (kv_idx >= anchor + k - (window - 1))
            blk_ok = blk_ok & (k - k_key < window) & (k_key - k < window)
        if causal:
            blk_ok = blk_ok & (k_key <= k)
        own_key = ~keep & (blk_idx == q_idx)
        return (keep & (ctx_ok | blk_ok)) | own_key

    return mask_mod


def dense_mask(
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    context_len: int,
    block_size: int,
    layer_type: str,
    sliding_window: int | None,
    starts_BN: torch.Tensor | None = None,
    causal: bool | None = None,
) -> torch.Tensor:
    """Boolean sdpa mask [B, 1, Q, S + Q] (True = may attend) from the mask function."""
    mod = make_mask_mod(
        anchors_BN,
        keep_BN,
        context_len=context_len,
        block_size=block_size,
        layer_type=layer_type,
        sliding_window=sliding_window,
        starts_BN=starts_BN,
        causal=causal,
    )
    batch, n_blocks = anchors_BN.shape
    q_len = n_blocks * block_size
    dev = anchors_BN.device
    b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.int64, device=dev)
    q = torch.arange(q_len, device=dev).view(1, 1, q_len, 1)
    kv = torch.arange(context_len + q_len, device=dev).view(1, 1, 1, -1)
    return mod(b, h, q, kv).expand(batch, 1, q_len, context_len + q_len)


def flex_block_mask(
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    context_len: int,
    block_size: int,
    layer_type: str,
    sliding_window: int | None,
    starts_BN: torch.Tensor | None = None,
    causal: bool | None = None,
    compiled: bool = False,
) -> BlockMask:
    """flex_attention BlockMask built from the same mask function as `dense_mask`.

    `compiled` uses one `torch.compile(create_block_mask)` per process; training rows have
    one shape for the whole run, so it compiles once. The eager builder costs a few ms per call
    at training sizes; see `train.step.forward_loss` for the measured trade-off.
    """
    mod = make_mask_mod(
        anchors_BN,
        keep_BN,
        context_len=context_len,
        block_size=block_size,
        layer_type=layer_type,
        sliding_window=sliding_window,
        starts_BN=starts_BN,
        causal=causal,
    )
    batch, n_blocks = anchors_BN.shape
    q_len = n_blocks * block_size
    build = _get_compiled_create_block_mask() if compiled else create_block_mask
    return build(mod, batch, None, q_len, context_len + q_len, device=anchors_BN.device)


def build_masks(
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    context_len: int,
    block_size: int,
    layer_types: Sequence[str],
    sliding_window: int | None,
    attention: str,
    starts_BN: torch.Tensor | None = None,
    compiled: bool = False,
    causal: bool | None = None,
) -> dict[str, Any]:
    """One mask per distinct layer type, in the form `attention` ("sdpa" or "flex") needs;
    `starts_BN` (see `train.drafters.anchors.context_starts`) confines each block to its sample."""
    if attention not in ("sdpa", "flex"):
        raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
    masks: dict[str, Any] = {}
    for layer_type in dict.fromkeys(layer_types):
        kwargs = dict(
            context_len=context_len,
            block_size=block_size,
            layer_type=layer_type,
            sliding_window=sliding_window,
            starts_BN=starts_BN,
            causal=causal,
        )
        if attention == "sdpa":
            masks[layer_type] = dense_mask(anchors_BN, keep_BN, **kwargs)
        else:
            masks[layer_type] = flex_block_mask(anchors_BN, keep_BN, compiled=compiled, **kwargs)
    return masks


def _fail_on_recompile_limit() -> None:
    # A silent fallback to eager flex materialises [Q, S+Q] scores per head: make it an error.
    import torch._dynamo

    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        torch._dynamo.config.fail_on_recompile_limit_hit = True


def _get_compiled_create_block_mask() -> Callable[..., BlockMask]:
    global _compiled_create_block_mask
    if _compiled_create_block_mask is None:
        _fail_on_recompile_limit()
        log.info("compiling create_block_mask (once per process)")
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask


# flex_attention backward block sizes by head_dim on sm90 (H100/H200), where Inductor's default
# is slow: (M1, N1, M2, N2, warps, stages). head_dim 256 (Qwen3.6-27B shape, one drafter layer:
# 24 heads, 4 kv heads, 512 blocks of 16 over a 3072-token context): Inductor's (64, 64, 64, 64,
# 4 warps, 2 stages) took 10.5 ms for the backward, 8 warps 7.3 ms (0.70x), same gradients; the
# 27B drafter step went from 291.5 to 277.9 ms (one H200 of a two-GPU host, random weights;
# `python bench/flex_bench.py --shape qwen3.6-27b`, `bench/train_bench.py --shape qwen3.6-27b`,
# README Results). Others, head_dim 128 included (measured): Inductor's choice.
SM90_FLEX_BWD: dict[int, tuple[int, int, int, int, int, int]] = {256: (64, 64, 64, 64, 8, 2)}


def flex_kernel_options(head_dim: int, device: torch.device) -> dict[str, int] | None:
    """kernel_options for flex_attention on `device`: the measured backward block sizes where
    SM90_FLEX_BWD has them, else None (Inductor's own choice)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    blocks = SM90_FLEX_BWD.get(head_dim)
    return None if blocks is None else flex_bwd_options(blocks)


def flex_bwd_options(blocks: tuple[int, int, int, int, int, int]) -> dict[str, int]:
    """kernel_options fixing the backward kernel's (M1, N1, M2, N2, warps, stages)."""
    m1, n1, m2, n2, warps, stages = blocks
    return {
        "bwd_BLOCK_M1": m1,
        "bwd_BLOCK_N1": n1,
        "bwd_BLOCK_M2": m2,
        "bwd_BLOCK_N2": n2,
        "bwd_num_warps": warps,
        "bwd_num_stages": stages,
    }


def get_flex_attention(*, compiled: bool) -> Callable[..., Any]:
    """flex_attention, compiled once per process when `compiled` (eager is a slow reference)."""
    global _compiled_flex_attention
    if not compiled:
        return flex_attention
    if _compiled_flex_attention is None:
        _fail_on_recompile_limit()
        log.info("compiling flex_attention (once per process)")
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention
