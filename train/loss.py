"""Chunked lm_head + cross-entropy, and the acceptance metrics derived from it.

Both return sums and counts, never means: the caller normalises across accumulation steps and
ranks (loss = sum(w * CE) / sum(w) over the whole optimizer step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint


def _chunk_ce(
    hidden_nH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_n: torch.Tensor,
    weights_n: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_nV = F.linear(hidden_nH, lm_head_weight_VH)
    ce_n = F.cross_entropy(logits_nV.float(), targets_n, reduction="none")
    with torch.no_grad():
        correct_n = logits_nV.argmax(dim=-1) == targets_n
    return (ce_n * weights_n).sum(), correct_n


def chunked_ce(
    hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor,
    *,
    chunk_rows: int,
    checkpoint: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_n w_n * CE_n, sum_n w_n, argmax-correct [N] bool) over rows in chunks.

    Each chunk's logits [chunk_rows, V] are computed in float32 for the CE. With `checkpoint`,
    chunks run under non-reentrant activation checkpointing: only the chunk inputs are saved and
    the logits are recomputed in backward, so [N, V] logits never exist at once.

    >>> h, w = torch.eye(3), torch.tensor([0.0, 1.0, 1.0])
    >>> total, norm, correct = chunked_ce(h, 10 * torch.eye(3), torch.tensor([0, 1, 0]), w,
    ...                                   chunk_rows=2)
    >>> round(float(total), 4), float(norm), correct.tolist()
    (10.0002, 2.0, [True, True, False])
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    weights_N = weights_N.float()
    use_ckpt = checkpoint and torch.is_grad_enabled() and hidden_NH.requires_grad
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    correct_parts = []
    for start in range(0, hidden_NH.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (hidden_NH[rows], lm_head_weight_VH, targets_N[rows], weights_N[rows])
        if use_ckpt:
            part, correct_n = activation_checkpoint(_chunk_ce, *args, use_reentrant=False)
        else:
            part, correct_n = _chunk_ce(*args)
        total = total + part
        correct_parts.append(correct_n)
    correct_N = torch.cat(correct_parts) if correct_parts else targets_N.new_zeros(0).bool()
    return total, weights_N.sum(), correct_N


def acceptance_stats(
    correct_BQ: torch.Tensor,
    w_BQ: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    block_size: int,
) -> dict[str, torch.Tensor]:
    """Per-offset accuracy counts and the acceptance-length estimate tau (all tensors, no sync).

    An offset k counts when it has a valid target (w > 0: kept block, inside the sequence,
    supervised, k > 0). A block's accepted length is the run of correct valid offsets from
    k = 1: sum_{k=1}^{B-1} prod_{i=1}^{k} (correct_i and valid_i), so an offset without a valid
    target ends the run, as verification could not confirm it. tau = 1 + accepted / blocks over
    kept blocks: accepted draft tokens plus the target's bonus token, as at inference.

    Keys: `correct_per_offset` and `count_per_offset` (float [block_size], index k),
    `accepted_sum` and `num_blocks` (float scalars, summable across ranks), `tau`.

    >>> correct = torch.tensor([[1, 1, 1, 0, 1, 0, 1, 1]]).bool()
    >>> w = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    >>> stats = acceptance_stats(correct, w, torch.tensor([[True, True]]), block_size=4)
    >>> float(stats["tau"]), stats["correct_per_offset"].tolist()
    (2.0, [0.0, 1.0, 2.0, 1.0])
    """
    batch, q_len = correct_BQ.shape
    shape = (batch, q_len // block_size, block_size)
    valid_BNK = (w_BQ > 0).view(shape)
    ok_BNK = correct_BQ.bool().view(shape) & valid_BNK
    accepted_BN = ok_BNK[..., 1:].long().cumprod(dim=-1).sum(dim=-1)
    kept_BN = keep_BN.bool()
    accepted_sum = (accepted_BN * kept_BN).sum().float()
    num_blocks = kept_BN.sum().float()
    return {
        "correct_per_offset": ok_BNK.sum(dim=(0, 1)).float(),
        "count_per_offset": valid_BNK.sum(dim=(0, 1)).float(),
        "accepted_sum": accepted_sum,
        "num_blocks": num_blocks,
        "tau": 1.0 + accepted_sum / num_blocks.clamp(min=1.0),
    }
