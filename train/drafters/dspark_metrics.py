"""DSpark's per-slot metrics: acceptance probability, tau_prob and the confidence calibration.

All device tensors of fixed sizes (summable across micro-batches and ranks, no read-back), and
the host-side summaries of their sums:

- acceptance probability of slot k at temperature 1: 1 - L1_k / 2 (one minus the total
  variation between the drafter's corrected distribution and the target's);
- tau_prob = 1 + mean over kept blocks of sum_k prod_{j<=k} (1 - L1_j / 2), a slot that does not
  count (out of range or unsupervised) ending the product;
- the confidence head's calibration over counted slots: ECE of its probability sigmoid(c_k)
  against c*_k = clamp(1 - L1_k / 2, 0, 1) (the acceptance probability it is trained on) over
  ECE_BINS equal-width bins, and AUC of c_k for the greedy acceptance (the argmax of the
  corrected logits equals the data token, which with teacher forcing is whether greedy
  verification accepts the slot given the slots before it).
"""

from __future__ import annotations

import math

import torch

# Bins of the calibration: ECE over equal-width bins of the predicted probability; AUC from
# per-bin counts of accepted and rejected slots (a pair inside one bin counts one half).
ECE_BINS = 10
AUC_BINS = 256
CALIBRATION_SIZE = 3 * ECE_BINS + 2 * AUC_BINS


def _bins(prob_M: torch.Tensor, bins: int) -> torch.Tensor:
    return (prob_M * bins).long().clamp(0, bins - 1)


def calibration_sums(
    confidence_M: torch.Tensor,
    target_M: torch.Tensor,
    accepted_M: torch.Tensor,
    counted_M: torch.Tensor,
) -> torch.Tensor:
    """Flat [CALIBRATION_SIZE] over the `counted_M` slots: per ECE bin (count, sum of
    probabilities, sum of targets), then per AUC bin the (accepted, rejected) counts. Masks,
    not indexing: no shape depends on the data, so nothing waits for the device.

    >>> sums = calibration_sums(torch.tensor([0.0, 10.0, 3.0]), torch.tensor([0.5, 1.0, 0.0]),
    ...                         torch.tensor([False, True, False]), torch.tensor([1, 1, 0]))
    >>> round(ece(sums.tolist()), 4), auc(sums.tolist())
    (0.0, 1.0)
    """
    prob_M = torch.sigmoid(confidence_M.detach().float())
    counted = counted_M.float()
    out = torch.zeros(CALIBRATION_SIZE, dtype=torch.float32, device=prob_M.device)
    idx_M = _bins(prob_M, ECE_BINS)
    out[:ECE_BINS].index_add_(0, idx_M, counted)
    out[ECE_BINS : 2 * ECE_BINS].index_add_(0, idx_M, prob_M * counted)
    out[2 * ECE_BINS : 3 * ECE_BINS].index_add_(0, idx_M, target_M.detach().float() * counted)
    auc_M = _bins(prob_M, AUC_BINS)
    accepted = accepted_M.float() * counted
    base = 3 * ECE_BINS
    out[base : base + AUC_BINS].index_add_(0, auc_M, accepted)
    out[base + AUC_BINS :].index_add_(0, auc_M, counted - accepted)
    return out


def ece(sums: list[float]) -> float:
    """Expected calibration error from `calibration_sums` (summed): sum over bins of
    count/total * |mean probability - mean target|; nan without slots."""
    count = sums[:ECE_BINS]
    prob, target = sums[ECE_BINS : 2 * ECE_BINS], sums[2 * ECE_BINS : 3 * ECE_BINS]
    total = sum(count)
    if total <= 0:
        return math.nan
    return sum(abs(p - t) for p, t in zip(prob, target, strict=True)) / total


def auc(sums: list[float]) -> float:
    """Area under the ROC curve from the binned counts of `calibration_sums` (summed): the
    chance that an accepted slot has a higher confidence than a rejected one, ties (one bin)
    one half; nan without both kinds.

    >>> auc([0.0] * 3 * ECE_BINS + [1.0] + [0.0] * (AUC_BINS - 1) + [1.0] + [0.0] * (AUC_BINS - 1))
    0.5
    """
    base = 3 * ECE_BINS
    pos, neg = sums[base : base + AUC_BINS], sums[base + AUC_BINS : base + 2 * AUC_BINS]
    total_pos, total_neg = sum(pos), sum(neg)
    if total_pos <= 0 or total_neg <= 0:
        return math.nan
    below, area = 0.0, 0.0
    for p, n in zip(pos, neg, strict=True):
        area += p * (below + 0.5 * n)
        below += n
    return area / (total_pos * total_neg)


def slot_stats(
    l1_BQ: torch.Tensor,
    w_BQ: torch.Tensor,
    keep_BN: torch.Tensor,
    correct_BQ: torch.Tensor,
    confidence_BQ: torch.Tensor | None,
    *,
    block_size: int,
) -> dict[str, torch.Tensor]:
    """`l1_per_slot` [B] (sum over counted slots), `accepted_prob_sum` (sum over kept blocks of
    sum_k prod_{j<=k} (1 - L1_j / 2)), `calibration` [CALIBRATION_SIZE] (zeros without the
    confidence head).

    >>> stats = slot_stats(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]),
    ...                    torch.tensor([[True]]), torch.tensor([[True, False, True]]), None,
    ...                    block_size=3)
    >>> stats["l1_per_slot"].tolist(), float(stats["accepted_prob_sum"])
    ([0.0, 1.0, 0.0], 1.5)
    """
    shape = (l1_BQ.shape[0], -1, block_size)
    valid_BNK = (w_BQ > 0).view(shape)
    l1_BNK = l1_BQ.detach().float().view(shape) * valid_BNK
    accept_BNK = (1.0 - 0.5 * l1_BNK).clamp(0.0, 1.0) * valid_BNK
    accepted_BN = accept_BNK.cumprod(dim=-1).sum(dim=-1) * keep_BN.bool()
    calibration = torch.zeros(CALIBRATION_SIZE, dtype=torch.float32, device=l1_BQ.device)
    if confidence_BQ is not None:
        target_BQ = (1.0 - 0.5 * l1_BQ.detach().float()).clamp(0.0, 1.0)
        calibration = calibration_sums(
            confidence_BQ.flatten(), target_BQ.flatten(), correct_BQ.flatten(), w_BQ.flatten() > 0
        )
    return {
        "l1_per_slot": l1_BNK.sum(dim=(0, 1)),
        "accepted_prob_sum": accepted_BN.sum(),
        "calibration": calibration,
    }
