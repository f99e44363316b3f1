"""A run's state as its checkpoints hold it: what a rank saves, and what a resumed rank restores.

The dict is everything needed to continue: the drafter, the optimizer and scheduler states, the
loader's place in the plan, every rank's RNG states, the step, the resolved config (so a later
run can see which recipe wrote it) and the data plan. `Trainer.save` and `Trainer.restore`
(train/loop.py) call these with themselves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shared.cli import to_json
from shared.dist import all_gather_objects, barrier
from shared.stopping import StopRun
from train.checkpoint import (
    checkpoint_problem,
    checkpoints_dir,
    load_resume,
    prune_before,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.data.loader import LoaderState
from train.warm_start import warm_start

log = logging.getLogger(__name__)


def restore_run_state(trainer: Any) -> None:
    """Load the checkpoint `--resume` names into `trainer` (a `train.loop.Trainer`); without
    one, a start from scratch: --init-from's weights, if given, and a line in the log."""
    t = trainer
    found = load_resume(t.cfg.out, t.cfg.resume, t.device)
    if found is None:
        if t.cfg.init_from is not None:  # a resumed run has its weights from its checkpoint
            warm_start(t.model, t.cfg.init_from)
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
    _follow_schedule(t.scheduler, state["scheduler"], int(state["step"]), t.total)
    t.loader_state = LoaderState.from_dict(state["loader"], world_size=t.ranks, workers=t.workers)
    t.step, t.restored = int(state["step"]), Path(path)
    t.guard.checked = t.step  # checked finite when it was saved: a run resumed at its end
    t.guard.seen = t.step
    t.writer.rewind(t.step, last=t.step == t.total)  # saves and exports it without another step
    if len(state["rng"]) == t.info.world_size:
        set_rng_state(state["rng"][t.info.rank], t.device)
    if t.info.is_main:
        prune_before(t.cfg.out, t.restored, keep=t.cfg.keep_checkpoints)
    log.info("resumed from %s at step %d of %d", path, t.step, t.total)


def _follow_schedule(scheduler: Any, saved: dict[str, Any], step: int, total: int) -> None:
    """Where the run's length changed (--steps, --epochs), the schedule of the new length gives
    another lr at the resumed step than the saved one: the next step takes the new one (the
    optimizer's saved lr is the old schedule's), and a warning says where the lr jumps."""
    if step >= total:  # resumed at its end: no step takes an lr
        return
    was = saved.get("_last_lr") or []
    at = scheduler.last_epoch
    now = [b * f(at) for b, f in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
    if len(was) != len(now) or all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(was, now)):  # noqa: B905
        return
    for group, lr in zip(scheduler.optimizer.param_groups, now, strict=True):
        group["lr"] = lr
    scheduler._last_lr = list(now)
    log.warning(
        "the learning-rate schedule changed with the run's length (--steps, --epochs): step %d "
        "takes lr %.3g where the saved schedule gave %.3g, and the steps after it follow the "
        "schedule of %d steps (a jump the curves show; the same length as before avoids it)",
        step + 1, now[0], was[0], total,
    )  # fmt: skip


def saved_already(trainer: Any) -> bool:
    """Whether the checkpoint of the trainer's step is the one it resumed from, still in its run
    folder: a run resumed at its last step (killed during its final evaluation or export) has
    nothing new to save there."""
    t = trainer
    path = checkpoints_dir(t.cfg.out) / f"step-{t.step}"
    if t.restored is None or not path.exists() or not t.restored.exists():
        return False
    return path.samefile(t.restored) and checkpoint_problem(path) is None


def save_run_state(trainer: Any) -> None:
    """Save `trainer`'s state as the checkpoint of its step (rank 0 writes; every rank calls)."""
    t = trainer
    t.guard.check(t.step)  # never save (nor export after) a non-finite model
    rngs = all_gather_objects(rng_state(t.device))
    if t.info.is_main and saved_already(t):
        log.info("checkpoint step-%d is saved already (the run resumed from it)", t.step)
    elif t.info.is_main:
        state = {
            "step": t.step,
            "model": t.model.state_dict(),
            "optimizer": t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "loader": t.loader_state.to_dict(world_size=t.ranks, workers=t.workers),
            "rng": rngs,
            "config": to_json(t.cfg),
            "plan": t.follow.record() if t.follow else {"follow": False},
            "target": t.prep.target,
        }
        save_checkpoint(t.cfg.out, t.step, state, t.prep.drafter, keep=t.cfg.keep_checkpoints)
    barrier()
