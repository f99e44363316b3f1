"""DFlash2's training objective: the unary CE plus the candidate selector's K-way CE.

Per supervised slot (DFLASH2.md, SpecForge's objective): CE_base over the full vocabulary of the
transformed logits l; C = the strict unary top-K of l; CE_sel = K-way CE of the selector scores with
label = the data token's index in C and predecessor = the data token before it (teacher forcing),
counted only where the data token is in C. The step's loss is (sum w * CE_base + alpha_eff * sum w *
[gold in C] * CE_sel) / sum w. Like train/drafters/loss.py, every function returns sums and counts,
never means, and lm_head runs in chunks of rows under non-reentrant activation checkpointing so [N,
V] logits never exist at once.

Teacher forcing is exact for acceptance: a slot counts only when every slot before it was right,
and then the greedy walk's predecessor is the data token. So the selected-token accuracy and tau
measured here are those of the left-to-right selector walk at inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from train.drafters.config import DrafterConfig
from train.drafters.dflash2 import CandidateSelector, transform_logits
from train.drafters.dflash2_fused import FusedSelectorCE, selector_term
from train.drafters.loss import acceptance_stats, autocast_dtype


@dataclass(frozen=True)
class SelectorLoss:
    """This step's selector term: its effective weight and whether it trains the backbone."""

    alpha: float = 1.0
    stop_gradient: bool = False


def selector_alpha(
    step: int,
    total_steps: int,
    *,
    alpha: float = 1.0,
    warmup_fraction: float = 0.0,
    ramp_fraction: float = 0.0,
) -> float:
    """alpha_eff at optimizer step `step` (0-based) of `total_steps`: 0 for the first
    warmup_fraction of steps, then a linear ramp to `alpha` over the next ramp_fraction.

    >>> [selector_alpha(s, 10, warmup_fraction=0.2, ramp_fraction=0.4) for s in (0, 2, 3, 6, 9)]
    [0.0, 0.0, 0.25, 1.0, 1.0]
    """
    warm, ramp = warmup_fraction * total_steps, ramp_fraction * total_steps
    if step < warm:
        return 0.0
    if ramp <= 0 or step >= warm + ramp:
        return alpha
    return alpha * (step - warm) / ramp


def selector_loss(cfg: Any, step: int, total_steps: int) -> SelectorLoss:
    """The selector term of optimizer step `step` from a TrainConfig's selector options."""
    alpha = selector_alpha(
        step,
        total_steps,
        alpha=cfg.selector_weight,
        warmup_fraction=cfg.selector_warmup,
        ramp_fraction=cfg.selector_ramp,
    )
    return SelectorLoss(alpha=alpha, stop_gradient=cfg.selector_stop_grad)


