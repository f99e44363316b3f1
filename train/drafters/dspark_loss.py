"""DSpark's training objective (DeepSpec's; ../shared/DSPARK.md), in chunks of rows.

Per slot k of a block anchored at p (all fp32 at temperature 1): the corrected logits
l_k = lm_head(h_k) + W2 @ W1[x_{p+k}] (teacher-forced Markov bias), the label y_k = x_{p+k+1}, the
target's distribution t_k = lm_head(last_hidden[p+k]) (the target's own prediction of token
p+k+1, from the cached last hidden state, which is after the final norm), and the weights w_k
(train/drafters/anchors.py `loss_weights` with shift 1, cumulative, exp(-k/gamma)):

    CE   = sum w_k CE(l_k, y_k)
    L1   = sum w_k ||softmax(l_k) - softmax(t_k)||_1           (twice the total variation)
    conf = sum w_k BCEWithLogits(c_k, c*_k),  c*_k = clamp(1 - L1_k / 2, 0, 1), detached
    loss = ce_weight CE + l1_weight L1 + conf_weight conf        (0.1, 0.9, 1.0)

returned as (loss, sum w_k): the caller divides once over the whole optimizer step. The head's
inputs are not detached, so the confidence term trains the backbone and W1 too. Mode "ce" (a cache
without the last layer) trains CE alone (loss = CE), and no confidence head.

Vocabulary-sized tensors exist one chunk of rows at a time: the drafter's logits, the Markov bias
and the target's logits of a chunk, never [rows, V] for the whole micro-batch. `fused` forms each
chunk's gradient in the forward (d/dl of CE is q - onehot(y); of ||q - p||_1 it is
q * (s - <s, q>) with s = sign(q - p)), so nothing is kept or recomputed but d(hidden), d(W1 rows)
and d(W2); otherwise each chunk runs under non-reentrant activation checkpointing.

Blocks overlap (512 anchors of 16 in 3,072 tokens read each position's state 2.7 times on
average), so the target's lm_head runs once per distinct state a chunk reads (`TargetRows`,
`chunk_reads`), not once per row: the same logits, fewer of them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from train.drafters.config import DSPARK_LOSSES
from train.drafters.dspark import DSparkDrafter
from train.drafters.dspark_metrics import slot_stats
from train.drafters.loss import acceptance_stats, autocast_dtype
from train.drafters.target_rows import TargetRows, chunk_logits, chunk_reads


@dataclass(frozen=True)
class DSparkLoss:
    """The objective's weights, and its mode: "full" (CE, L1 and the confidence BCE) or "ce"."""

    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    mode: str = "full"

    def __post_init__(self) -> None:
        if self.mode not in DSPARK_LOSSES:
            raise ValueError(f"dspark_loss must be one of {DSPARK_LOSSES}, got {self.mode!r}")

    @property
    def coefficients(self) -> tuple[float, float]:
        """(the CE's, the L1's) weight in the loss."""
        return (self.ce_weight, self.l1_weight) if self.mode == "full" else (1.0, 0.0)


def dspark_loss(cfg: Any) -> DSparkLoss | None:
    """The DSpark objective of a TrainConfig's options (None for the other families)."""
    if cfg.drafter_type != "dspark":
        return None
    return DSparkLoss(
        ce_weight=cfg.dspark_ce_weight,
        l1_weight=cfg.dspark_l1_weight,
        conf_weight=cfg.dspark_conf_weight,
        mode=cfg.dspark_loss,
    )


