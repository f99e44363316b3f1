"""The drafter types side by side: build and initialise the one a DrafterConfig names."""

from __future__ import annotations

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.dflash2 import DFlash2Drafter, init_dflash2_weights


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """An uninitialised drafter of `cfg.drafter_type` ("dflash" or "dflash2")."""
    return DFlash2Drafter(cfg) if cfg.drafter_type == "dflash2" else DFlashDrafter(cfg)


def init_weights(model: DFlashDrafter, seed: int) -> None:
    """The type's deterministic init; a DFlash2 drafter starts as the DFlash one of this seed."""
    if isinstance(model, DFlash2Drafter):
        init_dflash2_weights(model, seed)
    else:
        init_drafter_weights(model, seed)
