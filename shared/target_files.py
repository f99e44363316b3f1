"""What a cache keeps of its target in `<cache>/target/`: enough to train without the checkpoint.

`target/` holds the tokenizer files, the target's `config.json`, and `embed.safetensors` with the
embedding (`embed_tokens`) and, when not tied to it, the output head (`lm_head`), both [V, H].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

TARGET_DIR = "target"
EMBED_FILE = "embed.safetensors"
EMBED_KEY = "embed_tokens"
LM_HEAD_KEY = "lm_head"  # absent when the target ties its output head to the embedding


def target_dir(cache: Path) -> Path:
    return Path(cache) / TARGET_DIR


def read_target_config(cache: Path) -> dict[str, Any]:
    return json.loads((target_dir(cache) / "config.json").read_text())


def load_heads(
    cache: Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of the cached target; tied heads share one tensor."""
    path = target_dir(cache) / EMBED_FILE
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        embed = f.get_tensor(EMBED_KEY)
        lm_head = f.get_tensor(LM_HEAD_KEY) if LM_HEAD_KEY in f.keys() else embed
    if dtype is not None:
        embed, lm_head = embed.to(dtype), (lm_head.to(dtype) if lm_head is not embed else None)
        lm_head = embed if lm_head is None else lm_head
    return embed, lm_head
