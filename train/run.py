"""Stage two's entry point: check the cache and the run folder, resolve defaults, launch ranks.

Everything that can refuse the run does so here, before any process starts or any file is
written: a cache that cannot serve the requested drafter (every problem listed in one
`CacheMismatch`), an invalid device list, or an existing run folder holding a different run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open

from shared.cli import to_json
from shared.dist import launch, parse_gpus, under_torchrun
from shared.fsio import atomic_write_json
from shared.manifest import CacheMismatch, Manifest, check_compatible, read_manifest
from shared.target_files import (
    EMBED_FILE,
    EMBED_KEY,
    read_target_config,
    target_dir,
    unused_special_token,
)
from train.anchors import default_gamma
from train.checkpoint import list_checkpoints, read_meta, resolve_resume
from train.config import TrainConfig, config_changes
from train.data import layer_positions, load_catalog, split_eval
from train.drafter_config import DrafterConfig
from train.loop import EXPORT_DIR, Prepared, train_rank

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


class RunError(ValueError):
    """The request cannot run as given (devices, run folder, options); the message says why."""


def run(cfg: TrainConfig) -> Path:
    """Train as `cfg` says; return the export folder."""
    try:
        spec = parse_gpus(cfg.gpus)
    except ValueError as e:
        raise RunError(str(e)) from None
    manifest = read_manifest(cfg.data)
    cfg, prep = prepare(cfg, manifest, device_kind=spec.kind)
    world_size = None if under_torchrun() else spec.nprocs
    prepare_run_dir(cfg, prep, manifest, world_size=world_size)
    log.info(
        "training a %d-layer drafter on %d parts (%d held out) with %s, target layers %s",
        prep.drafter.num_layers,
        len(prep.train_parts),
        len(prep.eval_parts),
        spec,
        list(prep.drafter.target_layer_ids),
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
    cfg: TrainConfig, manifest: Manifest, *, device_kind: str
) -> tuple[TrainConfig, Prepared]:
    """The resolved config and what every rank needs; CacheMismatch lists every problem."""
    cfg = resolve_devices(cfg, device_kind)
    problems: list[str] = []
    wanted = cfg.target_layer_ids or tuple(manifest.layer_ids)
    drafter, hidden = _drafter_config(cfg, manifest, wanted, problems)
    embed_rows = _embedding_rows(cfg.data, manifest, problems)
    try:
        check_compatible(
            manifest, cache=cfg.data, layer_ids=wanted, hidden_size=hidden, vocab_size=embed_rows
        )
    except CacheMismatch as e:
        problems = e.problems + problems
    parts, part_problems = load_catalog(cfg.data, manifest)
    problems += part_problems
    num_eval = (
        cfg.eval_parts
        if cfg.eval_parts is not None
        else int(cfg.eval_fraction * len(manifest.parts))
    )
    if parts and num_eval >= len(parts):
        problems.append(f"cannot hold out {num_eval} of {len(parts)} parts for evaluation")
    if not manifest.parts:
        problems.append("the cache holds no parts")
    if problems or drafter is None:
        raise CacheMismatch(cfg.data, problems)
    train_parts, eval_parts = split_eval(len(parts), num_eval)
    gamma = cfg.gamma or default_gamma(cfg.block_size)
    cfg = cfg.replace(
        target_layers=",".join(map(str, wanted)),
        layer_types=",".join(drafter.layer_types),
        mask_token_id=drafter.mask_token_id,
        gamma=gamma,
        max_length=cfg.max_length or manifest.max_length,
    )
    prep = Prepared(
        drafter=drafter,
        parts=tuple(parts),
        train_parts=tuple(train_parts),
        eval_parts=tuple(eval_parts),
        layers=layer_positions(manifest.layer_ids, wanted),
        gamma=gamma,
    )
    return cfg, prep


def _drafter_config(
    cfg: TrainConfig, manifest: Manifest, wanted: tuple[int, ...], problems: list[str]
) -> tuple[DrafterConfig | None, int | None]:
    """(the drafter's config, the hidden size it needs), None where the target config fails."""
    try:
        target_cfg = read_target_config(cfg.data)
        text = target_cfg.get("text_config") or target_cfg
        hidden = int(text["hidden_size"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        problems.append(f"target config unreadable ({e!r})")
        return None, None
    try:
        drafter = DrafterConfig.from_target_config(
            target_cfg,
            num_layers=cfg.drafter_layers,
            target_layer_ids=wanted,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            layer_types=cfg.layer_type_names,
            sliding_window=cfg.sliding_window,
            tokenizer_vocab_size=manifest.target.tokenizer_vocab_size,
            unused_token=unused_special_token(cfg.data),
        )
        shape = {
            "num_attention_heads": cfg.drafter_heads,
            "num_key_value_heads": cfg.drafter_kv_heads,
            "head_dim": cfg.drafter_head_dim,
            "intermediate_size": cfg.drafter_intermediate,
        }
        drafter = dataclasses.replace(drafter, **{k: v for k, v in shape.items() if v is not None})
    except (ValueError, KeyError) as e:
        problems.append(f"drafter config: {e}")
        return None, hidden
    return drafter, hidden


def _embedding_rows(cache: Path, manifest: Manifest, problems: list[str]) -> int | None:
    """Rows of the cached embedding; a hidden size other than the manifest's is a problem."""
    path = target_dir(cache) / EMBED_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            rows, hidden = f.get_slice(EMBED_KEY).get_shape()
    except (OSError, KeyError, ValueError) as e:
        problems.append(f"target embedding {path} unreadable ({e})")
        return None
    if hidden != manifest.target.hidden_size:
        problems.append(
            f"target embedding has hidden size {hidden}, the manifest says "
            f"{manifest.target.hidden_size}"
        )
    return int(rows)


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
