"""Chunked lm_head + cross-entropy, and the acceptance metrics derived from it.

All return sums and counts, never means: the caller normalises across accumulation steps and
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


def _fused_chunk(
    hidden_nH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_n: torch.Tensor,
    weights_n: torch.Tensor,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sum w * CE, argmax-correct [n], d(sum w * CE)/d(hidden) [n, H] or None) of one chunk.

    d/d(logits) of w * CE is w * (softmax - onehot(target)), cast to the logits' dtype as
    autograd through `logits.float()` would; it is formed in place in the log-softmax buffer.
    """
    logits_nV = F.linear(hidden_nH, lm_head_weight_VH)
    logp_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ce_n = -logp_nV.gather(1, targets_n[:, None]).squeeze(1)
    correct_n = logits_nV.argmax(dim=-1) == targets_n
    ce_sum = (ce_n * weights_n).sum()
    if not need_grad:
        return ce_sum, correct_n, None
    dlogits_nV = logp_nV.exp_().mul_(weights_n[:, None])
    dlogits_nV.scatter_add_(1, targets_n[:, None], -weights_n[:, None])
    dhidden_nH = dlogits_nV.to(logits_nV.dtype) @ lm_head_weight_VH
    return ce_sum, correct_n, dhidden_nH


_compiled_chunk = None


def _compiled_fused_chunk():
    """`_fused_chunk` through torch.compile, created on first use (once per process)."""
    global _compiled_chunk
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_fused_chunk, dynamic=False, fullgraph=True)
    return _compiled_chunk


