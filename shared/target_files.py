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


def _token_text(value: Any) -> str | None:
    """A tokenizer_config special-token entry (a string or an AddedToken dict) as its text."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def unused_special_token(cache: Path) -> int | None:
    """The mask-token rule for a tokenizer that fills its embedding (no row past it to spare).

    The highest-id special token added to the tokenizer that is none of its bos, eos, pad and unk
    tokens and that its chat template never writes: the rendered chats cannot contain it, so the
    drafter's mask embedding is a row that the data never uses. None if there is no such token.
    Read from the cached tokenizer files alone (the trainer loads no tokenizer).

    SmolLM2's tokenizer: `<empty_output>` (id 16), after `<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>` and the code-data markers `<repo_name>` .. `<jupyter_script>`.
    """
    folder = target_dir(cache)
    try:
        added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens") or []
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") or ""
    if (folder / "chat_template.jinja").is_file():
        template += (folder / "chat_template.jinja").read_text()
    named = {
        _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    free = [
        int(t["id"])
        for t in added
        if t.get("special") and t.get("content") not in named and t.get("content") not in template
    ]
    return max(free) if free else None
