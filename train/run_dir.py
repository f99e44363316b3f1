"""The run folder: what config.json records, the checks that it holds this run, and the data
plan of the checkpoint a run resumes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from shared.cli import to_json
from shared.fsio import atomic_write_json
from shared.manifest import Manifest
from train.checkpoint import list_checkpoints, read_meta, resolve_resume
from train.config import TrainConfig
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


def run_record(cfg: TrainConfig, prep: Prepared, manifest: Manifest) -> dict[str, Any]:
    """What config.json holds: the resolved options, the drafter and the cache identity."""
    return {
        "train": to_json(cfg),
        "drafter": prep.drafter.to_dict(),
        "cache": manifest.identity(),
    }


def prepare_run_dir(
    cfg: TrainConfig, prep: Prepared, manifest: Manifest, *, world_size: int | None = None
) -> None:
    """Create the run folder or check that it holds this run; write config.json.

    `world_size` (None when unknown here, as under torchrun) is checked against the checkpoint
    a resume would start from: the data plan depends on it.
    """
    out = Path(cfg.out)
    path = out / CONFIG_FILE
    record = run_record(cfg, prep, manifest)
    if path.is_file():
        old = json.loads(path.read_text())
        harmful, harmless = config_changes(old.get("train", {}), record["train"])
        if old.get("drafter") != record["drafter"]:
            harmful.append("the drafter derived from the cache differs")
        if old.get("cache") != record["cache"]:
            harmful.append("the cache differs (manifest identity)")
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
    _check_resume_point(cfg, world_size)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, record)


def _check_resume_point(cfg: TrainConfig, world_size: int | None) -> None:
    try:
        path = resolve_resume(cfg.out, cfg.resume)
    except ValueError as e:
        raise RunError(str(e)) from None
    if path is None or world_size is None:
        return
    loader = read_meta(path).get("loader") or {}
    saved = (loader.get("world_size"), loader.get("workers"))
    if saved != (world_size, max(cfg.workers, 1)):
        raise RunError(
            f"{path} was written by {saved[0]} ranks x {saved[1]} loader streams, this run has "
            f"{world_size} x {max(cfg.workers, 1)}: resume with the same --gpus count and "
            "--workers, or start a new --out"
        )


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(harmful, harmless) field differences between two saved configs, as readable lines."""
    harmful, harmless = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            line = f"{key}: run has {old.get(key)!r}, now {new.get(key)!r}"
            (harmless if key in HARMLESS_CHANGES else harmful).append(line)
    return harmful, harmless
