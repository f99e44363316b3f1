"""Attention confined to each sample of a packed row: the masks, and the attention function the
target's own attention modules call.

Queries and keys of one packed row carry document ids (`extract.packing`); a query sees the keys
of its own document at or before it. On a GPU the mask is a flex_attention BlockMask built from
the documents' block extents with a few tensor operations (no [N, N] mask is ever made); on a
CPU, a dense boolean mask for sdpa (the reference the tests compare flex with). The function is
registered with transformers' AttentionInterface under PACKED_ATTENTION, so the model's own
attention modules (projections, norms, RoPE, output gates) run unchanged around it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from extract.packing import CHUNK_MULTIPLE

PACKED_ATTENTION = "dflash_packed"
# The document BlockMask lists the blocks every pair of which is visible apart, as full blocks
# (the mask function skipped there), with Inductor's choice of flex_attention's kernel options.
# Measured against (bench/forward_modes.py, README "Stage one at the GPU's speed"): no full
# blocks, so that each query block's key blocks are one run and the kernel steps through them
# without an indirect jump (BLOCKS_ARE_CONTIGUOUS, valid only without full blocks): 0.985 of
# this through the whole forward, the mask function running on every block.
# ROWS_GUARANTEED_SAFE is wrong for document masks: the kernel reads it as "every key block it
# visits shows each query a key", which the first block of a query block's keys does not for
# its later samples (NaN).
MASK_FULL_BLOCKS = True
MASK_BLOCK = CHUNK_MULTIPLE
FLEX_OPTIONS: dict = {}
_Q_BLOCKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def document_mask_mod(doc_ids_N: torch.Tensor) -> Callable:
    """flex_attention's mask function: same document, causal. It reads `doc_ids_N` when the
    kernel runs, so one function serves every packed row whose ids are copied into that tensor
    (a new function per row would be a new graph under torch.compile)."""

    def mask_mod(b, h, q, kv):  # noqa: ANN001, ANN202
        return (doc_ids_N[q] == doc_ids_N[kv]) & (q >= kv)

    return mask_mod


def document_block_mask(
    doc_ids_N: torch.Tensor,
    mask_mod: Callable,
    *,
    block_size: int | None = None,
    full_blocks: bool | None = None,
) -> BlockMask:
    """The BlockMask of `mask_mod` over non-decreasing document ids, from block extents alone.

    Block j of keys can hold a visible key for block i of queries iff j <= i and its last
    document reaches the first document of block i: one run of key blocks per query block, as
    the ids never decrease. With `full_blocks` (default MASK_FULL_BLOCKS), the blocks whose
    every pair is visible (j < i, both blocks inside one document) are listed apart as full
    ones (the mask function skipped), which splits a query block's partial ones into two runs.
    `block_size` defaults to MASK_BLOCK.

    >>> doc = torch.tensor([0] * 3 + [1] * 3 + [2] * 2)
    >>> bm = document_block_mask(doc, document_mask_mod(doc), block_size=2)
    >>> bm.to_dense()[0, 0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]
    >>> doc = torch.tensor([0] * 5 + [1] * 3)
    >>> for full in (True, False):
    ...     bm = document_block_mask(doc, document_mask_mod(doc), block_size=2, full_blocks=full)
    ...     print(bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks is not None)
    [1, 1, 3, 2] True
    [1, 2, 3, 2] False
    """
    block_size = block_size or MASK_BLOCK
    n = doc_ids_N.numel()
    if n % block_size:
        raise ValueError(f"{n} tokens are not a whole number of {block_size}-token blocks")
    blocks = doc_ids_N.view(n // block_size, block_size)
    first, last = blocks[:, 0], blocks[:, -1]
    q = torch.arange(len(first), device=doc_ids_N.device)
    below = q[None, :] < q[:, None]  # [query block, key block]
    visible = (below | (q[None, :] == q[:, None])) & (last[None, :] >= first[:, None])
    single = first == last
    extra = {"compute_q_blocks": False} if _Q_BLOCKS else {}
    if not (MASK_FULL_BLOCKS if full_blocks is None else full_blocks):
        return BlockMask.from_kv_blocks(
            *_kv_blocks(visible), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(n, n),
            **extra,
        )  # fmt: skip
    full = below & single[:, None] & single[None, :] & (first[None, :] == first[:, None])
    partial = visible & ~full
    return BlockMask.from_kv_blocks(
        *_kv_blocks(partial),
        *_kv_blocks(full),
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(n, n),
        **extra,
    )


def _kv_blocks(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count [1, 1, Q], indices [1, 1, Q, K]) of the chosen key blocks per query block, the
    chosen ones first in key order."""
    count = chosen.sum(-1, dtype=torch.int32)
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[None, None], order[None, None]


