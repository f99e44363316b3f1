"""A tiny Qwen3-shaped target config, and the drafters and masks the drafter tests build from it."""

from __future__ import annotations

from typing import Any

import torch

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.mask import build_masks

TINY_TARGET = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 8,
    "vocab_size": 300,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}


def tiny_drafter_config(**kwargs) -> DrafterConfig:
    """A drafter for TINY_TARGET: 2 layers, target layers (1, 4, 6), blocks of 4, mask id 299;
    keyword arguments of `DrafterConfig.from_target_config` override any of these."""
    defaults = dict(num_layers=2, target_layer_ids=(1, 4, 6), block_size=4, mask_token_id=299)
    return DrafterConfig.from_target_config(TINY_TARGET, **{**defaults, **kwargs})


def tiny_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """A seeded drafter in eval mode whose norm weights are not all ones, so a swapped, skipped
    or misplaced norm shows in a comparison."""
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return drafter.eval()


def drafter_masks(
    cfg: DrafterConfig,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    context_len: int,
    attention: str = "sdpa",
) -> dict[str, Any]:
    """The per-layer-type masks `build_masks` gives for `cfg`'s block size and layer types."""
    return build_masks(
        anchors_BN,
        keep_BN,
        context_len=context_len,
        block_size=cfg.block_size,
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
        attention=attention,
    )