def chunk_terms(
    hidden_nH: torch.Tensor,
    emb_nr: torch.Tensor | None,
    lm_head_VH: torch.Tensor,
    w2_Vr: torch.Tensor | None,
    labels_n: torch.Tensor,
    last_uH: torch.Tensor | None,
    place_n: torch.Tensor | None,
    weights_n: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum w CE, sum w L1, L1 per row [n] (zeros without `last_uH`), argmax-correct [n]); row i
    reads the target's state last_uH[place_n[i]].

    >>> h, lm = torch.eye(2), torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    >>> ce, l1, l1_n, ok = chunk_terms(h, None, lm, None, torch.tensor([0, 0]), h,
    ...                                torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    >>> round(float(ce), 4), float(l1), ok.tolist()
    (2.2539, 0.0, [True, False])
    """
    logits_nV = F.linear(hidden_nH, lm_head_VH)
    if emb_nr is not None:
        logits_nV = logits_nV + F.linear(emb_nr.to(w2_Vr.dtype), w2_Vr).to(logits_nV.dtype)
    logp_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ce_n = -logp_nV.gather(1, labels_n[:, None]).squeeze(1)
    l1_n = torch.zeros_like(ce_n)
    if last_uH is not None:
        with torch.no_grad():
            target_uV = F.linear(last_uH.to(lm_head_VH.dtype), lm_head_VH)
            target_nV = torch.softmax(target_uV[place_n].float(), dim=-1)
        l1_n = (logp_nV.exp() - target_nV).abs().sum(dim=-1)
    with torch.no_grad():
        correct_n = logits_nV.argmax(dim=-1) == labels_n
    return (ce_n * weights_n).sum(), (l1_n * weights_n).sum(), l1_n.detach(), correct_n


def fused_chunk(
    hidden_nH: torch.Tensor,
    emb_nr: torch.Tensor | None,
    lm_head_VH: torch.Tensor,
    w2_Vr: torch.Tensor | None,
    labels_n: torch.Tensor,
    target_uV: torch.Tensor | None,
    place_n: torch.Tensor | None,
    weights_n: torch.Tensor,
    ce_weight: float,
    l1_weight: float,
) -> tuple[torch.Tensor, ...]:
    """`chunk_terms` plus the gradient of ce_weight * CE + l1_weight * L1, formed here:
    (ce, l1, l1_n, correct_n, d/d(hidden) [n, H], d/d(emb) [n, r] or None, d/d(W2) [V, r] or
    None), in the inputs' dtypes. The target's logits `target_uV` come made (the lm_head of
    the distinct states the chunk reads; rows beyond them unread): a compiled body has one
    shape, and their number varies."""
    logits_nV = F.linear(hidden_nH, lm_head_VH)
    if emb_nr is not None:
        logits_nV = logits_nV + F.linear(emb_nr, w2_Vr)
    logp_nV = torch.log_softmax(logits_nV.float(), dim=-1)
    ce_n = -logp_nV.gather(1, labels_n[:, None]).squeeze(1)
    correct_n = logits_nV.argmax(dim=-1) == labels_n
    q_nV = logp_nV.exp()
    grad_nV = q_nV * ce_weight
    grad_nV.scatter_add_(1, labels_n[:, None], torch.full_like(ce_n[:, None], -ce_weight))
    l1_n = torch.zeros_like(ce_n)
    if target_uV is not None:
        target_nV = torch.softmax(target_uV[place_n].float(), dim=-1)
        sign_nV = torch.sign(q_nV - target_nV)
        l1_n = (q_nV - target_nV).abs().sum(dim=-1)
        centred_nV = sign_nV - (sign_nV * q_nV).sum(dim=-1, keepdim=True)
        grad_nV = grad_nV + l1_weight * q_nV * centred_nV
    grad_nV = (grad_nV * weights_n[:, None]).to(logits_nV.dtype)
    d_hidden = grad_nV @ lm_head_VH
    d_emb = d_w2 = None
    if emb_nr is not None:
        d_emb, d_w2 = grad_nV @ w2_Vr, grad_nV.t() @ emb_nr
    terms = ((ce_n * weights_n).sum(), (l1_n * weights_n).sum(), l1_n, correct_n)
    return (*terms, d_hidden, d_emb, d_w2)


@functools.cache
def compiled_fused_chunk():  # noqa: ANN201
    """`fused_chunk` through torch.compile, created on first use (once per process)."""
    return torch.compile(fused_chunk, dynamic=False)


@dataclass
class DSparkTerms:
    """Sums over rows: `loss` = ce_weight * CE + l1_weight * L1 (the one to backpropagate; the
    confidence term is added by the caller), the two sums (detached), and per row L1 (detached,
    zeros without the target's state) and whether the argmax of the corrected logits is the
    label."""

    loss: torch.Tensor
    ce_sum: torch.Tensor
    l1_sum: torch.Tensor
    l1_N: torch.Tensor
    correct_N: torch.Tensor


def _rows(spec: dict, start: int, stop: int, compute_dtype: torch.dtype | None):
    """The chunk's row tensors (hidden, emb, labels, weights), hidden and emb cast to
    `compute_dtype`."""
    out = []
    for name in ("hidden_NH", "emb_Nr", "labels_N", "weights_N"):
        t = spec[name]
        t = None if t is None else t[start:stop]
        cast = compute_dtype is not None and name in ("hidden_NH", "emb_Nr")
        out.append(t.to(compute_dtype) if t is not None and cast else t)
    return out


def _padded(rows: list, size: int) -> list:
    """Row tensors padded with zero rows to `size` (weight 0, label 0, place 0: the chunk's
    first distinct state): one compiled graph serves every chunk, the last one too."""
    return [
        None if t is None else F.pad(t, (0, 0) * (t.dim() - 1) + (0, size - t.shape[0]))
        for t in rows
    ]


def _fused_loop(spec: dict) -> tuple[torch.Tensor, ...]:
    """Every chunk of `fused_chunk`: (ce, l1, l1_N, correct_N, d_hidden, d_emb, d_w2)."""
    dtype, size = spec["compute_dtype"], spec["chunk_rows"]
    body = compiled_fused_chunk() if spec["compiled"] else fused_chunk
    lm_head, w2 = spec["lm_head_VH"], spec["w2_Vr"]
    if dtype is not None:
        lm_head, w2 = lm_head.to(dtype), None if w2 is None else w2.to(dtype)
    hidden, emb = spec["hidden_NH"], spec["emb_Nr"]
    num, dev = hidden.shape[0], hidden.device
    ce = torch.zeros((), dtype=torch.float32, device=dev)
    l1 = torch.zeros((), dtype=torch.float32, device=dev)
    l1_N = torch.zeros(num, dtype=torch.float32, device=dev)
    correct_N = torch.zeros(num, dtype=torch.bool, device=dev)
    d_hidden = torch.empty_like(hidden)
    d_emb = None if emb is None else torch.empty_like(emb)
    d_w2 = None if w2 is None else torch.zeros_like(spec["w2_Vr"])
    # compiled: the target's logits in one [chunk_rows, V] buffer whatever their number
    buffer = None
    if spec["compiled"] and spec["target"] is not None:
        buffer = torch.empty(size, lm_head.shape[0], dtype=lm_head.dtype, device=dev)
    for chunk, start in enumerate(range(0, num, size)):
        h, e, labels, weights = _rows(spec, start, start + size, dtype)
        n = h.shape[0]
        with torch.autocast(dev.type, enabled=False):
            target_uV, place = chunk_logits(spec["target"], spec["reads"], chunk, lm_head, buffer)
            if spec["compiled"]:
                h, e, labels, place, weights = _padded([h, e, labels, place, weights], size)
            out = body(h, e, lm_head, w2, labels, target_uV, place, weights, *spec["coef"])
        ce, l1 = ce + out[0], l1 + out[1]
        rows = slice(start, start + n)
        l1_N[rows], correct_N[rows], d_hidden[rows] = out[2][:n], out[3][:n], out[4][:n]
        if e is not None:
            d_emb[rows] = out[5][:n]
            d_w2 += out[6].to(d_w2.dtype)
    return ce, l1, l1_N, correct_N, d_hidden, d_emb, d_w2


class _FusedTerms(torch.autograd.Function):
    """Forward forms every chunk's terms and gradients; backward only scales the gradients."""

    @staticmethod
    def forward(ctx, hidden_NH, emb_Nr, w2_Vr, spec: dict):  # noqa: ANN001, ANN205
        spec = {**spec, "hidden_NH": hidden_NH.detach(), "w2_Vr": w2_Vr}
        spec["emb_Nr"] = None if emb_Nr is None else emb_Nr.detach()
        if w2_Vr is not None:
            spec["w2_Vr"] = w2_Vr.detach()
        ce, l1, l1_N, correct_N, d_hidden, d_emb, d_w2 = _fused_loop(spec)
        ctx.save_for_backward(d_hidden, d_emb, d_w2)
        ctx.mark_non_differentiable(ce, l1, l1_N, correct_N)
        ce_weight, l1_weight = spec["coef"]
        return ce_weight * ce + l1_weight * l1, ce, l1, l1_N, correct_N

    @staticmethod
    def backward(ctx, grad_loss, *_unused):  # noqa: ANN001, ANN205
        grads = [None if g is None else grad_loss * g for g in ctx.saved_tensors]
        return (*grads, None)


def chunked_terms(
    hidden_NH: torch.Tensor,
    emb_Nr: torch.Tensor | None,
    lm_head_VH: torch.Tensor,
    w2_Vr: torch.Tensor | None,
    labels_N: torch.Tensor,
    target: TargetRows | None,
    weights_N: torch.Tensor,
    *,
    chunk_rows: int,
    coef: tuple[float, float],
    checkpoint: bool = True,
    fused: bool = False,
    compiled: bool = False,
) -> DSparkTerms:
    """CE and L1 over rows in chunks of `chunk_rows` (see the module docstring): `emb_Nr` the
    rows' W1[previous token] (None without a Markov head), `w2_Vr` W2, `target` the target's
    last hidden state each row reads (None: no L1). The lm_head is frozen: its gradient is never
    formed. `fused` (with grad) forms each chunk's gradient in the forward; `compiled` runs its
    chunk body through torch.compile. Else, with `checkpoint`, chunks recompute in backward."""
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    lm_head_VH, weights_N = lm_head_VH.detach(), weights_N.detach().float()
    grad = torch.is_grad_enabled() and hidden_NH.requires_grad
    reads = None
    if target is not None:
        target = TargetRows(target.states_MH.detach(), target.index_N)
        reads = chunk_reads(target.index_N, target.states_MH.shape[0], chunk_rows)
    if fused and grad:
        spec = dict(
            lm_head_VH=lm_head_VH,
            labels_N=labels_N,
            target=target,
            reads=reads,
            weights_N=weights_N,
            chunk_rows=chunk_rows,
            coef=coef,
            compiled=compiled,
            compute_dtype=autocast_dtype(hidden_NH.device.type),
        )
        return DSparkTerms(*_FusedTerms.apply(hidden_NH, emb_Nr, w2_Vr, spec))
    ce = l1 = hidden_NH.new_zeros((), dtype=torch.float32)
    l1_parts, correct_parts = [], []
    spec = dict(hidden_NH=hidden_NH, emb_Nr=emb_Nr, labels_N=labels_N, weights_N=weights_N)
    for chunk, start in enumerate(range(0, hidden_NH.shape[0], chunk_rows)):
        h, e, labels, weights = _rows(spec, start, start + chunk_rows, None)
        last = place = None
        if target is not None:
            distinct, place = reads[chunk]
            last = target.states_MH[distinct]
        args = (h, e, lm_head_VH, w2_Vr, labels, last, place, weights)
        if checkpoint and grad:
            out = activation_checkpoint(chunk_terms, *args, use_reentrant=False)
        else:
            out = chunk_terms(*args)
        ce, l1 = ce + out[0], l1 + out[1]
        l1_parts.append(out[2])
        correct_parts.append(out[3])
    l1_N, correct_N = torch.cat(l1_parts), torch.cat(correct_parts)
    loss = coef[0] * ce + coef[1] * l1
    return DSparkTerms(loss, ce.detach(), l1.detach(), l1_N, correct_N)


def dspark_step_terms(
    drafter: DSparkDrafter,
    hidden_BQH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_BQ: torch.Tensor,
    prev_BQ: torch.Tensor,
    target: TargetRows | None,
    w_BQ: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    chunk_rows: int,
    checkpoint: bool,
    fused: bool = False,
    compiled: bool = False,
    options: DSparkLoss,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, sum w, stats) of one micro-batch (see the module docstring).

    `hidden_BQH`: the drafter's final hidden states of every slot; `labels_BQ` x[p+k+1],
    `prev_BQ` x[p+k] (the teacher-forced previous tokens), `target` the target's last hidden
    states and, for each slot in [B, Q] order, the one at its row p+k (None in mode "ce"),
    `w_BQ` the cumulative slot weights. stats: the `acceptance_stats` of the greedy drafts from
    slot 0, `dspark_metrics.slot_stats`, and the three terms' sums (`ce_sum`, `l1_sum`,
    `conf_sum`) and `has_target` (1 when L1 was measured).
    """
    if (options.mode == "full") != (target is not None):
        raise ValueError(
            f"dspark_loss {options.mode!r}: the target's last hidden state is "
            f"{'missing' if target is None else 'given but unused'}"
        )
    if options.mode == "ce" and drafter.confidence_head is not None:
        raise ValueError("dspark_loss 'ce' cannot train a confidence head: build it without one")
    emb_BQr = drafter.prev_embeddings(prev_BQ)
    head = drafter.markov_head
    terms = chunked_terms(
        hidden_BQH.flatten(0, 1),
        None if emb_BQr is None else emb_BQr.flatten(0, 1),
        lm_head_VH,
        None if head is None else head.markov_w2.weight,
        labels_BQ.flatten(),
        target,
        w_BQ.flatten(),
        chunk_rows=chunk_rows,
        coef=options.coefficients,
        checkpoint=checkpoint,
        fused=fused,
        compiled=compiled,
    )
    l1_BQ, correct_BQ = terms.l1_N.view_as(labels_BQ), terms.correct_N.view_as(labels_BQ)
    confidence_BQ = drafter.confidence(hidden_BQH, emb_BQr)
    loss, conf_sum = terms.loss, w_BQ.new_zeros(())
    if confidence_BQ is not None:
        target_BQ = (1.0 - 0.5 * l1_BQ).clamp(0.0, 1.0)
        bce_BQ = F.binary_cross_entropy_with_logits(
            confidence_BQ.float(), target_BQ, reduction="none"
        )
        conf_sum = (bce_BQ * w_BQ).sum()
        loss = loss + options.conf_weight * conf_sum
    size = dict(block_size=drafter.cfg.block_size)
    stats = acceptance_stats(correct_BQ, w_BQ, keep_BN, **size, first=0)
    stats.update(slot_stats(l1_BQ, w_BQ, keep_BN, correct_BQ, confidence_BQ, **size))
    stats["ce_sum"], stats["l1_sum"], stats["conf_sum"] = terms.ce_sum, terms.l1_sum, conf_sum
    stats["has_target"] = w_BQ.new_full((), float(target is not None))
    return loss, w_BQ.sum(), stats
