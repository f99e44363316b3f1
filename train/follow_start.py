"""Starting a run that follows the extraction (see train/following.py), in the launching
process: wait for a manifest and for one optimizer step's rows, fix the run's length, say so; and
the pieces both it and the ranks use (the hold-out rule, the first pass's plan, the waiting
message)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from shared.cache import is_own_entry
from shared.manifest import CacheMismatch, Manifest, manifest_path, read_manifest
from shared.stopping import Stopped, StopRequest
from train.config import TrainConfig
from train.data.follow import (
    POLL_S,
    CacheView,
    ManifestWatch,
    extraction_state,
    is_running,
)
from train.data.growing import GrowingPlan, growing_holdout
from train.prepared import FollowPlan

log = logging.getLogger(__name__)

# An extraction loads its target's tokenizer and indexes its data before it creates the cache:
# a run started with it waits this long for its manifest (no lock to go by yet), then refuses.
START_WAIT_S = 600.0
QUIET_S = 10.0  # a wait shorter than this while the extraction runs is not worth a line
REPEAT_S = 300.0  # a long wait is said again this often


def await_manifest(cfg: TrainConfig) -> Manifest:
    """The cache's manifest; with --follow, waited for while an extraction is starting there."""
    path = manifest_path(cfg.data)
    if not cfg.follow or path.is_file():
        return read_manifest(cfg.data)
    never = never_a_cache(cfg.data)
    if never:
        raise CacheMismatch(cfg.data, [never])
    log.info(
        "waiting for an extraction to start writing %s (%s; up to %.0f minutes while none "
        "runs there: check the path if none is starting; --no-follow refuses at once)",
        cfg.data,
        "no such folder yet" if not Path(cfg.data).exists() else "no manifest.json yet",
        START_WAIT_S / 60,
    )
    stop = StopRequest().install("stopping the wait")
    try:
        deadline = time.monotonic() + START_WAIT_S
        while not path.is_file():
            if stop.requested:
                raise Stopped(
                    f"stopped by {stop.signal_name} while waiting for an extraction to start "
                    f"writing {cfg.data}: nothing was started"
                )
            if time.monotonic() > deadline and not is_running(extraction_state(cfg.data)):
                break  # read_manifest says what is missing
            time.sleep(POLL_S)
    finally:
        stop.restore()
    return read_manifest(cfg.data)


def never_a_cache(data: Path) -> str | None:
    """Why `data` (no manifest.json in it) will not become a cache an extraction writes, or
    None when it may: a file, or a folder of files no extraction writes."""
    data = Path(data)
    if is_own_entry(data.name) and manifest_path(data.parent).is_file():
        return f"a part of the cache {data.parent}, not a cache: give that folder"
    if data.is_file():
        return "a file, not a cache folder: give the folder `python -m extract --out` writes"
    names = [p.name for p in data.iterdir()] if data.is_dir() else []
    if names and not any(map(is_own_entry, names)):
        shown = ", ".join(sorted(names)[:5]) + (", ..." if len(names) > 5 else "")
        return f"no manifest.json, and files no extraction writes ({shown}): not a cache"
    return None


def holdout(cfg: TrainConfig, view: CacheView) -> tuple[tuple, tuple]:
    """(train, eval) length tables of the view, by rules that hold whatever the cache's size."""
    return growing_holdout(
        view.lengths,
        fraction=cfg.eval_fraction,
        parts=cfg.eval_parts or 0,
        num_units=view.num_units,
    )


def first_pass(cfg: TrainConfig, view: CacheView, *, complete: bool) -> GrowingPlan:
    """The first pass's plan of the view's parts (all of them with `complete`)."""
    plan = GrowingPlan(
        seed=cfg.seed,
        row_tokens=cfg.batch_tokens,
        clip=min(cfg.batch_tokens, cfg.max_length or cfg.batch_tokens),
        window=cfg.shuffle_buffer,
    )
    plan.extend(holdout(cfg, view)[0], complete=complete)
    return plan


