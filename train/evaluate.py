"""Held-out evaluation: loss, tau and per-offset accuracy on parts the training never reads.

The held-out parts are read in stored order (no shuffle), split across ranks by token count,
and every micro-batch draws its anchors from a generator seeded by a fixed seed and the batch's
place, so evaluations compare across steps and across runs on the same cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from train.data import PartInfo, PlanDataset, device_batch, make_loader
from train.metrics import StatSums
from train.plan import PlanSpec, plan_epoch
from train.step import forward_loss

EVAL_SEED = 20240917  # fixed: the anchors of an eval batch never depend on the run's seed


class Evaluator:
    """Evaluates a drafter on this rank's share of the held-out parts."""

    def __init__(
        self,
        parts: Sequence[PartInfo],
        *,
        layers: Sequence[int],
        rank: int,
        world_size: int,
        batch_tokens: int,
        max_length: int | None,
        max_batches: int = 0,
    ) -> None:
        self.parts = list(parts)
        spec = PlanSpec(
            lengths=tuple(p.lengths for p in self.parts),
            seed=EVAL_SEED,
            num_streams=world_size,
            batch_tokens=batch_tokens,
            shuffle_buffer=0,
            max_length=max_length,
            shuffle=False,
        )
        mine = len(plan_epoch(spec, epoch=0)[rank]) if self.parts else 0
        limit = min(mine, max_batches) if max_batches else mine
        self.dataset = PlanDataset(
            self.parts, spec, layers=layers, rank=rank, workers=1, limits={0: limit}
        )

    @torch.no_grad()
    def run(
        self,
        drafter: nn.Module,
        embed_VH: torch.Tensor,
        lm_head_VH: torch.Tensor,
        *,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        **step_kwargs: Any,
    ) -> dict[str, Any]:
        """Metrics summed over every rank (a collective: all ranks call it together)."""
        sums = StatSums(step_kwargs["block_size"], device)
        was_training = drafter.training
        drafter.eval()
        loader = make_loader(self.dataset, workers=0, prefetch=1, pin_memory=False)
        for item in loader if self.parts else ():
            if not item["real"]:
                continue
            batch = device_batch(item, device)
            gen = torch.Generator().manual_seed(item["anchor_seed"])
            with autocast():
                out = forward_loss(
                    drafter, embed_VH, lm_head_VH, batch, generator=gen, **step_kwargs
                )
            sums.add(out.weighted_sum, out.weight_total, out.stats, batch.lengths_B.sum())
        drafter.train(was_training)
        result = sums.reduce()
        result.pop("grad_norm")
        return result
