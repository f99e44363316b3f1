"""A warm start: a drafter's weights from a checkpoint or an export of a compatible one."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shared.stopping import StopRun
from train.checkpoint import (
    STATE_FILE,
    checkpoint_problem,
    drafter_config,
    is_complete,
    load_drafter,
)
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.export import CONFIG_FILE, WEIGHTS_FILE
from train.export_load import export_config, load_export, weights_problem

log = logging.getLogger(__name__)


# Fields a warm start must share with the drafter it initialises (shapes are checked apart).
_WARM_START_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
)


# A warm start's kinds of folder: (its config alone, its drafter and config)
READERS = {"checkpoint": (drafter_config, load_drafter), "export": (export_config, load_export)}


def init_from_problem(path: str | Path) -> str | None:
    """Why `path` holds no drafter to start from (neither a checkpoint nor an export, or a file
    of it missing or damaged), naming the file; None when it holds one. Read before any rank
    starts and before the run folder is written: a checkpoint's state.pt against the size and
    crc32c its meta.json records (the ranks trust this finding), an export's weights from their
    header."""
    folder = Path(path)
    kind = _kind(folder)
    if kind not in READERS:
        return _not_a_drafter(folder, kind)
    try:
        if kind == "checkpoint":
            drafter_config(folder)
            problem = checkpoint_problem(folder)
        else:
            problem = weights_problem(folder, export_config(folder))
    except ValueError as e:
        problem = str(e)
    except OSError as e:  # unreadable: permissions, a failing disk
        problem = f"{e.filename or folder} cannot be read ({e.strerror or e})"
    return None if problem is None else _named(folder, kind, problem)


def _named(folder: Path, kind: str, problem: str) -> str:
    """`problem` after --init-from and the folder (an export's problems start with it)."""
    return f"--init-from {problem}" if kind == "export" else f"--init-from {folder}: {problem}"


def init_from_problems(path: str | Path, cfg: DrafterConfig) -> list[str]:
    """What keeps the drafter at `path` (`init_from_problem` None) from starting one of `cfg`,
    read from its config alone: [] when it fits."""
    folder = Path(path)
    return config_problems(READERS[_kind(folder)][0](folder), cfg, path)


def _kind(folder: Path) -> str | None:
    """ "checkpoint" (a step-N folder), "export", "run" (a run folder: its config.json is the
    run's, not an export's), or None."""
    if is_complete(folder):
        return "checkpoint"
    if (folder / "checkpoints").is_dir() or (folder / "export").is_dir():
        return "run"
    return "export" if (folder / CONFIG_FILE).is_file() else None


def _not_a_drafter(folder: Path, kind: str | None) -> str:
    hint = ""
    if kind == "run":
        hint = f": it is a run folder; give {folder / 'export'} or one of its checkpoints"
    elif not folder.exists():
        hint = ": no such folder"
    return f"--init-from {folder} is neither a complete checkpoint nor an export{hint}"


def config_problems(source: DrafterConfig, cfg: DrafterConfig, path: str | Path) -> list[str]:
    return [
        f"{name}: {getattr(source, name)} in {path}, {getattr(cfg, name)} here"
        for name in _WARM_START_FIELDS
        if getattr(source, name) != getattr(cfg, name)
    ]


def warm_start_state(path: str | Path) -> tuple[dict[str, torch.Tensor], DrafterConfig]:
    """(float32 weights, config) of a checkpoint folder (step-N) or an export folder."""
    folder = Path(path)
    kind = _kind(folder)
    if kind not in READERS:
        raise ValueError(_not_a_drafter(folder, kind))
    try:
        drafter, cfg = READERS[kind][1](folder)
    except ValueError as e:  # a file changed since `init_from_problem`, or torch finds it damaged
        raise StopRun(_named(folder, kind, str(e))) from None
    except OSError as e:  # torch's zip reader fails on some archives cut short with EINVAL
        where = e.filename or folder / (STATE_FILE if kind == "checkpoint" else WEIGHTS_FILE)
        raise StopRun(f"--init-from {folder}: {where} cannot be read ({e.strerror or e})") from None
    return {k: v.float() for k, v in drafter.state_dict().items()}, cfg


@torch.no_grad()
def warm_start(model: DFlashDrafter, path: str | Path) -> list[str]:
    """Copy a DFlash or DFlash2 drafter's weights into `model`; return the names it did not
    hold (a DFlash start leaves DFlash2's additions at their no-op init). ValueError names every
    config field, weight name or shape that does not fit."""
    state, source = warm_start_state(path)
    problems = config_problems(source, model.cfg, path)
    own = model.state_dict()
    problems += [
        f"{name}: not a parameter of this drafter" for name in sorted(set(state) - set(own))
    ]
    problems += [
        f"{name}: shape {tuple(t.shape)} in {path}, {tuple(own[name].shape)} here"
        for name, t in sorted(state.items())
        if name in own and t.shape != own[name].shape
    ]
    if problems:
        raise ValueError("init_from does not fit the drafter:\n  - " + "\n  - ".join(problems))
    for name, tensor in state.items():
        own[name].copy_(tensor)
    missing = sorted(set(own) - set(state))
    log.info(
        "warm start from %s (%s); kept the init of %d tensors",
        path,
        source.drafter_type,
        len(missing),
    )
    return missing