def await_first_step(
    cfg: TrainConfig, view: CacheView, manifest: Manifest, *, world_size: int
) -> CacheView:
    """The view once its first pass holds one optimizer step's rows on `world_size` ranks."""
    watch, need = ManifestWatch(cfg.data, manifest.identity()), world_size * cfg.grad_accum
    stop = StopRequest().install("stopping the wait")
    said: tuple[str, float] | None = None
    start, plan = time.monotonic(), first_pass(cfg, view, complete=view.complete)
    try:
        while True:
            state = extraction_state(cfg.data)  # before the manifest: see `say_waiting`
            grown = watch.grow(view)
            if grown is not view:
                view = grown
                plan.extend(holdout(cfg, view)[0], complete=view.complete)
            if len(plan.rows) >= need:
                return view
            if view.complete:
                tokens = sum(ref.length for row in plan.rows for ref in row)
                raise CacheMismatch(
                    cfg.data,
                    [
                        f"too small for one optimizer step: its {tokens:,} training tokens pack "
                        f"into {len(plan.rows)} rows of --batch-tokens {cfg.batch_tokens}, and "
                        f"one step on {world_size} rank(s) with --grad-accum {cfg.grad_accum} "
                        f"needs {need}. Extract more data, or lower --batch-tokens, --grad-accum "
                        "or the number of devices"
                    ],
                )
            if stop.requested:
                raise Stopped(
                    f"stopped by {stop.signal_name} while waiting for the first step's parts of "
                    f"{cfg.data}: nothing was trained or saved"
                )
            said = say_waiting(cfg, view, "before the first step", said, start, state)
            watch.wait(POLL_S)
    finally:
        stop.restore()


def estimate_rows(cfg: TrainConfig, view: CacheView) -> int:
    """Rows of the first pass over the finished cache: exact once complete, else those of the
    committed parts scaled by the source rows still to read (rows per source row as so far)."""
    rows = len(first_pass(cfg, view, complete=True).rows)
    if view.complete or view.rows_read == 0:
        return rows
    return -(-rows * view.total_rows // view.rows_read)


def total_steps(cfg: TrainConfig, rows_estimate: int, world_size: int) -> int:
    """The run's optimizer steps: --steps, or --epochs passes of the estimated size."""
    if cfg.steps is not None:
        return cfg.steps
    return max(1, cfg.epochs * (rows_estimate // world_size) // cfg.grad_accum)


def start_following(
    cfg: TrainConfig, view: CacheView, manifest: Manifest, *, world_size: int, estimate: int | None
) -> FollowPlan:
    """The plan of a run that follows the extraction, and the start-up log that says so.
    `estimate`: the checkpoint's, when resuming one."""
    resumed = estimate is not None
    estimate = estimate if resumed else estimate_rows(cfg, view)
    total = total_steps(cfg, estimate, world_size)
    per_pass = estimate // world_size // cfg.grad_accum
    if view.complete and resumed:  # a resumed run keeps the plan it started with
        log.info(
            "resuming a run that followed the extraction of %s, complete now (%s): its first "
            "pass keeps its plan",
            cfg.data,
            view.describe(),
        )
    else:
        log.info(
            "following the extraction of %s: %s; %s. The first pass reads the parts in unit "
            "order as they are committed, shuffled within windows of %d samples, waiting for "
            "more when it needs them; the epochs after it read the whole cache",
            cfg.data,
            view.describe(),
            "it finished while this run waited for its first step's parts"
            if view.complete
            else extraction_state(cfg.data),
            cfg.shuffle_buffer,
        )
    how = (
        f"--steps {cfg.steps}"
        if cfg.steps is not None
        else f"--epochs {cfg.epochs} x about {per_pass:,} steps a pass"
    )
    log.info(
        "schedule: %s steps (%s); a pass over the finished cache is about %s rows, %s "
        "(give --steps to fix the length)",
        f"{total:,}",
        how,
        f"{estimate:,}",
        "as estimated when the run started" if resumed else "estimated from the committed parts",
    )
    if total < per_pass and not view.complete:
        log.warning(
            "this run's %d steps end within the first pass (about %d steps): it will finish "
            "before the extraction does and will not train on every sample of the cache",
            total,
            per_pass,
        )
    return FollowPlan(view=view, rows_estimate=estimate, identity=manifest.identity())


def say_waiting(
    cfg: TrainConfig,
    view: CacheView,
    where: str,
    said: tuple[str, float] | None,
    since: float,
    state: str,
) -> tuple[str, float] | None:
    """Log why the run waits, when it is worth a line: at once if the extraction is not running,
    after QUIET_S if it is, again when that changes or every REPEAT_S. Returns what was said.
    `state`: `extraction_state`, read before the manifest of `view`: an extraction commits its
    last part before it lets go of the lock, so one that ended between the two reads is not
    taken for one that stopped short."""
    now = time.monotonic()
    if said is not None and said[0] == state and now - said[1] < REPEAT_S:
        return said
    if is_running(state):
        if now - since < QUIET_S:
            return said
        log.info(
            "waiting %s for the extraction to commit more parts: %s; %s",
            where,
            view.describe(),
            state,
        )
    else:
        log.warning(
            "waiting %s: the cache is incomplete (%s) and %s (killed, failed or stopped). "
            "Training continues when the same extract command resumes it; a stop signal ends "
            "this run, which the same train command resumes",
            where,
            view.describe(),
            state,
        )
    return (state, now)
