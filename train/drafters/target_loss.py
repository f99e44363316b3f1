"""A DFlash drafter's loss against the target's distribution (kl, tv, mix) or with D-PACE slot
weights, over rows in chunks (the terms and weights: train/drafters/objective.py).

The target's distribution of a row is softmax(lm_head(the target's last hidden state)) in fp32 at
temperature 1, from the cached last layer (after the final norm), with the same frozen lm_head as
the drafter's. Like train/drafters/loss.py, everything is a sum (the caller divides once over the
optimizer step) and vocabulary-sized tensors exist one chunk of rows at a time: the drafter's and
the target's logits of `chunk_rows` rows, never [rows, V] for the micro-batch. `fused` forms each
chunk's gradient in the forward, nothing kept or recomputed but d(hidden) [N, H]: per row, the
gradient of the loss by the drafter's logits is c_ce (q - onehot(y)) + c_kl (q - p) +
c_tv q (s - <s, q>) / 2 with s = sign(q - p). Otherwise chunks run under non-reentrant activation
checkpointing and autograd forms it.

Blocks overlap, so rows of a chunk read the same target state many times: the target's lm_head
runs once per distinct state a chunk reads (`TargetRows`, `chunk_reads`), not once per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from train.drafters.loss import autocast_dtype
from train.drafters.objective import Objective
from train.drafters.target_rows import TargetRows, chunk_logits, chunk_reads


def dpace_weights(
    ce_n: torch.Tensor, counts_n: torch.Tensor, *, block_size: int, alpha: float
) -> torch.Tensor:
    """D-PACE slot weights [n] (objective.py) of rows laid out in whole blocks: `ce_n` each row's
    CE, `counts_n` 1 where the slot counts, else 0. Detached.

    >>> ce = torch.tensor([0.0, 0.6931472, 0.6931472])
    >>> dpace_weights(ce, torch.tensor([0.0, 1.0, 1.0]), block_size=3, alpha=0.5).tolist()
    [0.0, 1.3125, 0.5625]
    """
    with torch.no_grad():
        mask_bK = counts_n.float().view(-1, block_size)
        q_bK = torch.exp(-ce_n.float()).view(-1, block_size)
        smooth_bK = torch.where(mask_bK > 0, (1 - alpha) * q_bK + alpha, torch.ones_like(q_bK))
        reach_bK = smooth_bK.cumprod(dim=-1) * mask_bK
        return (reach_bK.flip(-1).cumsum(dim=-1).flip(-1) * mask_bK).flatten()


def _target_logp(last_uH: torch.Tensor, lm_head_VH: torch.Tensor) -> torch.Tensor:
    """log softmax of the target's logits [u, V], fp32, no grad."""
    with torch.no_grad():
        return torch.log_softmax(F.linear(last_uH.to(lm_head_VH.dtype), lm_head_VH).float(), -1)


