"""Held-out evaluation: loss, tau and per-offset accuracy on parts the training never reads.

The held-out samples (see `train.data.plan.holdout_lengths`) are packed in stored order (no shuffle)
into rows of the training shape, split across ranks in contiguous shares, and every row draws its
anchors from a generator seeded by a fixed seed and the row's place, so evaluations compare
across steps and across runs on the same cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from train.data.catalog import PartInfo
from train.data.loader import PlanDataset, checked, device_batch, make_loader
from train.data.plan import PlanSpec
from train.metrics import StatSums
from train.step import forward_loss

EVAL_SEED = 20240917  # fixed: the anchors of an eval batch never depend on the run's seed


class Evaluator:
    """Evaluates a drafter on this rank's share of the held-out parts."""

    def __init__(
        self,
        parts: Sequence[PartInfo],
        lengths: Sequence[Sequence[int]],
        *,
        layers: Sequence[int],
        rank: int,
        world_size: int,
        batch_tokens: int,
        max_length: int | None,
        max_batches: int = 0,
        first: int = 1,
    ) -> None:
        spec = PlanSpec(
            lengths=tuple(tuple(ls) for ls in lengths),
            seed=EVAL_SEED,
            row_tokens=batch_tokens,
            shuffle_buffer=0,
            max_length=max_length,
            shuffle=False,
        )
        kw = dict(layers=layers, rank=rank, world_size=world_size, workers=1, even=False)
        mine = len(PlanDataset(parts, spec, limits={}, **kw).slices(0)[1][0])
        self.rows = min(mine, max_batches) if max_batches else mine
        self.dataset = PlanDataset(parts, spec, limits={0: self.rows}, **kw)
        self.first = first  # the first drafting block offset (StatSums)

    @classmethod
    def for_run(cls, prep: Any, cfg: Any, *, rank: int, world_size: int) -> Evaluator | None:
        """The evaluator of a run (`train.prepared.Prepared`, `TrainConfig`); None when it
        holds nothing out."""
        if not prep.num_eval:
            return None
        return cls(
            prep.parts,
            prep.eval_lengths,
            layers=prep.layers,
            rank=rank,
            world_size=world_size,
            batch_tokens=cfg.batch_tokens,
            max_length=cfg.max_length,
            max_batches=cfg.eval_batches,
            first=prep.first_draft_slot,
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
        sums = StatSums(step_kwargs["block_size"], device, first=self.first)
        was_training = drafter.training
        drafter.eval()
        loader = make_loader(self.dataset, workers=0, prefetch=1, pin_memory=False)
        for item in checked(iter(loader)) if self.rows else ():
            if not item["real"]:
                continue
            batch = device_batch(item, device)
            gen = torch.Generator().manual_seed(item["anchor_seed"])
            with autocast():
                out = forward_loss(
                    drafter, embed_VH, lm_head_VH, batch, generator=gen, **step_kwargs
                )
            sums.add(out.weighted_sum, out.weight_total, out.stats, batch.num_tokens)
        drafter.train(was_training)
        result = sums.reduce()
        result.pop("grad_norm"), result.pop("steps")
        return result
