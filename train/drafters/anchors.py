"""Anchor sampling and the per-block inputs, positions, targets and loss weights.

A row of S context tokens holds whole samples back to back (`doc_ids` numbers them, -1 on
padding; `positions` restart at 0 at each sample). A block j starts at anchor a = anchors[b, j]
(a row index). Its query at offset k (0..block_size-1) sits at row a + k, RoPE position
positions[a] + k, and predicts token x[a + k + shift] when that row is still in a's sample. DFlash
(shift 0): the same position, offset 0 holds the known token x[a] and is never a target. DSpark
(shift 1): the next token, so offset 0 (the anchor's slot) predicts x[a + 1] too. Block tensors
are laid out [B, Q] with Q = N * block_size, block j occupying columns j*block_size ..
(j+1)*block_size - 1.
Every function here treats a packed row exactly as its samples one by one.
"""

from __future__ import annotations

import math

import torch


def anchor_candidates(loss_mask_BS: torch.Tensor, doc_ids_BS: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: p may anchor a block iff p and p + 1 lie in the same sample and are both
    supervised (so p <= S - 2 and the first target x[p + 1] is supervised). Padding has doc -1.

    >>> anchor_candidates(torch.tensor([[1, 1, 1, 1, 1, 0]]), torch.tensor([[0, 0, 1, 1, -1, -1]]))
    tensor([[ True, False,  True, False, False, False]])
    """
    supervised_BS = loss_mask_BS.bool() & (doc_ids_BS >= 0)
    cand_BS = torch.zeros_like(supervised_BS)
    same_doc = doc_ids_BS[:, :-1] == doc_ids_BS[:, 1:]
    cand_BS[:, :-1] = supervised_BS[:, :-1] & supervised_BS[:, 1:] & same_doc
    return cand_BS


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator,
    trim: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` anchors per row without replacement, sorted ascending.

    Candidates are `anchor_candidates`: uniformly over every sample of a packed row, so each
    sample gets anchors in proportion to its candidates. Rows with fewer candidates are padded
    with dropped blocks (keep False, anchor 0). N = min(num_anchors, S) is fixed for the run
    (compiled code sees one shape); `trim` (CPU only, where nothing is compiled) cuts N to the
    most candidates of any row, which reads a count back. Randomness comes from `generator`
    only (drawn on its device), so a restored generator state replays the draw.

    >>> g = torch.Generator().manual_seed(0)
    >>> mask, docs = torch.tensor([[0, 1, 1, 1, 0, 0]]), torch.tensor([[0, 0, 0, 0, 0, -1]])
    >>> sample_anchors(mask, docs, num_anchors=3, generator=g)
    (tensor([[1, 2, 0]]), tensor([[ True,  True, False]]))
    """
    batch, seq = loss_mask_BS.shape
    dev = loss_mask_BS.device
    cand_BS = anchor_candidates(loss_mask_BS, doc_ids_BS)
    # Random keys in [0, 1) for candidates, -1 elsewhere; the top-k keys are a uniform draw
    # without replacement among candidates.
    keys_BS = _to_device(torch.rand(batch, seq, generator=generator, device=generator.device), dev)
    keys_BS = torch.where(cand_BS, keys_BS, torch.full_like(keys_BS, -1.0))
    take = min(num_anchors, seq)
    if trim:
        take = max(1, min(take, int(cand_BS.sum(1).max())))
    top_keys_BN, top_pos_BN = keys_BS.topk(take, dim=1)
    chosen_BN = top_keys_BN >= 0
    # Sort kept anchors ascending and push dropped slots (key seq) to the end.
    sort_keys_BN = torch.where(chosen_BN, top_pos_BN, torch.full_like(top_pos_BN, seq))
    sorted_BN, _ = sort_keys_BN.sort(dim=1)
    keep_BN = sorted_BN < seq
    anchors_BN = torch.where(keep_BN, sorted_BN, torch.zeros_like(sorted_BN))
    return anchors_BN, keep_BN


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`. A CPU tensor goes to a GPU through pinned memory: a copy from pageable
    memory makes the host wait for the device, so it could not queue the step ahead of it."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _offsets(block_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(block_size, device=device)


def block_rows(anchors_BN: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Row indices [B, Q] in the packed row: a, a+1, ..., a+block_size-1 per block.

    >>> block_rows(torch.tensor([[3, 7]]), block_size=2)
    tensor([[3, 4, 7, 8]])
    """
    pos_BNK = anchors_BN[..., None] + _offsets(block_size, anchors_BN.device)
    return pos_BNK.flatten(1)


def block_positions(
    anchors_BN: torch.Tensor, positions_BS: torch.Tensor, *, block_size: int
) -> torch.Tensor:
    """RoPE positions [B, Q]: p, p+1, ..., p+block_size-1 per block, p = the anchor's position
    inside its sample (positions restart at every sample of a packed row).

    >>> block_positions(torch.tensor([[3, 7]]), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    ...                 block_size=2)
    tensor([[3, 4, 3, 4]])
    """
    start_BN = positions_BS.gather(1, anchors_BN).long()
    pos_BNK = start_BN[..., None] + _offsets(block_size, anchors_BN.device)
    return pos_BNK.flatten(1)


def context_starts(anchors_BN: torch.Tensor, positions_BS: torch.Tensor) -> torch.Tensor:
    """[B, N]: the row index where each anchor's sample starts (its first visible context key).

    >>> context_starts(torch.tensor([[3, 6]]), torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
    tensor([[0, 4]])
    """
    return anchors_BN - positions_BS.gather(1, anchors_BN).long()


def block_inputs(
    ids_BS: torch.Tensor, anchors_BN: torch.Tensor, *, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """Block token ids [B, Q]: [x_a, MASK, ..., MASK] per block.

    >>> block_inputs(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 2]]),
    ...              block_size=3, mask_token_id=99)
    tensor([[11, 99, 99, 12, 99, 99]])
    """
    batch, n_blocks = anchors_BN.shape
    out_BNK = ids_BS.new_full((batch, n_blocks, block_size), mask_token_id)
    out_BNK[:, :, 0] = ids_BS.gather(1, anchors_BN)
    return out_BNK.flatten(1)


def block_targets(
    ids_BS: torch.Tensor, anchors_BN: torch.Tensor, *, block_size: int, shift: int = 0
) -> torch.Tensor:
    """Targets [B, Q]: x[a + k + shift] at query offset k. Past the end: the last id (weight 0
    there). With shift 0 these are also DSpark's teacher-forced previous tokens (x[a + k]).

    >>> block_targets(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 2]]), block_size=3)
    tensor([[11, 12, 13, 12, 13, 13]])
    >>> block_targets(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1]]), block_size=3, shift=1)
    tensor([[12, 13, 13]])
    """
    pos_BQ = block_rows(anchors_BN + shift, block_size=block_size)
    return ids_BS.gather(1, pos_BQ.clamp(max=ids_BS.shape[1] - 1))


def loss_weights(
    loss_mask_BS: torch.Tensor,
    doc_ids_BS: torch.Tensor,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    block_size: int,
    gamma: float | None,
    shift: int = 0,
    cumulative: bool = False,
    decay: str = "exp",
) -> torch.Tensor:
    """w[b, j*block_size + k] = keep * [t in a's sample] * loss_mask[t] * [k + shift > 0] *
    exp(-(k + shift - 1)/gamma) with t = a + k + shift, the row of the slot's target. Float32
    [B, Q]. `cumulative` (DSpark): a slot counts only where every earlier slot of its block
    counts (its targets are in range and supervised), as acceptance stops at the first miss.
    `decay` "uniform" drops the exp factor (gamma unused): 1 on every slot that counts.

    >>> w = loss_weights(torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 0, 1]]),
    ...                  torch.tensor([[0]]), torch.tensor([[True]]), block_size=4, gamma=1.0)
    >>> [round(x, 4) for x in w[0].tolist()]
    [0.0, 1.0, 0.3679, 0.0]
    >>> w = loss_weights(torch.tensor([[1, 1, 0, 1, 1]]), torch.tensor([[0, 0, 0, 0, 0]]),
    ...                  torch.tensor([[0]]), torch.tensor([[True]]), block_size=4, gamma=1.0,
    ...                  shift=1, cumulative=True)
    >>> [round(x, 4) for x in w[0].tolist()]
    [1.0, 0.0, 0.0, 0.0]
    >>> loss_weights(torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 0, 1]]),
    ...              torch.tensor([[0]]), torch.tensor([[True]]), block_size=4, gamma=None,
    ...              decay="uniform").tolist()
    [[0.0, 1.0, 1.0, 0.0]]
    """
    if decay not in ("exp", "uniform"):
        raise ValueError(f"decay must be 'exp' or 'uniform', got {decay!r}")
    if decay == "exp" and gamma is None:
        raise ValueError("decay 'exp' needs gamma")
    seq = loss_mask_BS.shape[1]
    k_K = _offsets(block_size, anchors_BN.device)
    pos_BNK = anchors_BN[..., None] + k_K + shift
    idx_BQ = pos_BNK.clamp(max=seq - 1).flatten(1)
    doc_BN = doc_ids_BS.gather(1, anchors_BN)
    same_doc_BNK = (doc_ids_BS.gather(1, idx_BQ).view_as(pos_BNK) == doc_BN[..., None]) & (
        pos_BNK < seq
    )
    supervised_BNK = loss_mask_BS.gather(1, idx_BQ).view_as(pos_BNK).bool()
    counts_BNK = same_doc_BNK & supervised_BNK
    if cumulative:
        counts_BNK = counts_BNK.long().cumprod(dim=-1).bool()
    decay_K = (k_K + shift > 0).float()
    if decay == "exp":
        decay_K = decay_K * torch.exp(-(k_K.float() + shift - 1.0) / gamma)
    w_BNK = keep_BN[..., None] * counts_BNK * decay_K
    return w_BNK.float().flatten(1)


# DSpark's slot weights are exp(-k / 4) whatever the block (DeepSpec's constant).
DSPARK_GAMMA = 4.0


def default_gamma(block_size: int, *, anchor_predicts: bool = False) -> float:
    """Loss decay gamma for a block size: 7 for 16, 4 for 8 (the published settings); 4 for any
    DSpark block (`anchor_predicts`).

    Other sizes scale linearly with the block, rounded half up, at least 1:
    gamma = max(1, floor(7 * block_size / 16 + 0.5)).

    >>> [default_gamma(b) for b in (4, 8, 10, 16, 32)], default_gamma(16, anchor_predicts=True)
    ([2.0, 4.0, 4.0, 7.0, 14.0], 4.0)
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    if anchor_predicts:
        return DSPARK_GAMMA
    return float(max(1, math.floor(7 * block_size / 16 + 0.5)))
