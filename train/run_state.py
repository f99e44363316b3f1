"""A run's state as its checkpoints hold it: what a rank saves, and what a resumed rank restores.

The dict is everything needed to continue: the drafter, the optimizer and scheduler states, the
loader's place in the plan, every rank's RNG states, the step, the resolved config (so a later
run can see which recipe wrote it) and the data plan. `Trainer.save` and `Trainer.restore`
(train/loop.py) call these with themselves.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.cli import to_json
from shared.dist import all_gather_objects, barrier
from shared.stopping import StopRun
from train.checkpoint import (
    checkpoint_problem,
    checkpoints_dir,
    is_complete,
    load_resume,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.data.loader import LoaderState

log = logging.getLogger(__name__)


def restore_run_state(trainer: Any) -> None:
    """Load the checkpoint `--resume` names into `trainer` (a `train.loop.Trainer`); log a start
    from scratch when there is none."""
    t = trainer
    found = load_resume(t.cfg.out, t.cfg.resume, t.device)
    if found is None:
        t.writer.rewind(0)  # a run killed before its first checkpoint: its steps logged again
        log.info("starting from scratch: %d steps", t.total)
        return
    path, state = found
    if int(state["step"]) > t.total:
        raise StopRun(
            f"{path} is at step {state['step']}, past this run's {t.total} steps (--steps, "
            f"--epochs): give --steps "
            f"{state['step']} or more to go on from it (or export it: python -m train.export "
            f"{path} OUT_DIR), or start another run with another --out"
        )
    t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    _say_schedule_change(t.scheduler, state["scheduler"], int(state["step"]), t.total)
    t.loader_state = LoaderState.from_dict(
        state["loader"], world_size=t.info.world_size, workers=t.workers
    )
    t.step = int(state["step"])
    t.guard.checked = t.step  # checked finite when it was saved: a run resumed at its end
    t.guard.seen = t.step
    t.writer.rewind(t.step, last=t.step == t.total)  # saves and exports it without another step
    if len(state["rng"]) == t.info.world_size:
        set_rng_state(state["rng"][t.info.rank], t.device)
    log.info("resumed from %s at step %d of %d", path, t.step, t.total)


def _say_schedule_change(scheduler: Any, saved: dict[str, Any], step: int, total: int) -> None:
    """Warn where the learning-rate schedule at the resumed step is not the saved one: the run's
    length changed (--steps, --epochs), and the lr jumps to the new schedule's there."""
    was = saved.get("_last_lr") or []
    at = scheduler.last_epoch
    now = [b * f(at) for b, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    moved = [abs(a - b) > 1e-6 * abs(a) for a, b in zip(was, now, strict=False)]
    if len(was) == len(now) and any(moved):
        log.warning(
            "the learning-rate schedule changed with the run's length (--steps, --epochs): at "
            "step %d the lr was %.3g and is %.3g now, and follows the schedule of %d steps "
            "from there (a jump the curves show; the same length as before avoids it)",
            step, was[0], now[0], total,
        )  # fmt: skip


def saved_already(out: Any, step: int) -> bool:
    """Whether a sound checkpoint of `step` is in the run folder: a run resumed at its last step
    (killed during its final evaluation or export) has nothing new to save there."""
    path = checkpoints_dir(out) / f"step-{step}"
    return is_complete(path) and checkpoint_problem(path) is None


def save_run_state(trainer: Any) -> None:
    """Save `trainer`'s state as the checkpoint of its step (rank 0 writes; every rank calls)."""
    t = trainer
    t.guard.check(t.step)  # never save (nor export after) a non-finite model
    rngs = all_gather_objects(rng_state(t.device))
    if t.info.is_main and saved_already(t.cfg.out, t.step):
        log.info("checkpoint step-%d is saved already (the run resumed from it)", t.step)
    elif t.info.is_main:
        state = {
            "step": t.step,
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "loader": t.loader_state.to_dict(world_size=t.info.world_size, workers=t.workers),
            "rng": rngs,
            "config": to_json(t.cfg),
            "plan": t.follow.record() if t.follow else {"follow": False},
        }
        save_checkpoint(t.cfg.out, t.step, state, t.prep.drafter, keep=t.cfg.keep_checkpoints)
    barrier()
