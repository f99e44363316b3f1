"""DFlash2's loss with each chunk's gradients formed in the forward (`--ce fused`, the default).

The [n, V] work of a chunk is DFlash's fused CE (train/drafters/loss.py `_fused_chunk`) plus the
top-K: logits, log-softmax, argmax, top-K and d(CE)/d(logits) = w * (softmax - onehot), one function
that `--compile model` runs through torch.compile (the last, shorter chunk padded with zero-weight
rows, so one graph serves every chunk). The selector's term touches only [n, K] and [n, r] tensors;
a local autograd pass gives its gradients (hidden rows, the K unary scores, the selector's
parameters), and the unary part is scattered into the chunk's d(logits) before the one matmul back
to d(hidden). Nothing [n, V] is differentiated by autograd: an eager autograd pass through
logits.float(), cross_entropy and topk made a DFlash2 step 1.24x DFlash's on an H200 (README,
Results).

With a logit transform l = c * tanh(m * z / c) (DrafterConfig's output_multiplier m and
final_logit_softcapping c), dl/dz = m * (1 - (l / c)^2), applied elementwise to both terms.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from train.drafters.dflash2 import CandidateSelector, scale_and_softcap
from train.drafters.loss import padded_chunk
from train.drafters.topk import aten_topk, block_topk


def _transform_slope(
    logits: torch.Tensor, multiplier: float | None, softcap: float | None
) -> torch.Tensor | float:
    """dl/dz at the transformed logits l (1.0 without a transform)."""
    slope: torch.Tensor | float = 1.0
    if softcap is not None:
        slope = 1 - (logits.float() / softcap) ** 2
    if multiplier is not None:
        slope = slope * multiplier
    return slope


# "blocks": train.drafters.topk.block_topk, a top-K of the K blocks with the largest maxima (the
# same values as one topk over the row; among equal values the ids may differ): 1.08 ms per 2048 x
# 151,936 bf16 chunk on an H200, and the 8B DFlash2 step 166.8 ms against DFlash's 148.9 ms (1.120x)
# where aten's topk gave 173.0 ms (1.162x) in the same call (README, Results). "aten": one
# torch.topk over the vocabulary, which Inductor leaves to aten's radix select inside the compiled
# chunk (2.35 ms per chunk). bench/topk_bench.py times both side by side, bench/train_bench.py
# --selector-topk-kernel the step with each.
TOPK_KERNEL = "blocks"
TOPK_KERNELS = {"blocks": block_topk, "aten": aten_topk}


def unary_chunk(
    hidden_nH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    targets_n: torch.Tensor,
    weights_n: torch.Tensor,
    top_k: int,
    multiplier: float | None,
    softcap: float | None,
) -> tuple[torch.Tensor, ...]:
    """(sum w * CE_base, argmax-correct [n], unary top-K values [n, K] and ids [n, K],
    d(sum w * CE_base)/dz [n, V] in the logits' dtype) of one chunk; z = hidden @ W^T."""
    z_nV = F.linear(hidden_nH, lm_head_weight_VH)
    l_nV = scale_and_softcap(z_nV, multiplier, softcap)
    logp_nV = torch.log_softmax(l_nV.float(), dim=-1)
    ce_n = -logp_nV.gather(1, targets_n[:, None]).squeeze(1)
    correct_n = l_nV.argmax(dim=-1) == targets_n
    unary_nK, cand_nK = TOPK_KERNELS[TOPK_KERNEL](l_nV, top_k)
    dl_nV = logp_nV.exp_().mul_(weights_n[:, None])
    dl_nV.scatter_add_(1, targets_n[:, None], -weights_n[:, None])
    dz_nV = dl_nV
    if multiplier is not None or softcap is not None:
        dz_nV = dl_nV * _transform_slope(l_nV, multiplier, softcap)
    return (ce_n * weights_n).sum(), correct_n, unary_nK, cand_nK, dz_nV.to(z_nV.dtype)


@functools.cache
def compiled_unary_chunk():  # noqa: ANN201
    """`unary_chunk` through torch.compile, created on first use (once per process)."""
    return torch.compile(unary_chunk, dynamic=False, fullgraph=True)


def selector_term(
    hidden_nH: torch.Tensor,
    unary_nK: torch.Tensor,
    cand_nK: torch.Tensor,
    targets_n: torch.Tensor,
    predecessors_n: torch.Tensor,
    weights_n: torch.Tensor,
    selector: CandidateSelector,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum w [gold in C] CE_sel, sum w [gold in C], selected-correct [n]) of one chunk, given
    its unary top-K values and ids: the K-way CE of the selector's scores, label = the data
    token's index among the candidates, counted only where it is one of them."""
    scores_nK = selector.scores(hidden_nH, unary_nK.float(), cand_nK, predecessors_n).float()
    hit_nK = cand_nK == targets_n[:, None]
    sel_w_n = weights_n * hit_nK.any(dim=-1)
    sel_ce_n = F.cross_entropy(scores_nK, hit_nK.int().argmax(dim=-1), reduction="none")
    with torch.no_grad():
        chosen_n = cand_nK.gather(1, scores_nK.argmax(dim=-1, keepdim=True))[:, 0]
    return (sel_ce_n * sel_w_n).sum(), sel_w_n.sum(), chosen_n == targets_n


class FusedSelectorCE(torch.autograd.Function):
    """Forward runs each chunk's loss and its gradients (hidden rows and selector parameters);
    backward only scales them: no logits are kept or recomputed."""

    @staticmethod
    def forward(ctx, hidden_NH: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
        *params, spec = args
        if spec["compute_dtype"] is not None:  # once, not per chunk
            spec = {
                **spec,
                "lm_head_weight_VH": spec["lm_head_weight_VH"].to(spec["compute_dtype"]),
            }
        dhidden_NH = torch.empty_like(hidden_NH)
        dparams = [torch.zeros_like(p) for p in params]
        sums = [hidden_NH.new_zeros((), dtype=torch.float32) for _ in range(4)]
        num_rows = hidden_NH.shape[0]
        correct_N = torch.empty(num_rows, dtype=torch.bool, device=hidden_NH.device)
        selected_N = torch.empty_like(correct_N)
        for rows, ce_sum, correct_n, unary_nK, cand_nK, dz_nV in _unary_chunks(hidden_NH, spec):
            # The selector's term by a local autograd pass against the hidden rows and the unary
            # scores (neither with stop_gradient) and the selector's parameters.
            train_backbone = not spec["stop_gradient"]
            h_nH = hidden_NH[rows].detach().requires_grad_(train_backbone)
            unary = unary_nK.detach().float().requires_grad_(train_backbone)
            inputs = ([h_nH, unary] if train_backbone else []) + list(params)
            with torch.enable_grad():
                sel_sum, sel_w, selected_n = selector_term(
                    h_nH, unary, cand_nK, spec["targets_N"][rows], spec["predecessors_N"][rows],
                    spec["weights_N"][rows], spec["selector"],
                )  # fmt: skip
                grads = torch.autograd.grad(spec["alpha"] * sel_sum, inputs, allow_unused=True)
            if train_backbone:
                dh_sel, dunary, grads = grads[0], grads[1], grads[2:]
                slope = _transform_slope(unary_nK, spec["multiplier"], spec["softcap"])
                dz_nV.scatter_add_(1, cand_nK, (dunary * slope).to(dz_nV.dtype))
            dhidden = dz_nV @ spec["lm_head_weight_VH"]
            if train_backbone:
                dhidden = dhidden + dh_sel.to(dhidden.dtype)
            dhidden_NH[rows] = dhidden.to(dhidden_NH.dtype)
            for total, grad in zip(dparams, grads, strict=True):
                if grad is not None:
                    total += grad
            loss = ce_sum + spec["alpha"] * sel_sum.detach()
            parts = (loss, ce_sum, sel_sum.detach(), sel_w.detach())
            sums = [total + part for total, part in zip(sums, parts, strict=True)]
            correct_N[rows], selected_N[rows] = correct_n, selected_n
        ctx.save_for_backward(dhidden_NH, *dparams)
        ctx.mark_non_differentiable(*sums[1:], correct_N, selected_N)
        return (*sums, correct_N, selected_N)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, *_unused: Any):
        dhidden_NH, *dparams = ctx.saved_tensors
        return grad_loss * dhidden_NH, *(grad_loss * d for d in dparams), None


def _unary_chunks(hidden_NH: torch.Tensor, spec: dict[str, Any]):
    """(rows, then `unary_chunk`'s outputs cut to the chunk's real rows) of every chunk. The
    matmuls run in spec's `compute_dtype` (the autocast dtype, or None: the inputs' own; the
    lm_head is already in it) with autocast off; compiled, the last chunk is padded with
    zero-weight rows (target 0)."""
    body = compiled_unary_chunk() if spec["compiled"] else unary_chunk
    weight_VH, dtype = spec["lm_head_weight_VH"], spec["compute_dtype"]
    hidden_NH, chunk_rows = hidden_NH.detach(), spec["chunk_rows"]
    for start in range(0, hidden_NH.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        hidden_nH = hidden_NH[rows] if dtype is None else hidden_NH[rows].to(dtype)
        targets_n, weights_n = spec["targets_N"][rows], spec["weights_N"][rows]
        n = hidden_nH.shape[0]
        if spec["compiled"]:
            hidden_nH, targets_n, weights_n = padded_chunk(
                hidden_nH, targets_n, weights_n, chunk_rows
            )
        with torch.autocast(hidden_NH.device.type, enabled=False):
            ce_sum, correct_n, unary_nK, cand_nK, dz_nV = body(
                hidden_nH, weight_VH, targets_n, weights_n,
                spec["top_k"], spec["multiplier"], spec["softcap"],
            )  # fmt: skip
        yield rows, ce_sum, correct_n[:n], unary_nK[:n], cand_nK[:n], dz_nV[:n]
