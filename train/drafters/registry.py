"""The drafter types side by side: build and initialise the one a DrafterConfig names."""

from __future__ import annotations

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.dflash2 import DFlash2Drafter, init_dflash2_weights
from train.drafters.dspark import DSparkDrafter, init_dspark_weights

_FAMILIES = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter, "dspark": DSparkDrafter}


def build_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """An uninitialised drafter of `cfg.drafter_type` ("dflash", "dflash2" or "dspark")."""
    return _FAMILIES[cfg.drafter_type](cfg)


def init_weights(model: DFlashDrafter, seed: int) -> None:
    """The type's deterministic init; the DFlash2 and DSpark backbones start as the DFlash
    drafter of this seed."""
    if isinstance(model, DFlash2Drafter):
        init_dflash2_weights(model, seed)
    elif isinstance(model, DSparkDrafter):
        init_dspark_weights(model, seed)
    else:
        init_drafter_weights(model, seed)
