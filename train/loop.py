"""The training loop of one rank: model, optimizer, schedule, DDP, steps, logs, checkpoints.

`train_rank(info, cfg, prep)` is what `shared.dist.launch` runs once per device. DDP wraps the
drafter here and nowhere else. The loss of an optimizer step is normalised over all its
micro-batches on all ranks: each backward runs on the unnormalised sum(w * CE), then the
gradients are scaled by world_size / sum(w) (DDP has averaged them over ranks), so the update
equals that of one process seeing the whole global batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from shared.dist import (
    RankInfo,
    all_reduce_sum,
    barrier,
    processes_on_this_host,
    usable_cpus,
)
from shared.logs import setup_logging
from shared.progress import progress_bar
from shared.space import DiskFull, full_disk_stops
from shared.stopping import StopRequest, StopRun
from shared.target_files import load_heads
from train.compiling import compiled_graphs, configure_compile, recompile_errors
from train.config import TrainConfig
from train.data.batch import Batch
from train.data.feed import DeviceFeed
from train.data.loader import LoaderState, PlanDataset, checked, make_loader
from train.drafters.dflash2_loss import selector_loss
from train.drafters.mask import flex_kernel_options
from train.drafters.registry import build_drafter, init_weights
from train.evaluate import Evaluator
from train.export import export_drafter, export_if_room
from train.finite import FiniteGuard
from train.following import Following
from train.metrics import MetricsWriter, StatSums, train_record
from train.optim import build_optimizer
from train.prepared import Prepared
from train.run_state import restore_run_state, save_run_state
from train.schedule import warmup_cosine
from train.step import forward_loss, step_options

log = logging.getLogger(__name__)

EXPORT_DIR = "export"


def train_rank(info: RankInfo, cfg: TrainConfig, prep: Prepared) -> None:
    """One rank's whole run: set up, resume, train, evaluate, checkpoint, export."""
    setup_logging(info.rank, verbose=cfg.verbose)
    configure_compile(cfg)
    if info.device.type == "cpu" and info.world_size > 1:
        # CPU ranks share the host: without this each would start one thread per core.
        torch.set_num_threads(max(1, usable_cpus() // processes_on_this_host(info.world_size)))
    trainer: Trainer | None = None

    def stopping() -> str:
        at = "at the first step where the run can"
        if trainer is not None:
            at = f"at step {trainer.guard.stops_at()} of {trainer.total}"
        return (
            f"saving a checkpoint {at}, then stopping (a second signal stops at once, keeping "
            "only the checkpoints saved before)"
        )

    stop = StopRequest().install(stopping)
    try:
        with full_disk_stops(cfg.out, rerun="Free space there, then rerun the same command."):
            trainer = Trainer(info, cfg, prep)
            trainer.guard.stop = stop
            trainer.fit()
    finally:
        stop.restore()


class Trainer:
    def __init__(self, info: RankInfo, cfg: TrainConfig, prep: Prepared) -> None:
        self.info, self.cfg, self.prep = info, cfg, prep
        self.device = info.device
        cuda = self.device.type == "cuda"
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if cuda else torch.float32
        self.embed_VH, self.lm_head_VH = load_heads(cfg.data, device=self.device, dtype=dtype)
        self.model = build_drafter(prep.drafter)
        init_weights(self.model, cfg.seed)  # --init-from's weights replace it (restore)
        self.model.to(self.device)
        self.model.use_flex_options(flex_kernel_options(prep.drafter.head_dim, self.device))
        self.optimizer = build_optimizer(self.model, cfg, fused=cuda)
        # The ranks and loader streams the data plan is for: this run's, or a finished run's
        self.ranks, self.workers = prep.data_plan(info.world_size, cfg.workers)
        self.spec = prep.train_spec(cfg)
        self.follow = Following(cfg, prep.follow, info, ranks=self.ranks) if prep.follow else None
        if self.follow is not None:  # its epochs are planned once the cache is complete
            self.limits, self.total = [], self.follow.total
        else:
            self.limits, self.total = prep.epoch_plan(cfg, self.ranks)
        self.scheduler = warmup_cosine(self.optimizer, total=self.total, warmup=cfg.warmup)
        self.step, self.loader_state = 0, LoaderState()
        self.restored: Path | None = None  # the checkpoint folder the run resumed from
        self.autocast = (
            (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
            if cuda
            else contextlib.nullcontext
        )
        self.step_kwargs = step_options(cfg, prep, self.device)
        self.sums = StatSums(cfg.block_size, self.device, first=prep.first_draft_slot)
        self.guard = FiniteGuard(
            self.device, every=cfg.log_every, total=self.total, data=cfg.data, out=cfg.out
        )
        self.writer = MetricsWriter(cfg.out, enabled=info.is_main)
        self.evaluator = Evaluator.for_run(prep, cfg, rank=info.rank, world_size=info.world_size)
        self.net: torch.nn.Module | None = None  # prepare() sets the next three
        self.feed: DeviceFeed | None = None
        # (start, feed.waited at the start): the logging window and its data wait.
        self.window = (time.perf_counter(), 0.0)
        self.first_step_s: float | None = None
        self.logged = 0  # the last step with a train record: its window ends there

    # --- state ---------------------------------------------------------------------------

    def restore(self) -> None:
        restore_run_state(self)

    def save(self) -> None:
        """A checkpoint of this step, its logging window closed first (a record of this step),
        so that a run resumed from it logs the windows an unbroken run logs."""
        if self.logged < self.step:
            self._log()
        save_run_state(self)

    # --- the loop ------------------------------------------------------------------------

    def _wrap(self) -> torch.nn.Module:
        """The module the steps call: DDP (the one place it is applied), then torch.compile."""
        net: torch.nn.Module = self.model
        if self.info.world_size > 1:
            ids = [self.device] if self.device.type == "cuda" else None
            net = DistributedDataParallel(self.model, device_ids=ids)
        if self.cfg.compile == "model":
            # Every micro-batch has the same shapes: a shape change is a bug, never a reason to
            # trace a dynamic graph (torch 2.11's dynamic backward failed on varied lengths).
            net = torch.compile(net, dynamic=False)
        return net

    def loader(self) -> Iterator[dict[str, Any]]:
        """The micro-batches of this rank from the loader state on: PlanDataset, DataLoader."""
        limits, growing = dict(enumerate(self.limits)), None
        if self.follow is not None:
            limits, growing = self.follow.loader_plan(self.limits, self.loader_state)
        dataset = PlanDataset(
            self.prep.parts,
            self.spec,
            layers=self.prep.layers,
            rank=self.info.rank,
            world_size=self.info.world_size,
            workers=self.workers,
            limits=limits,
            start_epoch=self.loader_state.epoch,
            consumed=self.loader_state.consumed,
            growing=growing,
        )
        loader = make_loader(
            dataset,
            workers=self.cfg.workers,
            prefetch=self.cfg.prefetch,
            pin_memory=self.device.type == "cuda",
        )
        return checked(iter(loader))

    def prepare(self, batches: Iterator[dict[str, Any]] | None = None) -> None:
        """Wrap the model (once); read micro-batches (the loader's item dicts) from `batches`,
        or from `loader()` when None. Starts a new logging window."""
        if self.net is None:
            self.net = self._wrap()
        self.close_loader()
        self.feed = DeviceFeed(self.loader() if batches is None else batches, self.device)
        self.window = (time.perf_counter(), 0.0)

    def close_loader(self) -> None:
        """Drop the micro-batch source, which stops the DataLoader workers."""
        self.feed = None

    def fit(self) -> None:
        self.restore()
        self.logged = self.step
        # A follower's loader comes with its first catch_up; a finished run reads no data.
        if self.follow is None and self.step < self.total:
            self.prepare()
        bar = progress_bar(
            total=self.total,
            initial=self.step,
            desc="train",
            unit="steps",
            disable=not self.info.is_main,
        )
        try:
            with recompile_errors(self.cfg.recompile_limit):
                first = True
                while self.step < self.total:
                    self.catch_up()
                    self.first_step() if first else self.train_step()
                    bar.update(1)
                    # A run's first step: its own window (a resumed run's is not: its windows
                    # are an unbroken run's)
                    if self._after_step(bar, log_now=first and self.restored is None):
                        return
                    first = False
        finally:
            bar.close()
            self.close_loader()
        self._finish()

    def catch_up(self) -> None:
        """Following an extraction: wait until the next step's rows are planned on every rank,
        then read from the grown plan (a new loader, from the loader state on)."""
        f = self.follow
        if f is None or f.ready(self.loader_state):
            return
        if not f.catch_up(self.loader_state, step=self.step, stop=self.guard.stop):
            if self.step > 0:
                self.save()
            raise f.stopped(self.step, self.guard.stop)
        self.prep, self.spec, self.limits, self.loader_state = f.grown(
            self.prep, self.spec, self.loader_state
        )
        rank, world = self.info.rank, self.info.world_size
        self.evaluator = Evaluator.for_run(self.prep, self.cfg, rank=rank, world_size=world)
        self.prepare()

    def first_step(self) -> None:
        """The run's first step, timed to its end (compilation included): a one-off sync."""
        start = time.perf_counter()
        self.train_step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_step_s = time.perf_counter() - start
        log.info("first step: %.1f s (%d graphs compiled)", self.first_step_s, compiled_graphs())

    def _after_step(self, bar: tqdm, *, log_now: bool = False) -> bool:
        """Logs, evaluations and checkpoints due after a step; True to stop as if killed."""
        cfg, step = self.cfg, self.step
        last = step == self.total
        if self.follow is not None:
            self.follow.after_step(step, self.loader_state)
        if step % cfg.log_every == 0 or last or log_now or step % cfg.checkpoint_every == 0:
            record = self._log()
            bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['tau']:.2f}")
        # Not finite, or a stop requested: after the step's record (a resume keeps it), before
        # an evaluation or a checkpoint of it. Reads the device on log steps only.
        self.guard.check_due(step, save=self.save)
        if cfg.eval_every and step % cfg.eval_every == 0 and not last:
            self.evaluate()
        if step % cfg.checkpoint_every == 0 and not last:
            self.save()
        if cfg.stop_after_steps is not None and step == cfg.stop_after_steps and not last:
            log.warning("stopping after step %d (--stop-after-steps)", step)
            return True
        return False

    def _take(self) -> tuple[dict[str, Any], Batch]:
        item, batch = self.feed.take()
        # Training only, and only the taps: a last layer read after them is the target's own.
        taps = len(self.prep.drafter.target_layer_ids)
        batch = batch.noised(std=self.cfg.noise_std, seed=item["anchor_seed"], layers=taps)
        if item["epoch"] != self.loader_state.epoch:
            raise RuntimeError(
                f"loader out of step: got epoch {item['epoch']}, expected {self.loader_state.epoch}"
            )
        return item, batch

    def train_step(self) -> float:
        """One optimizer step over `grad_accum` micro-batches, as `fit` runs it; advances
        `step`. Returns the seconds it waited for the micro-batch source (no GPU sync)."""
        if self.net is None or self.feed is None:
            raise RuntimeError("no model to step or no micro-batches: call prepare() first")
        net, accum, waited = self.net, self.cfg.grad_accum, self.feed.waited
        ddp = hasattr(net, "no_sync")  # DDP, possibly under torch.compile
        weight_local = torch.zeros((), dtype=torch.float32, device=self.device)
        for i in range(accum):
            item, batch = self._take()
            sync = net.no_sync() if ddp and i < accum - 1 else contextlib.nullcontext()
            with sync:
                with self.autocast():
                    out = forward_loss(
                        net,
                        self.embed_VH,
                        self.lm_head_VH,
                        batch,
                        generator=torch.Generator().manual_seed(item["anchor_seed"]),
                        grad_ckpt=self.cfg.grad_ckpt,
                        selector=selector_loss(self.cfg, self.step, self.total),
                        **self.step_kwargs,
                    )
                out.weighted_sum.backward()
            if i < accum - 1:
                self.feed.ahead()  # its copy overlaps this micro-batch's backward
            weight_local += out.weight_total.detach().float()
            self.sums.add(out.weighted_sum, out.weight_total, out.stats, batch.num_tokens)
            self.guard.add(out.weighted_sum, out.weight_total)
            self.loader_state = self.loader_state.advance(self.limits)
        # Every kept block weighs >= 1 at offset 1, so a total below 1 means no targets at all.
        weight_total = all_reduce_sum(weight_local).clamp(min=1.0)
        scale = self.info.world_size / weight_total
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.mul_(scale)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        self.guard.observe(self.step + 1, grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.sums.add_step(grad_norm)
        self.step += 1
        self.feed.ahead()  # the next micro-batch's copy overlaps this step's queued work
        return self.feed.waited - waited

    def _log(self) -> dict[str, Any]:
        start, waited = self.window[0], self.feed.waited - self.window[1]
        record = train_record(
            self.sums.reduce(),  # the one synchronisation of a logging window
            step=self.step,
            epoch=self.loader_state.epoch,
            lr=self.scheduler.get_last_lr()[0],
            elapsed=max(time.perf_counter() - start, 1e-9),
            waited=waited,
            device=self.device,
        )
        if self.first_step_s is not None:
            record["first_step_s"], self.first_step_s = self.first_step_s, None
        self.writer.write(record)
        self.logged = self.step
        log.debug("step %d: %s", self.step, record)
        self.window = (time.perf_counter(), self.feed.waited)
        return record

    def evaluate(self) -> dict[str, Any] | None:
        if self.evaluator is None:
            return None
        result = self.evaluator.run(
            self.model,
            self.embed_VH,
            self.lm_head_VH,
            device=self.device,
            autocast=self.autocast,
            grad_ckpt="none",
            selector=selector_loss(self.cfg, self.total, self.total),  # the full weight
            **self.step_kwargs,
        )
        record = {"kind": "eval", "step": self.step, **result}
        self.writer.write(record)
        log.info("eval at step %d: loss %.4f, tau %.3f", self.step, record["loss"], record["tau"])
        return record

    def _finish(self) -> None:
        if self.follow is not None:
            self.follow.say_unfinished(self.step)
        heads, out = (self.embed_VH, self.lm_head_VH), self.cfg.out / EXPORT_DIR
        drafter, target = self.prep.drafter, self.prep.target  # the export records the latter
        if self.step > 0:
            try:
                self.save()
            except DiskFull as e:  # the export is smaller: written where it fits
                done = export_if_room(self.model, drafter, out, heads=heads, target=target)
                raise DiskFull(f"{e} {done}") from None
        self.evaluate()
        if self.info.is_main:
            try:
                export_drafter(self.model, drafter, out, heads=heads, target=target)
            except ValueError as e:  # files put in the export folder while the run trained
                raise StopRun(
                    f"{e}. The run's last checkpoint (step {self.step}) is saved: move them "
                    "away, then the same command exports it"
                ) from None
            log.info("exported the drafter to %s", out)
        self.writer.close()
        barrier()