def chunk_terms(
    hidden_nH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_n: torch.Tensor,
    last_uH: torch.Tensor | None,
    place_n: torch.Tensor | None,
    weights_n: torch.Tensor,
    coef: tuple[float, float, float],
    dpace: tuple[int, float] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum w loss, [sum w, sum w ce, sum w kl, sum w tv] detached, argmax-correct [n], w [n])
    of one chunk through autograd; row i reads the target's state last_uH[place_n[i]]; `dpace`
    (block_size, alpha) replaces the weights by D-PACE's.

    >>> h, lm = torch.eye(2), torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> loss, terms, ok, _ = chunk_terms(h, lm, torch.tensor([0, 0]), h, torch.tensor([0, 1]),
    ...                                  torch.ones(2), (0.0, 1.0, 0.0), None)
    >>> float(loss), [round(x, 4) for x in terms.tolist()], ok.tolist()
    (0.0, [2.0, 2.2539, 0.0, 0.0], [True, False])
    """
    logits_nV = F.linear(hidden_nH, lm_head_VH)
    logq_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ce_n = -logq_nV.gather(1, labels_n[:, None]).squeeze(1)
    kl_n = tv_n = torch.zeros_like(ce_n)
    if last_uH is not None:
        logp_nV = _target_logp(last_uH, lm_head_VH)[place_n]
        p_nV = logp_nV.exp()
        kl_n = (p_nV * (logp_nV - logq_nV)).sum(dim=-1)
        tv_n = 0.5 * (logq_nV.exp() - p_nV).abs().sum(dim=-1)
    if dpace is not None:
        weights_n = dpace_weights(ce_n.detach(), weights_n, block_size=dpace[0], alpha=dpace[1])
    loss_n = coef[0] * ce_n + coef[1] * kl_n + coef[2] * tv_n
    with torch.no_grad():
        terms = torch.stack([weights_n.sum(), *((t * weights_n).sum() for t in (ce_n, kl_n, tv_n))])
        correct_n = logits_nV.argmax(dim=-1) == labels_n
    return (loss_n * weights_n).sum(), terms, correct_n, weights_n


def fused_chunk(
    hidden_nH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_n: torch.Tensor,
    target_uV: torch.Tensor | None,
    place_n: torch.Tensor | None,
    weights_n: torch.Tensor,
    coef: tuple[float, float, float],
    dpace: tuple[int, float] | None,
) -> tuple[torch.Tensor, ...]:
    """`chunk_terms` with the gradient formed here (see the module docstring): (sum w loss,
    terms, correct [n], w [n], d(sum w loss)/d(hidden) [n, H] in the logits' dtype). The
    target's logits `target_uV` come made (the lm_head of the distinct states the chunk reads;
    rows beyond them unread): a compiled body has one shape, and their number varies."""
    c_ce, c_kl, c_tv = coef
    logits_nV = F.linear(hidden_nH, lm_head_VH)
    logq_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ce_n = -logq_nV.gather(1, labels_n[:, None]).squeeze(1)
    correct_n = logits_nV.argmax(dim=-1) == labels_n
    q_nV = logq_nV.exp()
    grad_nV = q_nV * (c_ce + c_kl)
    grad_nV.scatter_add_(1, labels_n[:, None], torch.full_like(ce_n[:, None], -c_ce))
    kl_n = tv_n = torch.zeros_like(ce_n)
    if target_uV is not None:
        logp_nV = torch.log_softmax(target_uV[place_n].float(), dim=-1)
        p_nV = logp_nV.exp()
        kl_n = (p_nV * (logp_nV - logq_nV)).sum(dim=-1)
        diff_nV = q_nV - p_nV
        tv_n = 0.5 * diff_nV.abs().sum(dim=-1)
        if c_kl:
            grad_nV = grad_nV - c_kl * p_nV
        if c_tv:
            sign_nV = torch.sign(diff_nV)
            centred_nV = sign_nV - (sign_nV * q_nV).sum(dim=-1, keepdim=True)
            grad_nV = grad_nV + (0.5 * c_tv) * q_nV * centred_nV
    if dpace is not None:
        weights_n = dpace_weights(ce_n, weights_n, block_size=dpace[0], alpha=dpace[1])
    loss_n = c_ce * ce_n + c_kl * kl_n + c_tv * tv_n
    terms = torch.stack([weights_n.sum(), *((t * weights_n).sum() for t in (ce_n, kl_n, tv_n))])
    grad_nV = (grad_nV * weights_n[:, None]).to(logits_nV.dtype)
    return (loss_n * weights_n).sum(), terms, correct_n, weights_n, grad_nV @ lm_head_VH


@functools.cache
def compiled_fused_chunk():  # noqa: ANN201
    """`fused_chunk` through torch.compile, created on first use (once per process)."""
    return torch.compile(fused_chunk, dynamic=False)


def _fused_loop(
    hidden_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    target: TargetRows | None,
    weights_N: torch.Tensor,
    opts: dict,
) -> tuple[torch.Tensor, ...]:
    """Every chunk of `fused_chunk`: (sum w loss, terms, correct [N], w [N], d(hidden) [N, H]).
    Matmuls run in `opts["compute_dtype"]` (the autocast dtype, or None: the inputs' own) with
    autocast off; compiled, the last chunk is padded with zero-weight rows to `chunk_rows`, so
    one graph serves every chunk (the padded rows are dropped), and the target's logits come in
    one [chunk_rows, V] buffer whatever their number."""
    size, dtype = opts["chunk_rows"], opts["compute_dtype"]
    body = compiled_fused_chunk() if opts["compiled"] else fused_chunk
    if dtype is not None:
        lm_head_VH = lm_head_VH.to(dtype)
    num, dev = hidden_NH.shape[0], hidden_NH.device
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    terms = torch.zeros(4, dtype=torch.float32, device=dev)
    correct_N = torch.zeros(num, dtype=torch.bool, device=dev)
    used_N = torch.zeros(num, dtype=torch.float32, device=dev)
    d_hidden_NH = torch.empty_like(hidden_NH)
    buffer = None
    if opts["compiled"] and target is not None:
        buffer = torch.empty(size, lm_head_VH.shape[0], dtype=lm_head_VH.dtype, device=dev)
    for chunk, start in enumerate(range(0, num, size)):
        rows = slice(start, start + size)
        h, labels, weights = hidden_NH[rows], labels_N[rows], weights_N[rows]
        if dtype is not None:
            h = h.to(dtype)
        n = h.shape[0]
        with torch.autocast(dev.type, enabled=False):
            target_uV, place = chunk_logits(target, opts["reads"], chunk, lm_head_VH, buffer)
            if opts["compiled"] and n < size:
                pad = size - n
                h, labels, weights = (
                    F.pad(h, (0, 0, 0, pad)),
                    F.pad(labels, (0, pad)),
                    F.pad(weights, (0, pad)),
                )
                place = None if place is None else F.pad(place, (0, pad))
            out = body(
                h, lm_head_VH, labels, target_uV, place, weights, opts["coef"], opts["dpace"]
            )
        loss, terms = loss + out[0], terms + out[1]
        rows = slice(start, start + n)
        correct_N[rows], used_N[rows], d_hidden_NH[rows] = out[2][:n], out[3][:n], out[4][:n]
    return loss, terms, correct_N, used_N, d_hidden_NH


class _FusedTargetLoss(torch.autograd.Function):
    """Forward forms every chunk's loss and gradient; backward only scales the gradient."""

    @staticmethod
    def forward(ctx, hidden_NH, lm_head_VH, labels_N, target, weights_N, opts):  # noqa: ANN001, ANN205
        loss, terms, correct_N, used_N, d_hidden_NH = _fused_loop(
            hidden_NH.detach(), lm_head_VH, labels_N, target, weights_N, opts
        )
        ctx.save_for_backward(d_hidden_NH)
        ctx.mark_non_differentiable(terms, correct_N, used_N)
        return loss, terms, correct_N, used_N

    @staticmethod
    def backward(ctx, grad_loss, *_unused):  # noqa: ANN001, ANN205
        (d_hidden_NH,) = ctx.saved_tensors
        return grad_loss * d_hidden_NH, None, None, None, None, None


@dataclass
class TargetTerms:
    """`loss` = sum over rows of w * (the objective's loss), to backpropagate; `weight_total` the
    normaliser (sum of the given weights: with D-PACE, the number of counted slots, as
    speculators divides); `terms` [sum w, sum w ce, sum w kl, sum w tv] with the weights used
    (detached; kl and tv 0 without the target's states); argmax-correct [N]."""

    loss: torch.Tensor
    weight_total: torch.Tensor
    terms: torch.Tensor
    correct_N: torch.Tensor


def chunked_target_loss(
    hidden_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    target: TargetRows | None,
    weights_N: torch.Tensor,
    *,
    objective: Objective,
    block_size: int,
    chunk_rows: int,
    fused: bool = True,
    compiled: bool = False,
    checkpoint: bool = True,
) -> TargetTerms:
    """The objective's loss over rows in chunks of `chunk_rows` (a multiple of `block_size`:
    D-PACE weighs whole blocks). `target`: the target's last hidden states and the one each row
    reads, whose lm_head gives the row's target distribution (None for a loss without it);
    `weights_N` the slot weights (with D-PACE: 1 where a slot counts). The lm_head is frozen:
    its gradient is never formed.

    >>> h, lm = torch.eye(2), torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> out = chunked_target_loss(h, lm, torch.tensor([0, 1]), TargetRows.each(h), torch.ones(2),
    ...                           objective=Objective("kl"), block_size=1, chunk_rows=1)
    >>> float(out.loss), float(out.weight_total), out.correct_N.tolist()
    (0.0, 2.0, [True, True])
    """
    if chunk_rows <= 0 or chunk_rows % block_size:
        raise ValueError(
            f"chunk_rows must be a positive multiple of {block_size}, got {chunk_rows}"
        )
    if objective.needs_target != (target is not None):
        state = "missing" if target is None else "given but unused"
        raise ValueError(f"loss {objective.loss!r}: the target's last hidden state is {state}")
    lm_head_VH, weights_N = lm_head_VH.detach(), weights_N.detach().float()
    reads = None
    if target is not None:
        target = TargetRows(target.states_MH.detach(), target.index_N)
        reads = chunk_reads(target.index_N, target.states_MH.shape[0], chunk_rows)
    coef = objective.coefficients
    dpace = (block_size, objective.dpace_alpha) if objective.slot_weights == "dpace" else None
    grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    if fused:
        opts = dict(chunk_rows=chunk_rows, compiled=compiled, coef=coef, dpace=dpace, reads=reads)
        opts["compute_dtype"] = autocast_dtype(hidden_NH.device.type)
        args = (lm_head_VH, labels_N, target, weights_N, opts)
        if grad:
            loss, terms, correct_N, _ = _FusedTargetLoss.apply(hidden_NH, *args)
        else:
            loss, terms, correct_N, _, _ = _fused_loop(hidden_NH.detach(), *args)
        return TargetTerms(loss, weights_N.sum(), terms, correct_N)
    loss = hidden_NH.new_zeros((), dtype=torch.float32)
    terms, correct_parts = hidden_NH.new_zeros(4, dtype=torch.float32), []
    for chunk, start in enumerate(range(0, hidden_NH.shape[0], chunk_rows)):
        rows = slice(start, start + chunk_rows)
        last = place = None
        if target is not None:
            distinct, place = reads[chunk]
            last = target.states_MH[distinct]
        args = (hidden_NH[rows], lm_head_VH, labels_N[rows], last, place, weights_N[rows])
        args += (coef, dpace)
        if checkpoint and grad:
            out = activation_checkpoint(chunk_terms, *args, use_reentrant=False)
        else:
            out = chunk_terms(*args)
        loss, terms = loss + out[0], terms + out[1]
        correct_parts.append(out[2])
    return TargetTerms(loss, weights_N.sum(), terms, torch.cat(correct_parts))
