"""Stage two's entry point: check the cache and the run folder, resolve defaults, launch ranks.

Everything that can refuse the run does so here, before any process starts or any file is
written: a cache that cannot serve the requested drafter (every problem listed in one
`CacheMismatch`), an invalid device list, or an existing run folder holding a different run.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from shared.dist import (
    DeviceSpec,
    launch,
    parse_gpus,
    takes_output_lock,
    torchrun_world_size,
    under_torchrun,
)
from shared.fsio import unwritable_reason
from shared.lock import LockHeld, output_lock
from shared.manifest import (
    CacheMismatch,
    Manifest,
    refuse_inside_cache,
    repair_commands,
)
from shared.stopping import resume_command
from train.cache_fit import MAX_LENGTH_PROBLEM, OPTION_PROBLEM, fit_cache
from train.config import TrainConfig
from train.data.catalog import load_catalog
from train.data.follow import CacheView, changed_parts, read_view
from train.data.loader import layer_positions
from train.data.plan import holdout_lengths, plan_rows
from train.drafters.anchors import default_gamma
from train.export_hf import target_record
from train.follow_start import await_first_step, await_manifest, holdout, start_following
from train.loop import EXPORT_DIR, train_rank
from train.prepared import FollowPlan, Prepared
from train.run_dir import (
    RunError,
    finished_with,
    foreign_files,
    prepare_run_dir,
    resumed_plan,
)
from train.warm_start import init_from_problem, init_from_problems

log = logging.getLogger(__name__)


def run(cfg: TrainConfig) -> Path:
    """Train as `cfg` says; return the export folder."""
    try:
        spec = parse_gpus(cfg.gpus)
    except ValueError as e:
        raise RunError(str(e)) from None
    problem = unwritable_reason(cfg.out)
    if problem:
        raise RunError(f"--out {cfg.out}: {problem}")
    manifest = await_manifest(cfg)
    inside = refuse_inside_cache(cfg.out, cfg.data)
    if inside:
        raise RunError(inside)
    if problem := foreign_files(cfg.out):
        raise RunError(f"--out {cfg.out}: {problem}")
    saved = resumed_plan(cfg)
    view = None
    # A run follows an extraction on a cache not yet complete, and keeps following (the plan is
    # its checkpoint's) once it is; --no-follow and an unfollowed checkpoint refuse it.
    follows = saved["follow"] if saved is not None else not manifest.complete
    if follows and (cfg.follow or manifest.complete):
        changed = changed_parts(saved.get("parts", []) if saved else [], manifest)
        if changed:
            raise RunError("\n".join([f"{cfg.data} changed under the run {cfg.out}:", *changed]))
        view = read_view(cfg.data, manifest)
    cfg, prep = prepare(cfg, manifest, device_kind=spec.kind, view=view)
    # Before the run folder is written: its fix is the command's. A resumed run's checkpoint
    # holds the weights the warm start gave, so its source may be gone since.
    if cfg.init_from is not None and saved is None:
        problem = init_from_problem(cfg.init_from)
        if problem:
            raise RunError(problem)
        problems = init_from_problems(cfg.init_from, prep.drafter)
        if problems:
            raise RunError("--init-from does not fit the drafter:\n  - " + "\n  - ".join(problems))
    try:
        with output_lock(cfg.out, resume_command("train"), enabled=takes_output_lock()):
            estimate = saved.get("rows_estimate") if saved else None
            return _run_locked(cfg, prep, manifest, spec, estimate)
    except LockHeld as e:
        raise RunError(str(e)) from None
    except OSError as e:  # creating --out or a file in it (e.g. --out /proc/x, a full disk)
        where = e.filename or cfg.out
        raise RunError(f"--out {cfg.out}: cannot write {where} ({e.strerror or e})") from None


def _run_locked(
    cfg: TrainConfig, prep: Prepared, manifest: Manifest, spec: DeviceSpec, estimate: int | None
) -> Path:
    world = torchrun_world_size() if under_torchrun() else spec.nprocs
    done = finished_with(cfg, prep, world)
    ranks = world if done is None else done[0]  # those the data plan is for
    if prep.follow is None:
        check_size(cfg, prep, ranks)
    prepare_run_dir(cfg, prep, manifest, world_size=world, finished=done)
    if done is not None:
        log.info(
            "%s finished its steps on %d rank(s) x %d loader stream(s): this run, on %d x %d, "
            "evaluates and exports it only",
            cfg.out, *done, world, max(cfg.workers, 1),
        )  # fmt: skip
        prep = dataclasses.replace(prep, trained_with=done)
    if prep.follow is not None:
        view = await_first_step(cfg, prep.follow.view, manifest, world_size=ranks)
        train, evals = holdout(cfg, view)
        plan = start_following(cfg, view, manifest, world_size=ranks, estimate=estimate)
        prep = dataclasses.replace(
            prep, parts=view.parts, train_lengths=train, eval_lengths=evals, follow=plan
        )
    log.info(
        "%s a %d-layer drafter on %s (%d samples held out) with %s, target layers %s",
        "training" if done is None else "evaluating and exporting",
        prep.drafter.num_layers,
        f"{len(prep.parts)} part{'s' if len(prep.parts) != 1 else ''}",
        prep.num_eval,
        spec.label,
        list(prep.drafter.target_layer_ids),
    )
    trained = sum(1 for ls in prep.train_lengths for n in ls if n > 0)
    if prep.num_eval > trained:
        how = (
            f"--eval-parts {cfg.eval_parts}"
            if cfg.eval_parts
            else f"--eval-fraction {cfg.eval_fraction:g}"
        )
        log.warning(
            "%s holds out more samples than it trains on (%d against %d): was a smaller value "
            "meant (the default holds out 1%%)?",
            how,
            prep.num_eval,
            trained,
        )
    launch(train_rank, (cfg, prep), spec)
    return cfg.out / EXPORT_DIR


def resolve_devices(cfg: TrainConfig, device_kind: str) -> TrainConfig:
    """Attention, compile and loader defaults for the device kind; flex cannot train on CPU.
    Eight loader workers keep an H200 fed from a cold cache: with the 155 ms step of the
    Qwen3-8B shape, four left it waiting 13% of the time, eight 0.1% (bench/datapath_bench.py
    --workers). CPU ranks compute on the same few cores, so two."""
    cuda = device_kind == "cuda"
    attention = cfg.attention or ("flex" if cuda else "sdpa")
    if attention == "flex" and not cuda:
        raise RunError(
            "attention: flex_attention has no backward on CPU (torch 2.11-2.13); "
            "use --attention sdpa"
        )
    return cfg.replace(
        attention=attention,
        compile=cfg.compile or ("model" if cuda else "none"),
        workers=cfg.workers if cfg.workers is not None else (8 if cuda else 2),
    )


def prepare(
    cfg: TrainConfig, manifest: Manifest, *, device_kind: str, view: CacheView | None = None
) -> tuple[TrainConfig, Prepared]:
    """The resolved config and what every rank needs; CacheMismatch lists every problem.
    `view`: the committed parts of a cache the run follows while it is being written."""
    cfg = resolve_devices(cfg, device_kind)
    repair = repair_commands(cfg.data, manifest)
    wanted, read, drafter, problems = fit_cache(cfg, manifest, complete=view is None)
    if view is None:
        parts, part_problems = load_catalog(cfg.data, manifest)
        problems += [*part_problems, f"to repair them: {repair}"] if part_problems else []
        problems = list(dict.fromkeys(problems))  # the repair said once
    else:
        parts = list(view.parts)
    lengths = [p.lengths for p in parts]
    num_samples = sum(map(len, lengths))
    held_parts = cfg.eval_parts or 0
    held = eval_sample_count(cfg.eval_fraction, num_samples) if cfg.eval_parts is None else 0
    units = len(parts) if view is None else view.num_units
    if units and held_parts >= units:
        problems.append(f"cannot hold out {held_parts} of {units} parts for evaluation")
    if not manifest.parts and view is None:
        problems.append("the cache holds no parts")
    if problems and all(p.startswith((OPTION_PROBLEM, MAX_LENGTH_PROBLEM)) for p in problems):
        raise RunError("\n".join(problems))  # the command's to fix, not the cache's
    if problems or drafter is None:
        raise CacheMismatch(cfg.data, problems)
    if view is None:
        train_lengths, eval_lengths = holdout_lengths(
            lengths, num_samples=held, num_parts=held_parts
        )
    else:
        train_lengths, eval_lengths = holdout(cfg, view)
    gamma = None  # unused by --slot-weights uniform and dpace
    if cfg.slot_weights == "exp":
        gamma = cfg.gamma or default_gamma(cfg.block_size, anchor_predicts=drafter.anchor_predicts)
    cfg = cfg.replace(
        target_layers=",".join(map(str, wanted)),
        layer_types=",".join(drafter.layer_types),
        sliding_window=drafter.sliding_window,
        is_causal=None if drafter.is_causal is None else str(drafter.is_causal).lower(),
        mask_token_id=drafter.mask_token_id,
        gamma=gamma,
        max_length=cfg.max_length or manifest.max_length,
        num_anchors=cfg.anchors_per_row,
    )
    prep = Prepared(
        drafter=drafter,
        parts=tuple(parts),
        train_lengths=train_lengths,
        eval_lengths=eval_lengths,
        layers=layer_positions(manifest.layer_ids, read),
        gamma=gamma,
        follow=None if view is None else FollowPlan(view, 0, manifest.identity()),
        target=target_record(manifest.target),
    )
    return cfg, prep


def eval_sample_count(fraction: float, num_samples: int) -> int:
    """Samples held out for evaluation: the fraction rounded down, but at least one when the
    fraction is positive and the cache has two or more samples (a small cache still gets an
    honest held-out figure).

    >>> eval_sample_count(0.01, 480), eval_sample_count(0.01, 50), eval_sample_count(0.0, 50)
    (4, 1, 0)
    """
    if fraction <= 0 or num_samples < 2:
        return 0
    return min(num_samples - 1, max(1, int(fraction * num_samples)))


def check_size(cfg: TrainConfig, prep: Prepared, world_size: int) -> None:
    """Refuse, before any work, a cache too small for one optimizer step on `world_size` ranks;
    log how many samples are truncated to a row."""
    spec = prep.train_spec(cfg)
    rows = len(plan_rows(spec, epoch=0))
    need = world_size * cfg.grad_accum
    tokens = sum(min(n, spec.clip) for ls in prep.train_lengths for n in ls)
    if rows < need:
        raise RunError(
            f"{cfg.data}: too small for one optimizer step: its {tokens:,} training tokens pack "
            f"into {rows} rows of --batch-tokens {cfg.batch_tokens}, and one step on {world_size} "
            f"rank(s) with --grad-accum {cfg.grad_accum} needs {need} rows (about "
            f"{need * cfg.batch_tokens:,} tokens). Extract more data, or lower --batch-tokens, "
            "--grad-accum or the number of devices"
        )
    longer = sum(1 for ls in prep.train_lengths for n in ls if n > spec.clip)
    if longer:
        log.warning(
            "%d training samples are longer than a row (%d tokens): truncated to it",
            longer,
            spec.clip,
        )
    log.info(
        "epoch 0: %d samples, %s tokens in %d rows of %d (%.1f%% padding)",
        sum(1 for ls in prep.train_lengths for n in ls if n > 0),
        f"{tokens:,}",
        rows,
        cfg.batch_tokens,
        100 * (1 - tokens / max(rows * cfg.batch_tokens, 1)),
    )