def teacher_predecessors(targets_BQ: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """The data token before each slot's target [B, Q]: target[k - 1] of the same block (offset
    0 holds the anchor token x[a], the predecessor of offset 1). Offset 0 gets x[a] itself; it is
    never a target.

    >>> teacher_predecessors(torch.tensor([[10, 11, 12, 20, 21, 22]]), block_size=3)
    tensor([[10, 10, 11, 20, 20, 21]])
    """
    t_BNK = targets_BQ.view(targets_BQ.shape[0], -1, block_size)
    return torch.cat([t_BNK[..., :1], t_BNK[..., :-1]], dim=-1).flatten(1)


@dataclass
class SelectorCE:
    """Sums over rows: `loss` = w * CE_base + alpha * w * [gold in C] * CE_sel (the one to
    backpropagate), its two terms, w * [gold in C], w; and per row whether the unary argmax
    and the selected candidate equal the target."""

    loss: torch.Tensor
    ce_sum: torch.Tensor
    selector_ce_sum: torch.Tensor
    selector_weight: torch.Tensor
    weight_total: torch.Tensor
    correct_N: torch.Tensor
    selected_correct_N: torch.Tensor


def _chunk(
    hidden_nH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_n: torch.Tensor,
    predecessors_n: torch.Tensor,
    weights_n: torch.Tensor,
    selector: CandidateSelector,
    cfg: DrafterConfig,
    stop_gradient: bool,
) -> tuple[torch.Tensor, ...]:
    logits_nV = transform_logits(F.linear(hidden_nH, lm_head_weight_VH), cfg)
    ce_n = F.cross_entropy(logits_nV.float(), targets_n, reduction="none")
    unary_nK, cand_nK = logits_nV.topk(selector.top_k, dim=-1)
    sel_hidden_nH = hidden_nH
    if stop_gradient:  # the selector term then trains the selector only
        unary_nK, sel_hidden_nH = unary_nK.detach(), hidden_nH.detach()
    sel_sum, sel_w, selected_n = selector_term(
        sel_hidden_nH, unary_nK, cand_nK, targets_n, predecessors_n, weights_n, selector
    )
    with torch.no_grad():
        correct_n = logits_nV.argmax(dim=-1) == targets_n
    return (ce_n * weights_n).sum(), sel_sum, sel_w, correct_n, selected_n


def _zeros(like: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [like.new_zeros((), dtype=torch.float32) for _ in range(n)]


def _cat(flags: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(flags) if flags else like.new_zeros(0, dtype=torch.bool)


def _chunks(hidden_NH: torch.Tensor, spec: dict[str, Any]):
    """(rows, `_chunk` arguments) of every chunk of `chunk_rows` rows."""
    for start in range(0, hidden_NH.shape[0], spec["chunk_rows"]):
        rows = slice(start, start + spec["chunk_rows"])
        tensors = (spec["targets_N"], spec["predecessors_N"], spec["weights_N"])
        yield (
            rows,
            (
                hidden_NH[rows],
                spec["lm_head_weight_VH"],
                *(t[rows] for t in tensors),
                spec["selector"],
                spec["cfg"],
                spec["stop_gradient"],
            ),
        )


def selector_chunked_ce(
    hidden_NH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_N: torch.Tensor,
    predecessors_N: torch.Tensor,
    weights_N: torch.Tensor,
    selector: CandidateSelector,
    cfg: DrafterConfig,
    *,
    chunk_rows: int,
    alpha: float = 1.0,
    checkpoint: bool = True,
    fused: bool = False,
    compiled: bool = False,
    stop_gradient: bool = False,
) -> SelectorCE:
    """CE_base and CE_sel sums over rows in chunks of `chunk_rows` (see the module docstring).

    `fused` (with grad) forms each chunk's gradients in the forward
    (train/drafters/dflash2_fused.py), so nothing is kept or recomputed but d(hidden) [N, H] and the
    selector's parameter gradients; its terms come back detached, `loss` alone carries the gradient;
    `compiled` runs its [n, V] part through torch.compile. Else, with `checkpoint`, each chunk runs
    under non-reentrant activation checkpointing (its logits recomputed in backward).
    `stop_gradient` keeps the selector term out of the backbone: its gradient then reaches only the
    selector's own parameters. The lm_head is frozen: its gradient is never formed.
    """
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    weights_N = weights_N.float()
    spec = dict(
        lm_head_weight_VH=lm_head_weight_VH.detach(),
        targets_N=targets_N,
        predecessors_N=predecessors_N,
        weights_N=weights_N,
        selector=selector,
        cfg=cfg,
        chunk_rows=chunk_rows,
        alpha=alpha,
        stop_gradient=stop_gradient,
    )
    grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    if fused and grad:
        spec.update(
            compiled=compiled,
            compute_dtype=autocast_dtype(hidden_NH.device.type),
            top_k=selector.top_k,
            multiplier=cfg.output_multiplier,
            softcap=cfg.final_logit_softcapping,
        )
        params = tuple(selector.parameters())
        *sums, correct_N, selected_N = FusedSelectorCE.apply(hidden_NH, *params, spec)
        return SelectorCE(*sums, weights_N.sum(), correct_N, selected_N)
    sums, correct, selected = _zeros(hidden_NH, 3), [], []
    for _, args in _chunks(hidden_NH, spec):
        if checkpoint and grad:
            out = activation_checkpoint(_chunk, *args, use_reentrant=False)
        else:
            out = _chunk(*args)
        sums = [total + part for total, part in zip(sums, out[:3], strict=True)]
        correct.append(out[3])
        selected.append(out[4])
    loss = sums[0] + alpha * sums[1]
    flags = _cat(correct, hidden_NH), _cat(selected, hidden_NH)
    return SelectorCE(loss, *sums, weights_N.sum(), *flags)


def selector_step_terms(
    hidden_BQH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_BQ: torch.Tensor,
    w_BQ: torch.Tensor,
    keep_BN: torch.Tensor,
    selector: CandidateSelector,
    cfg: DrafterConfig,
    *,
    chunk_rows: int,
    checkpoint: bool,
    fused: bool = False,
    compiled: bool = False,
    options: SelectorLoss,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(sum w * CE_base + alpha * sum w * [gold in C] * CE_sel, sum w, stats) of one micro-batch.

    stats: `acceptance_stats` of the unary argmax, the same keys prefixed `selected_` for the
    selected tokens, and the two CE sums and the selector's weight (`ce_base_sum`,
    `selector_ce_sum`, `selector_weight`) so each term can be logged on its own.
    """
    out = selector_chunked_ce(
        hidden_BQH.flatten(0, 1),
        lm_head_weight_VH,
        targets_BQ.flatten(),
        teacher_predecessors(targets_BQ, block_size=cfg.block_size).flatten(),
        w_BQ.flatten(),
        selector,
        cfg,
        chunk_rows=chunk_rows,
        alpha=options.alpha,
        checkpoint=checkpoint,
        fused=fused,
        compiled=compiled,
        stop_gradient=options.stop_gradient,
    )
    size = dict(block_size=cfg.block_size)
    stats = acceptance_stats(out.correct_N.view_as(targets_BQ), w_BQ, keep_BN, **size)
    selected = acceptance_stats(out.selected_correct_N.view_as(targets_BQ), w_BQ, keep_BN, **size)
    stats.update({f"selected_{key}": value for key, value in selected.items()})
    stats["ce_base_sum"] = out.ce_sum.detach()
    stats["selector_ce_sum"] = out.selector_ce_sum.detach()
    stats["selector_weight"] = out.selector_weight.detach()
    return out.loss, out.weight_total, stats
