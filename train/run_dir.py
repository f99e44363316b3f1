"""The run folder: what config.json records, the checks that it holds this run, and the data
plan of the checkpoint a run resumes."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from shared.cli import to_json
from shared.fsio import atomic_write_json, is_atomic_tmp, remove_stale_tmp
from shared.lock import LOCK_FILE
from shared.manifest import Manifest, identity_changes
from train.checkpoint import (
    CHECKPOINTS,
    incomplete_steps,
    list_checkpoints,
    read_meta,
    resolve_resume,
)
from train.config import TrainConfig
from train.export import CONFIG_FILE as EXPORT_CONFIG
from train.export import WEIGHTS_FILE
from train.follow_start import total_steps
from train.loop import EXPORT_DIR
from train.metrics import METRICS_FILE, PLOTS_DIR
from train.options import HARMLESS_CHANGES
from train.prepared import Prepared

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class RunError(ValueError):
    """The request cannot run as given (devices, run folder, options); the message says why."""


def resumed_plan(cfg: TrainConfig) -> dict[str, Any] | None:
    """The data plan of the checkpoint a run resumes (`{"follow": False}` for one written
    before plans were recorded); None without one."""
    try:
        path = resolve_resume(cfg.out, cfg.resume)
    except ValueError:
        return None  # prepare_run_dir says why
    return None if path is None else read_meta(path).get("plan") or {"follow": False}


def finished_with(cfg: TrainConfig, prep: Prepared, world_size: int) -> tuple[int, int] | None:
    """(ranks, loader streams) of the checkpoint the run resumes, where they differ from this
    command's (`world_size`, --workers) and the checkpoint is at the run's last step (or past
    it) by the data plan of those: nothing is left to train, and the final evaluation and the
    export depend on neither. None otherwise: a run with steps left resumes on its own ranks
    and streams only (`_check_resume_point` says so)."""
    try:
        path = resolve_resume(cfg.out, cfg.resume)
    except ValueError:
        return None  # prepare_run_dir says why
    if path is None:
        return None
    meta = read_meta(path)
    loader = meta.get("loader") or {}
    saved = (loader.get("world_size"), loader.get("workers"))
    if saved == (world_size, max(cfg.workers, 1)) or not all(isinstance(n, int) for n in saved):
        return None
    total = _planned_steps(cfg, prep, saved[0], meta.get("plan") or {})
    return saved if total is not None and meta.get("step", 0) >= total else None


def _planned_steps(
    cfg: TrainConfig, prep: Prepared, ranks: int, plan: dict[str, Any]
) -> int | None:
    """The run's length on `ranks` (as `train.loop.Trainer` plans it): --steps, or --epochs
    passes over the cache (a followed extraction's: its checkpoint's estimate); None when it
    cannot be planned (the run says why)."""
    if cfg.steps is not None:
        return cfg.steps
    if plan.get("follow"):
        estimate = plan.get("rows_estimate")
        return total_steps(cfg, estimate, ranks) if isinstance(estimate, int) else None
    try:
        return prep.epoch_plan(cfg, ranks)[1]
    except ValueError:
        return None


def run_record(
    cfg: TrainConfig, prep: Prepared, manifest: Manifest, *, ranks: int | None = None
) -> dict[str, Any]:
    """What config.json holds: the resolved options, the drafter, the cache identity and the
    number of training processes (a step takes a micro-batch from each: the global batch)."""
    record = {
        "train": to_json(cfg),
        "drafter": prep.drafter.to_dict(),
        "cache": manifest.identity(),
    }
    if ranks is not None:
        record["ranks"] = ranks
    return record


def prepare_run_dir(
    cfg: TrainConfig,
    prep: Prepared,
    manifest: Manifest,
    *,
    world_size: int | None = None,
    finished: tuple[int, int] | None = None,
) -> None:
    """Create the run folder or check that it holds this run; write config.json.

    `world_size`, the processes the run trains on (torchrun's WORLD_SIZE under torchrun), is
    recorded and checked against the checkpoint a resume would start from, before the record
    is written: the data plan depends on it. None: neither. `finished`: the ranks and loader
    streams of a finished run resumed on others (`finished_with`), which the record keeps.
    """
    out = Path(cfg.out)
    path = out / CONFIG_FILE
    record = run_record(cfg, prep, manifest, ranks=world_size)
    old = _run_record(path) if path.is_file() else None
    if finished is not None:
        record = _as_trained(record, old, finished)
    if old is not None:
        clip = min(manifest.max_length, cfg.batch_tokens)  # what --max-length can do here
        harmful, harmless = config_changes(
            _clipped(old.get("train", {}), clip), _clipped(record["train"], clip)
        )
        harmful += _record_changes(old, record)
        if harmful and _saved_nothing(out):
            log.warning(
                "%s holds a run that saved nothing (no checkpoint, no export): this run takes "
                "its place (%s)",
                out,
                "; ".join(harmful),
            )
            harmful, harmless = [], []
        if harmful:
            lines = "\n".join(f"  - {h}" for h in harmful)
            raise RunError(f"{out} holds a different run; use another --out or delete it:\n{lines}")
        for line in harmless:
            log.info("run option changed: %s", line)
    if cfg.resume == "none" and list_checkpoints(out):
        raise RunError(
            f"{out} has checkpoints and --resume none was given: use another --out, delete "
            "the folder, or resume (--resume auto)"
        )
    _check_resume_point(cfg, None if finished else world_size, record)
    if problem := _export_problem(out / EXPORT_DIR):
        raise RunError(problem)
    out.mkdir(parents=True, exist_ok=True)
    for left in remove_stale_tmp(out):
        log.info("removed %s, left by a killed write", left)
    atomic_write_json(path, record)


# What a run writes beside its config.json (checkpoints, metrics, TensorBoard, plots, export).
_RUN_ENTRIES = frozenset({CHECKPOINTS, METRICS_FILE, "tensorboard", PLOTS_DIR, EXPORT_DIR})


def foreign_files(out: Path) -> str | None:
    """Why `out` cannot take a run: a folder that holds files no run writes and no run's
    config.json (its lock files aside), or None."""
    out = Path(out)
    if not out.is_dir() or (out / CONFIG_FILE).exists():
        return None
    names = sorted(n for n in os.listdir(out) if not (n.startswith(LOCK_FILE) or is_atomic_tmp(n)))
    if not set(names) - _RUN_ENTRIES:  # empty, or a run's files whose config.json was lost
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"holds files but no training run ({shown}): give a new or empty folder, or a run "
        "folder to resume"
    )


def _export_problem(export: Path) -> str | None:
    """Why the run could not write its export at its end (the export replaces its folder
    whole: `train.export.refuse_foreign_out`), said before it trains; None when it can."""
    if not export.exists() and not export.is_symlink():
        return None
    if not export.is_dir():
        return f"{export} is not a folder: the run writes its export there; move it away"
    names = sorted(set(os.listdir(export)) - {EXPORT_CONFIG, WEIGHTS_FILE})
    if not names:
        return None
    shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
    return (
        f"{export} holds files besides the run's export ({shown}): the run replaces that "
        "folder whole at its end, so move them away first (keep a copy of the export elsewhere "
        "to add files to it)"
    )


def _as_trained(
    record: dict[str, Any], old: dict[str, Any] | None, trained_with: tuple[int, int]
) -> dict[str, Any]:
    """The record of a finished run resumed on other ranks or loader streams: those it trained
    with, as its record (or, where that says otherwise, its checkpoint) has them."""
    ranks, workers = trained_with
    was = (old or {}).get("train") or {}
    train = {**record["train"], "gpus": was.get("gpus", record["train"]["gpus"])}
    w = was.get("workers")
    train["workers"] = w if isinstance(w, int) and max(w, 1) == workers else workers
    return {**record, "train": train, "ranks": ranks}


def _saved_nothing(out: Path) -> bool:
    """Whether a run folder holds nothing a run saved: no checkpoint, complete or not, and no
    export (a run that failed or was killed before its first checkpoint)."""
    return (
        not list_checkpoints(out) and not incomplete_steps(out) and not (out / EXPORT_DIR).exists()
    )


def _run_record(path: Path) -> dict[str, Any]:
    """A run folder's config.json; RunError when the file is not a run's (a drafter export's
    config, another tool's, or unreadable)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunError(
            f"{path}, the run's record, cannot be read ({e}): restore it from a copy and the "
            "same command resumes the run; or delete it, and the run resumes from its "
            "checkpoints with this command's options, unchecked against the run's; or give "
            "another --out"
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get("train"), dict):
        whose = "a drafter export's" if (path.parent / "model.safetensors").is_file() else "another"
        raise RunError(
            f"--out {path.parent}: its config.json is {whose}, not a training run's: give another "
            "--out"
        )
    return record


def _record_changes(old: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """What differs between two run records beyond their train options: drafter and cache."""
    changes = []
    if old.get("drafter") != record["drafter"]:
        changes.append("the drafter derived from the cache differs")
    if keys := identity_changes(old.get("cache") or {}, record["cache"]):
        changes.append(f"the cache differs (manifest identity: {', '.join(keys)})")
    return changes


def _check_resume_point(cfg: TrainConfig, world_size: int | None, record: dict[str, Any]) -> None:
    try:
        path = resolve_resume(cfg.out, cfg.resume)
    except ValueError as e:
        raise RunError(str(e)) from None
    if path is not None:
        _check_other_runs_checkpoint(path, cfg.out, record)
        step = read_meta(path).get("step", 0)
        if cfg.steps is not None and step > cfg.steps:  # (--epochs: checked once they are steps)
            raise RunError(
                f"{path} is at step {step}, past this run's --steps {cfg.steps}: give --steps "
                f"{step} or more to go on from it (or export it: python -m train.export {path} "
                "OUT_DIR), or start another run with another --out"
            )
    if path is None or world_size is None:
        return
    loader = read_meta(path).get("loader") or {}
    saved = (loader.get("world_size"), loader.get("workers"))
    if saved != (world_size, max(cfg.workers, 1)):
        ranks = f"{saved[0]} rank{'s' if saved[0] != 1 else ''} (--gpus)"
        same = [ranks] if saved[0] != world_size else []
        if saved[1] != max(cfg.workers, 1):
            same.append(f"--workers {saved[1]}" + (" (or 0)" if saved[1] == 1 else ""))
        raise RunError(
            f"{path} was written by {saved[0]} ranks x {saved[1]} loader streams, this run has "
            f"{world_size} x {max(cfg.workers, 1)}: the data's order depends on both; resume "
            f"with {' and '.join(same)}, or start a new --out"
        )


def _check_other_runs_checkpoint(path: Path, out: Path, record: dict[str, Any]) -> None:
    """RunError when `--resume PATH` names a checkpoint of another run folder made with other
    settings (or of no run folder): its optimizer, schedule and data position belong to those
    settings, and this run's config.json would record other ones."""
    run = Path(path).parent.parent
    if run.resolve() == Path(out).resolve():
        return
    source = run / CONFIG_FILE
    hint = f"to start from its weights alone, use --init-from {path}"
    try:
        old = json.loads(source.read_text())
    except (OSError, ValueError):
        raise RunError(
            f"--resume {path}: not in a run folder (no readable {source}), so what it was "
            f"trained with is unknown; {hint}"
        ) from None
    harmful, _ = config_changes(old.get("train", {}), record["train"])
    harmful += _record_changes(old, record)
    if harmful:
        lines = "\n".join(f"  - {h}" for h in harmful)
        raise RunError(
            f"--resume {path} is a checkpoint of another run ({run}) with other settings "
            f'("run" below is that run):\n{lines}\nresume it with that run\'s settings, or {hint}'
        )


def _clipped(train: dict[str, Any], clip: int) -> dict[str, Any]:
    """A run record's options with max_length as it acts: samples are cut to the cache's own
    and to --batch-tokens whatever it says (a run recorded with more resumes without it)."""
    if not isinstance(train.get("max_length"), int):
        return train
    return {**train, "max_length": min(train["max_length"], clip)}


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(harmful, harmless) field differences between two saved configs, as readable lines."""
    harmful, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: run has {old.get(key)!r}, now {new.get(key)!r}"
            (harmless if key in HARMLESS_CHANGES else harmful).append(line)
    return harmful, harmless
