"""The top-K of each row of a chunk of logits over the vocabulary, by its blocks' maxima.

DFlash2's fused selector loss needs the K largest logits of every row of a [n, V] chunk (K 16,
V 151,936 for Qwen3). aten's topk over V runs a multi-pass radix select (2.3 ms per 2048-row
chunk on an H200, bench/topk_bench.py). The rows' K largest values lie in the K blocks of W
columns with the largest maxima: a block holding one of them has a maximum at least as large
as the K-th value, and each block whose maximum is larger holds a value larger than the K-th,
of which there are fewer than K. So one max per block (a reduction Inductor fuses), a top-K of
V / W block maxima and a top-K of the K * W gathered values give the same values as the top-K
of the row; among equal values the ids may differ, as they may between topk implementations.
"""

from __future__ import annotations

import torch

# Block widths tried in order: the first that divides the vocabulary is used (Qwen3's 151,936 =
# 2^7 x 1187 and Llama 3's 128,256 take 128); a vocabulary none divides keeps one plain topk.
BLOCK_WIDTHS = (128, 64, 32)


def aten_topk(x_nV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of one `torch.topk` over each row."""
    return x_nV.topk(k, dim=-1)


def block_width(vocab: int, k: int, widths: tuple[int, ...] | None = None) -> int | None:
    """The width of `block_topk`'s blocks for rows of `vocab` values (the first of `widths`,
    default BLOCK_WIDTHS, that fits), or None where a plain topk is as good (no width divides
    the row, or the K blocks would be over half of it)."""
    for width in BLOCK_WIDTHS if widths is None else widths:
        if vocab % width == 0 and 2 * k * width <= vocab:
            return width
    return None


def block_topk(x_nV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [n, k], ids [n, k]) of the k largest of each row, largest first: the same
    values as `x_nV.topk(k, dim=-1)`, through the k blocks with the largest maxima.

    >>> x = torch.arange(4096.0).flip(0)[None]
    >>> [t.tolist() for t in block_topk(x, 2)]
    [[[4095.0, 4094.0]], [[0, 1]]]
    """
    n, vocab = x_nV.shape
    width = block_width(vocab, k)
    if width is None:
        return aten_topk(x_nV, k)
    blocks_nBW = x_nV.reshape(n, vocab // width, width)
    _, block_nk = blocks_nBW.amax(dim=-1).topk(k, dim=-1)
    values_nkW = blocks_nBW.gather(1, block_nk[:, :, None].expand(n, k, width))
    top_nk, where_nk = values_nkW.reshape(n, k * width).topk(k, dim=-1)
    column_nk = block_nk.gather(1, where_nk // width) * width + where_nk % width
    return top_nk, column_nk