def dense_document_mask(doc_ids_N: torch.Tensor) -> torch.Tensor:
    """The same mask as a boolean [1, 1, N, N] tensor, for sdpa (True: visible).

    >>> dense_document_mask(torch.tensor([0, 0, 1]))[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    same = doc_ids_N[:, None] == doc_ids_N[None, :]
    return torch.tril(same)[None, None]


@dataclass
class SampleGroups:
    """The current packed row's samples as padded batches (`extract.packing.sample_groups`, on
    the device): what `grouped_attention` reads. One object per layout, refilled per row, so a
    compiled layer sees the same object every call."""

    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@torch.compiler.disable
def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    groups: SampleGroups,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of each sample of a packed row, run as padded batches through sdpa
    (cuDNN's or FlashAttention's kernels on a GPU): q [1, Hq, N, D] -> [1, N, Hq, D]. Tokens of
    no batch (the row's pad tail) get zeros. Shapes change with every row: outside the graph."""
    q_N, k_N, v_N = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D] views
    out = torch.zeros_like(q_N)
    gqa = q_N.shape[1] != k_N.shape[1]
    for index_BW, src, dst in groups.groups:
        batch = [t[index_BW].transpose(1, 2) for t in (q_N, k_N, v_N)]  # [B, H, W, D]
        o = F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(-1, *out.shape[1:])
        out.index_copy_(0, dst, o.index_select(0, src))
    return out[None]


# `--attention flash`: flex_attention through flash-attention 4's CuTeDSL kernels (Inductor's FLASH
# backend, where the flash-attn-4 package is installed), on NVIDIA Hopper and Blackwell GPUs.
FLASH_OPTIONS = {"BACKEND": "FLASH"}


def flash_unavailable() -> str | None:
    """None where `--attention flash` can run here (flash-attention 4 imports, a GPU seen), else
    why not and what to do. The package is imported, not only found: its kernels need CUTLASS's
    CuTeDSL (nvidia-cutlass-dsl), which an install without its dependencies lacks. A GPU too old
    for its kernels fails the layout's probe, which then says so and runs padded batches."""
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError as e:
        if e.name in ("flash_attn", "flash_attn.cute"):
            return "flash-attention 4's kernels are not installed (pip install flash-attn-4)"
        return (
            f"flash-attention 4 is installed but does not import ({type(e).__name__}: {e}): "
            "install flash-attn-4 again with its dependencies (nvidia-cutlass-dsl among them)"
        )
    if not torch.cuda.is_available():
        return "it runs on NVIDIA GPUs (Hopper, Blackwell) and none is seen here"
    return None


@functools.cache
def _compiled_flex() -> Callable:
    """flex_attention compiled once per process, for packed rows run outside a compiled layer
    (uncompiled, flex materializes the whole score matrix)."""
    return torch.compile(flex_attention, dynamic=False)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [B, Hq, N, D], k/v [B, Hkv, N, D] ->
    ([B, N, Hq, D], None). The mask is a BlockMask (flex) or a boolean tensor (sdpa); or the
    model's forward was given `sample_groups` (a SampleGroups, passed down to here by
    transformers with the other keyword arguments) and the mask is None. `flash=True` among
    those keyword arguments: flex_attention's FLASH backend (`--attention flash`)."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("packed rows support plain causal attention only")
    gqa = query.shape[1] != key.shape[1]
    groups = kwargs.get("sample_groups")
    if groups is not None:
        return grouped_attention(query, key, value, groups, scaling), None
    if isinstance(attention_mask, BlockMask):
        flex = flex_attention if torch.compiler.is_compiling() else _compiled_flex()
        options = FLEX_OPTIONS | (FLASH_OPTIONS if kwargs.get("flash") else {})
        out = flex(
            query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa,
            kernel_options=options or None,
        )  # fmt: skip
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make PACKED_ATTENTION a name transformers' attention modules resolve (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
