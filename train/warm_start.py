"""A warm start: a drafter's weights from a checkpoint or an export of a compatible one."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from train.checkpoint import is_complete, load_drafter
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.export import load_export

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


def warm_start_state(path: str | Path) -> tuple[dict[str, torch.Tensor], DrafterConfig]:
    """(float32 weights, config) of a checkpoint folder (step-N) or an export folder."""
    folder = Path(path)
    if is_complete(folder):
        drafter, cfg = load_drafter(folder)
    elif (folder / "config.json").is_file():
        drafter, cfg = load_export(folder)
    else:
        raise ValueError(f"init_from: {folder} is neither a complete checkpoint nor an export")
    return {k: v.float() for k, v in drafter.state_dict().items()}, cfg


@torch.no_grad()
def warm_start(model: DFlashDrafter, path: str | Path) -> list[str]:
    """Copy a DFlash or DFlash2 drafter's weights into `model`; return the names it did not
    hold (a DFlash start leaves DFlash2's additions at their no-op init). ValueError names every
    config field, weight name or shape that does not fit."""
    state, source = warm_start_state(path)
    problems = [
        f"{name}: {getattr(source, name)} in {path}, {getattr(model.cfg, name)} here"
        for name in _WARM_START_FIELDS
        if getattr(source, name) != getattr(model.cfg, name)
    ]
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
