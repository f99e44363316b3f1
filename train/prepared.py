"""What `train.run` resolves once from the cache and hands to every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from train.data.catalog import PartInfo
from train.data.follow import CacheView
from train.data.plan import PlanSpec, epoch_lengths
from train.drafters.config import DrafterConfig


@dataclass(frozen=True)
class FollowPlan:
    """A run on a cache that an extraction is still writing (train/following.py)."""

    view: CacheView  # the committed prefix when the run started
    rows_estimate: int  # rows of the first pass over the finished cache, fixed at the run's start
    identity: dict[str, Any]  # the cache's manifest identity: it must not change under the run


@dataclass(frozen=True)
class Prepared:
    """What `train.run` resolves once from the cache and hands to every rank."""

    drafter: DrafterConfig
    parts: tuple[PartInfo, ...]
    # per part, every sample's length in training / in evaluation (0: not in that set)
    train_lengths: tuple[tuple[int, ...], ...]
    eval_lengths: tuple[tuple[int, ...], ...]
    layers: tuple[int, ...]  # positions in the cached layer axis, in the drafter's order
    gamma: float | None  # the exp slot weights' decay (None with other slot weights)
    follow: FollowPlan | None = None  # set when the run follows a running extraction
    # (ranks, loader streams) of a finished run resumed with other ones (`--gpus`, `--workers`):
    # its data plan, and so its length, is theirs; it only evaluates and exports
    trained_with: tuple[int, int] | None = None
    # the cache's target as an export records it (`train.export_hf.target_record`)
    target: dict[str, Any] | None = None

    @property
    def first_draft_slot(self) -> int:
        """The first block offset that drafts: 0 when the anchor's slot predicts (DSpark)."""
        return 0 if self.drafter.anchor_predicts else 1

    def data_plan(self, world_size: int, workers: int) -> tuple[int, int]:
        """(ranks, loader streams) whose data plan the run follows: this command's, or the
        finished run's (`trained_with`)."""
        return self.trained_with or (world_size, max(workers, 1))

    def train_spec(self, cfg: Any) -> PlanSpec:
        """The training samples' data plan settings under `cfg` (a TrainConfig)."""
        return PlanSpec(
            lengths=self.train_lengths,
            seed=cfg.seed,
            row_tokens=cfg.batch_tokens,
            shuffle_buffer=cfg.shuffle_buffer,
            max_length=cfg.max_length,
        )

    def epoch_plan(self, cfg: Any, ranks: int) -> tuple[list[int], int]:
        """(rows per rank of each epoch, optimizer steps) of a run that does not follow an
        extraction, on `ranks`: --steps, or --epochs passes. ValueError as `epoch_lengths`."""
        by_steps = cfg.steps is not None
        limits = epoch_lengths(
            self.train_spec(cfg),
            world_size=ranks,
            grad_accum=cfg.grad_accum,
            epochs=None if by_steps else cfg.epochs,
            steps=cfg.steps,
        )
        return limits, cfg.steps if by_steps else sum(limits) // cfg.grad_accum

    @property
    def num_eval(self) -> int:
        return sum(1 for ls in self.eval_lengths for n in ls if n > 0)
