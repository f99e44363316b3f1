"""The learning-rate schedule of the recipe: linear warmup, then cosine to 0."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, total: int, warmup: int) -> float:
    """Multiplier of the peak lr at optimizer step `step`: linear warmup, cosine to 0.

    >>> [round(lr_factor(s, total=10, warmup=2), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, *, total: int, warmup: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler of a run of `total` optimizer steps, the first `warmup` fraction (rounded
    up) warming up."""
    steps = math.ceil(warmup * total) if warmup > 0 else 0
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total=total, warmup=steps)
    )
