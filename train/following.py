"""Training while the extraction is still writing the cache.

A run on a cache whose manifest is incomplete (or that is not there yet while an extraction is
starting) *follows* it, unless `--no-follow`:

- The launching process waits until the committed parts hold the rows of one optimizer step,
  logs that it follows the extraction and how many parts it has, and fixes the run's length:
  `--steps`, or `--epochs` times the rows of a pass over the finished cache, estimated from the
  committed parts (their rows per source row, times the manifest's source rows). A run that will
  end within the first pass says so.
- Epoch 0 is the first pass, planned as parts are committed (`train.data.growing`: unit order,
  shuffled within windows of `--shuffle-buffer` samples); epochs 1, 2, ... are the whole cache's,
  as a run on a finished cache plans them.
- Each rank trains while the next step's rows are planned on every rank; otherwise all ranks wait
  together (`Following.catch_up`), agreeing every half second through one small all-reduce, which
  also carries a stop signal: the run then saves a checkpoint and ends as on any stop. The wait
  says whether the extraction runs; a killed or stopped one is waited for until the same extract
  command resumes it.
- A checkpoint records the plan's view of the cache (the parts, with their rows and tokens) and
  the estimate; a resumed run keeps following with them, whether or not the extraction finished
  in between, so it reads exactly the rows and has exactly the schedule it would have had.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from shared.dist import RankInfo, broadcast_object
from shared.manifest import CacheMismatch
from shared.stopping import Stopped, StopRequest, StopRun
from train.config import TrainConfig
from train.data.follow import POLL_S, CacheChanged, ManifestWatch, extraction_state
from train.data.growing import GrowingRows
from train.data.loader import LoaderState
from train.data.plan import PlanSpec, epoch_lengths
from train.follow_start import first_pass, holdout, say_waiting, total_steps
from train.prepared import FollowPlan, Prepared

log = logging.getLogger(__name__)

COMPLETE = 2**62  # "every row": what a rank whose view is complete offers in the agreement


# --- a rank ----------------------------------------------------------------------------------


class Following:
    """A rank's side of the run: the first pass's plan, how much of it every rank has, and the
    wait for more."""

    def __init__(
        self, cfg: TrainConfig, plan: FollowPlan, info: RankInfo, *, ranks: int | None = None
    ) -> None:
        """`ranks`: those the run's length is planned for (a finished run's, resumed on other
        ones, `Prepared.trained_with`); the run's own by default."""
        self.cfg, self.info = cfg, info
        self.view = plan.view
        # Under torchrun every rank estimated by itself: rank 0's is the run's.
        self.rows_estimate = int(broadcast_object(plan.rows_estimate))
        self.watch = ManifestWatch(cfg.data, plan.identity)
        self.total = total_steps(cfg, self.rows_estimate, ranks or info.world_size)
        self.plan = first_pass(cfg, self.view, complete=self.view.complete)
        self.limits: list[int] = []  # micro-batches per epoch, once the cache is complete
        self.available = 0  # micro-batches of the first pass every rank has planned
        self.complete = False  # every rank's view is complete: the whole pass is planned
        self.epoch: int | None = None  # the loader's epoch after the last step

    def ready(self, state: LoaderState) -> bool:
        """Whether the next optimizer step's micro-batches are planned on every rank."""
        return self.complete or state.consumed + self.cfg.grad_accum <= self.available

    def catch_up(self, state: LoaderState, *, step: int, stop: StopRequest) -> bool:
        """Wait, with every rank, until the next step's rows are planned on every rank; False
        when a stop signal reached any rank first. Collective: every rank calls it at the same
        step (`ready` is the same on all)."""
        said, start = None, time.monotonic()
        if self.epoch is None:
            self.epoch = state.epoch
        while True:
            # the extraction's state before the manifest (`say_waiting`), on the rank that says it
            extraction = extraction_state(self.cfg.data) if self.info.is_main else ""
            grown = self.watch.grow(self.view)
            if grown is not self.view:
                self.view = grown
                self.plan.extend(holdout(self.cfg, grown)[0], complete=grown.complete)
            world = self.info.world_size
            mine = COMPLETE if self.plan.complete else self.plan.rank_rows(world_size=world)
            available, stopping = _agree(mine, stop.requested, self.info.device)
            if stopping:
                return False
            if available == COMPLETE or state.consumed + self.cfg.grad_accum <= available:
                self.available, self.complete = available, available == COMPLETE
                if said is not None:  # said on rank 0 only
                    log.info("continuing at step %d: %s", step, self.view.describe())
                return True
            if self.info.is_main:
                said = say_waiting(self.cfg, self.view, f"at step {step}", said, start, extraction)
            self.watch.wait(POLL_S)

    def loader_plan(
        self, limits: list[int], state: LoaderState
    ) -> tuple[dict[int, int], GrowingRows | None]:
        """(micro-batches per epoch, the first pass's rows) for a rank's loader from `state`."""
        rank, world = self.info.rank, self.info.world_size
        share = None
        if state.epoch == 0:
            share = self.plan.share(rank=rank, world_size=world, start=state.consumed)
        return (dict(enumerate(limits)) if self.complete else {0: self.available}), share

    def grown(
        self, prep: Prepared, spec: PlanSpec, state: LoaderState
    ) -> tuple[Prepared, PlanSpec, list[int], LoaderState]:
        """After `catch_up`: the run's parts and lengths, plan spec, epochs (planned once the
        cache is complete: the first pass, then whole-cache epochs) and loader state."""
        train, evals = holdout(self.cfg, self.view)
        prep = replace(prep, parts=self.view.parts, train_lengths=train, eval_lengths=evals)
        spec = replace(spec, lengths=train)
        if self.complete and not self.limits:
            world = self.info.world_size
            try:
                self.limits = epoch_lengths(
                    spec,
                    world_size=world,
                    epochs=None,
                    steps=self.total,
                    grad_accum=self.cfg.grad_accum,
                    first=[self.plan.rank_rows(world_size=world)],
                )
            except ValueError as e:
                raise CacheChanged(f"{self.cfg.data}: too small to continue: {e}") from None
            self.say_complete()
        if self.limits and state.epoch == 0 and state.consumed >= self.limits[0]:
            state = LoaderState(1, 0)  # the pass ended where the ranks' rows did
        return prep, spec, self.limits, state

    def stopped(self, step: int, stop: StopRequest) -> Stopped:
        """The error that ends a run stopped while it waited at `step`."""
        saved = f"checkpoint saved in {self.cfg.out}" if step else "nothing to save"
        return Stopped(
            f"stopped by {stop.signal_name or 'a signal on another rank'} while waiting for the "
            f"extraction at step {step} of {self.total}: {saved}; rerun the same command to "
            "resume (--resume auto)."
        )

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the plan."""
        return {
            "follow": True,
            "rows_estimate": self.rows_estimate,
            "complete": self.view.complete,
            "parts": self.view.record(),
        }

    def after_step(self, step: int, state: LoaderState) -> None:
        """Log what the first pass trained on when this process sees the loader leave it."""
        left_it = self.epoch == 0 and state.epoch > 0
        self.epoch = state.epoch
        if left_it:
            self.first_pass_done(step)

    def first_pass_done(self, step: int) -> None:
        """Log what the first pass trained on."""
        world = self.info.world_size
        used = self.plan.rows[: self.plan.rank_rows(world_size=world) * world]
        left = self.plan.rows[len(used) :]
        samples, waiting = sum(len(r) for r in used), sum(len(r) for r in left)
        held = sum(1 for ls in holdout(self.cfg, self.view)[1] for n in ls if n > 0)
        rest = f"; the {waiting} samples of its last {len(left)} rows, fewer than the ranks, "
        log.info(
            "the first pass is done at step %d: %s samples (%s tokens) in %d rows, of the %s "
            "training samples of the finished cache (%d held out for evaluation%s)",
            step,
            f"{samples:,}",
            f"{sum(ref.length for row in used for ref in row):,}",
            len(used),
            f"{samples + waiting:,}",
            held,
            rest + "are left to the next epoch" if left else "",
        )

    def say_complete(self) -> None:
        """Log that the cache is complete and what the run's steps are of it."""
        rows = self.plan.rank_rows(world_size=self.info.world_size)
        log.info(
            "the extraction is complete: %s. The first pass is %d rows a rank (%.1f steps); "
            "this run's %d steps reach into epoch %d",
            self.view.describe(),
            rows,
            rows / self.cfg.grad_accum,
            self.total,
            len(self.limits) - 1,
        )

    def say_unfinished(self, step: int) -> None:
        """At the end of a run: warn when the extraction had not finished."""
        try:
            self.view = self.watch.grow(self.view)
        except (StopRun, CacheMismatch, OSError):
            pass  # a message only: the run itself is done
        if not self.view.complete:
            log.warning(
                "the run ended at step %d before the extraction finished (%s): the drafter "
                "trained on those parts only; a longer run (--steps, --epochs) reads the rest",
                step,
                self.view.describe(),
            )


def _agree(mine: int, stop: bool, device: torch.device) -> tuple[int, bool]:
    """(the least of the ranks' `mine`, whether any rank was asked to stop)."""
    if not dist.is_initialized():
        return mine, stop
    t = torch.tensor([-mine, int(stop)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    neg, any_stop = t.tolist()
    return -neg, bool(any_stop)
