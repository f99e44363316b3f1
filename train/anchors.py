"""Anchor sampling and the per-block inputs, positions, targets and loss weights.

A block j starts at anchor a = anchors[b, j]. Its query at offset k (0..block_size-1) sits at
absolute position a + k and predicts token x[a + k] (same position, no shift); offset 0 holds the
known token x[a] and is never a target. Block tensors are laid out [B, Q] with
Q = N * block_size, block j occupying columns j*block_size .. (j+1)*block_size - 1.
"""

from __future__ import annotations

import math

import torch


def sample_anchors(
    loss_mask_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    num_anchors: int,
    generator: torch.Generator,
    trim: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` anchors per sequence without replacement, sorted ascending.

    Candidates are positions p with p + 1 < length and loss_mask[p] = loss_mask[p + 1] = 1
    (so p <= S - 2 and the first target x[p + 1] is supervised). Sequences with fewer
    candidates are padded with dropped blocks: keep False, anchor 0. N = min(num_anchors, S):
    a sequence never has more than S candidates, and sizing N by the (128-padded) length keeps
    short batches small without a device sync and with few distinct shapes. Randomness comes from
    `generator` only (drawn on its device), so a restored generator state replays the draw.

    >>> g = torch.Generator().manual_seed(0)
    >>> mask = torch.tensor([[0, 1, 1, 1, 0, 0]])
    >>> sample_anchors(mask, torch.tensor([5]), num_anchors=3, generator=g)
    (tensor([[1, 2, 0]]), tensor([[ True,  True, False]]))
    """
    batch, seq = loss_mask_BS.shape
    dev = loss_mask_BS.device
    supervised_BS = loss_mask_BS.bool() & (torch.arange(seq, device=dev) < lengths_B[:, None])
    cand_BS = torch.zeros_like(supervised_BS)
    cand_BS[:, :-1] = supervised_BS[:, :-1] & supervised_BS[:, 1:]
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


def block_positions(anchors_BN: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """Absolute positions [B, Q]: a, a+1, ..., a+block_size-1 per block.

    >>> block_positions(torch.tensor([[3, 7]]), block_size=2)
    tensor([[3, 4, 7, 8]])
    """
    pos_BNK = anchors_BN[..., None] + _offsets(block_size, anchors_BN.device)
    return pos_BNK.flatten(1)


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
    ids_BS: torch.Tensor, anchors_BN: torch.Tensor, *, block_size: int
) -> torch.Tensor:
    """Targets [B, Q]: x[a + k] at query offset k. Past the end: the last id (weight 0 there).

    >>> block_targets(torch.tensor([[10, 11, 12, 13]]), torch.tensor([[1, 2]]), block_size=3)
    tensor([[11, 12, 13, 12, 13, 13]])
    """
    pos_BQ = block_positions(anchors_BN, block_size=block_size).clamp(max=ids_BS.shape[1] - 1)
    return ids_BS.gather(1, pos_BQ)


def loss_weights(
    loss_mask_BS: torch.Tensor,
    lengths_B: torch.Tensor,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    block_size: int,
    gamma: float,
) -> torch.Tensor:
    """w[b, j*block_size + k] = keep * [a+k < len] * [k > 0] * loss_mask[a+k] * exp(-(k-1)/gamma).

    Float32 [B, Q].

    >>> w = loss_weights(torch.tensor([[1, 1, 1, 0]]), torch.tensor([4]), torch.tensor([[0]]),
    ...                  torch.tensor([[True]]), block_size=4, gamma=1.0)
    >>> [round(x, 4) for x in w[0].tolist()]
    [0.0, 1.0, 0.3679, 0.0]
    """
    seq = loss_mask_BS.shape[1]
    k_K = _offsets(block_size, anchors_BN.device)
    pos_BNK = anchors_BN[..., None] + k_K
    in_len_BNK = pos_BNK < lengths_B[:, None, None]
    supervised_BNK = loss_mask_BS.gather(1, pos_BNK.clamp(max=seq - 1).flatten(1)).view_as(pos_BNK)
    decay_K = torch.exp(-(k_K.float() - 1.0) / gamma) * (k_K > 0)
    w_BNK = keep_BN[..., None] * in_len_BNK * supervised_BNK.bool() * decay_K
    return w_BNK.float().flatten(1)


def default_gamma(block_size: int) -> float:
    """Loss decay gamma for a block size: 7 for 16, 4 for 8 (the published settings).

    Other sizes scale linearly with the block, rounded half up, at least 1:
    gamma = max(1, floor(7 * block_size / 16 + 0.5)).

    >>> [default_gamma(b) for b in (4, 8, 10, 16, 32)]
    [2.0, 4.0, 4.0, 7.0, 14.0]
    """
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    return float(max(1, math.floor(7 * block_size / 16 + 0.5)))
