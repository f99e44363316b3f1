"""Gaussian noise on the cached hidden states a training step feeds the drafter (`--noise-std`).

The drafter then learns from states near the cached ones, as a serving engine's states (other
kernels, batch shapes, precision) are. Evaluation and decoding see the states unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from train.data.batch import Batch

# Added to a micro-batch's anchor seed, so that its noise and its anchors come from two streams.
NOISE_SEED_OFFSET = 0x6E6F697365


def noised(batch: Batch, *, std: float, seed: int) -> Batch:
    """`batch` with N(0, std^2) noise added to the hidden states of its real tokens (padding stays
    zero), drawn on the batch's device from a generator seeded with `seed + NOISE_SEED_OFFSET`:
    the same micro-batch gets the same noise in a resumed run. `std` 0 returns `batch` itself.

    >>> ids = torch.zeros(1, 3, dtype=torch.long)
    >>> b = Batch.one_per_row(torch.tensor([2]), ids_BS=ids, loss_mask_BS=ids,
    ...                       hidden_BSKH=torch.zeros(1, 3, 2, 4))
    >>> n = noised(b, std=0.5, seed=1).hidden_BSKH
    >>> bool(n[0, :2].abs().gt(0).all()), bool(n[0, 2].eq(0).all())
    (True, True)
    """
    if std == 0:
        return batch
    field = "hidden_BSKH" if batch.hidden_BSKH is not None else "context_BSC"
    states = getattr(batch, field)
    gen = torch.Generator(device=states.device).manual_seed(seed + NOISE_SEED_OFFSET)
    noise = torch.randn(states.shape, generator=gen, device=states.device, dtype=torch.float32)
    real = (batch.doc_ids_BS >= 0).reshape(*batch.doc_ids_BS.shape, *[1] * (states.ndim - 2))
    out = (states.float() + noise * std * real).to(states.dtype)
    return dataclasses.replace(batch, **{field: out})