def _fused_ce_loop(
    hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor,
    *,
    chunk_rows: int,
    compiled: bool,
    compute_dtype: torch.dtype | None,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sum w * CE, correct [N], d/d(hidden) [N, H] in hidden's dtype or None).

    Matmuls run in `compute_dtype` (the autocast dtype, or None: the inputs' own) with autocast
    off. In compiled mode the last, shorter chunk is padded with zero-weight rows (target 0) to
    `chunk_rows`, so one graph serves every chunk; the padded rows are dropped.
    """
    body = _compiled_fused_chunk() if compiled else _fused_chunk
    # Views of a leaf report requires_grad even under no_grad; detached, the compiled body
    # sees one requires_grad state and keeps one graph.
    hidden_NH = hidden_NH.detach()
    if compute_dtype is not None:
        lm_head_weight_VH = lm_head_weight_VH.to(compute_dtype)
    num_rows = hidden_NH.shape[0]
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    correct_N = torch.empty(num_rows, dtype=torch.bool, device=hidden_NH.device)
    dhidden_NH = torch.empty_like(hidden_NH) if need_grad else None
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        hidden_nH, targets_n, weights_n = hidden_NH[rows], targets_N[rows], weights_N[rows]
        if compute_dtype is not None:
            hidden_nH = hidden_nH.to(compute_dtype)
        n = hidden_nH.shape[0]
        if compiled:
            hidden_nH, targets_n, weights_n = padded_chunk(
                hidden_nH, targets_n, weights_n, chunk_rows
            )
        with torch.autocast(hidden_NH.device.type, enabled=False):
            part, correct_n, dhidden_nH = body(
                hidden_nH, lm_head_weight_VH, targets_n, weights_n, need_grad
            )
        total = total + part
        correct_N[rows] = correct_n[:n]
        if dhidden_NH is not None:
            dhidden_NH[rows] = dhidden_nH[:n]
    return total, correct_N, dhidden_NH


def padded_chunk(
    hidden_nH: torch.Tensor, targets_n: torch.Tensor, weights_n: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk of fewer than `rows` rows padded with zero-weight rows (target 0) to `rows`, so
    that one compiled graph serves every chunk; a full chunk as it is."""
    pad = rows - hidden_nH.shape[0]
    if pad <= 0:
        return hidden_nH, targets_n, weights_n
    hidden_nH = F.pad(hidden_nH, (0, 0, 0, pad))
    return hidden_nH, F.pad(targets_n, (0, pad)), F.pad(weights_n, (0, pad))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype where autocast is on for `device_type`, else None."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class _FusedCE(torch.autograd.Function):
    """Forward computes the loss and its hidden-gradient; backward only scales that gradient."""

    @staticmethod
    def forward(
        ctx,
        hidden_NH: torch.Tensor,
        lm_head_weight_VH: torch.Tensor,
        targets_N: torch.Tensor,
        weights_N: torch.Tensor,
        options: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total, correct_N, dhidden_NH = _fused_ce_loop(
            hidden_NH, lm_head_weight_VH, targets_N, weights_N, **options, need_grad=True
        )
        ctx.save_for_backward(dhidden_NH)
        ctx.mark_non_differentiable(correct_N)
        return total, correct_N

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_correct: torch.Tensor | None):
        (dhidden_NH,) = ctx.saved_tensors
        return grad_total * dhidden_NH, None, None, None, None


def fused_chunked_ce(
    hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor,
    *,
    chunk_rows: int,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked_ce` with each chunk's gradient computed in the forward: no logits recompute.

    Same return value and numerics as `chunked_ce`: logits = F.linear(hidden, W) in the input
    dtype (the autocast dtype under autocast), CE on logits.float(), correct = argmax == target.
    Per chunk, d(sum w * CE)/d(logits) = w * (softmax - onehot(target)) is formed at once and
    multiplied by W into d(hidden) [n, H]; backward returns grad_output * d(hidden). Peak extra
    memory is one chunk's [chunk_rows, V] logits and probabilities plus d(hidden) [N, H] in
    hidden's dtype, held until backward; [N, V] never exists. Without grad (no_grad, or hidden
    not requiring grad) no gradient is computed. The lm_head must be frozen: its gradient is
    never formed. `compiled` runs the chunk body through torch.compile, so the log-softmax,
    softmax-gradient and argmax passes over [chunk_rows, V] are fused.

    >>> h, w = torch.eye(3), torch.tensor([0.0, 1.0, 1.0])
    >>> total, norm, correct = fused_chunked_ce(h, 10 * torch.eye(3), torch.tensor([0, 1, 0]),
    ...                                         w, chunk_rows=2)
    >>> round(float(total), 4), float(norm), correct.tolist()
    (10.0002, 2.0, [True, True, False])
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    if lm_head_weight_VH.requires_grad:
        raise ValueError(
            "fused_chunked_ce needs a frozen lm_head (requires_grad=False); "
            "use chunked_ce to train the lm_head"
        )
    weights_N, targets_N = weights_N.detach().float(), targets_N.detach()
    options = {
        "chunk_rows": chunk_rows,
        "compiled": compiled,
        "compute_dtype": autocast_dtype(hidden_NH.device.type),
    }
    if torch.is_grad_enabled() and hidden_NH.requires_grad:
        total, correct_N = _FusedCE.apply(
            hidden_NH, lm_head_weight_VH, targets_N, weights_N, options
        )
    else:
        total, correct_N, _ = _fused_ce_loop(
            hidden_NH, lm_head_weight_VH, targets_N, weights_N, **options, need_grad=False
        )
    return total, weights_N.sum(), correct_N


def acceptance_stats(
    correct_BQ: torch.Tensor,
    w_BQ: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    block_size: int,
    first: int = 1,
) -> dict[str, torch.Tensor]:
    """Per-offset accuracy counts and the acceptance-length estimate tau (all tensors, no sync).

    An offset k counts when it has a valid target (w > 0: kept block, inside the sequence,
    supervised, k > 0). A block's accepted length is the run of correct valid offsets from
    k = `first` (1 for DFlash; 0 for DSpark, whose anchor slot drafts too):
    sum_{k>=first} prod_{first<=i<=k} (correct_i and valid_i), so an offset without a valid
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
    accepted_BN = ok_BNK[..., first:].long().cumprod(dim=-1).sum(dim=-1)
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
