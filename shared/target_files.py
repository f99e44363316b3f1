"""What a cache keeps of its target in `<cache>/target/`: enough to train without the checkpoint.

`target/` holds the tokenizer files, the target's `config.json`, and `embed.safetensors` with the
embedding (`embed_tokens`) and, when not tied to it, the output head (`lm_head`), both [V, H].
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.checksum import crc32c_file, tree_file_sizes

log = logging.getLogger(__name__)

TARGET_DIR = "target"
EMBED_FILE = "embed.safetensors"
EMBED_KEY = "embed_tokens"
LM_HEAD_KEY = "lm_head"  # absent when the target ties its output head to the embedding


def target_dir(cache: Path) -> Path:
    return Path(cache) / TARGET_DIR


def read_target_config(cache: Path) -> dict[str, Any]:
    """The cached target's config.json; ValueError naming the file when it cannot be read."""
    path = target_dir(cache) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read ({e})") from None


def target_checksums(cache: Path) -> dict[str, dict[str, Any]]:
    """{file under target/: {size, checksum}} of every file in `<cache>/target/`, for the
    manifest: the trainer reads these files, so they are verified like the parts."""
    folder = target_dir(cache)
    return {
        rel: {"size": size, "checksum": crc32c_file(folder / rel)}
        for rel, size in sorted(tree_file_sizes(folder).items())
    }


def target_problems(cache: Path, recorded: dict[str, dict[str, Any]]) -> list[str]:
    """Every difference between `<cache>/target/` and the manifest's record of it (sizes, then
    checksums: each file is read once). An empty record (a cache written before the record
    existed) is not checked: a warning says so."""
    if not recorded:
        log.warning("%s: the manifest records no checksums of target/: not checked", cache)
        return []
    folder, problems = target_dir(cache), []
    for rel, want in sorted(recorded.items()):
        path = folder / rel
        if not path.is_file():
            problems.append(f"{TARGET_DIR}/{rel}: missing")
        elif path.stat().st_size != want["size"]:
            problems.append(
                f"{TARGET_DIR}/{rel}: {path.stat().st_size} bytes, the manifest says {want['size']}"
            )
        elif crc32c_file(path) != want["checksum"]:
            problems.append(f"{TARGET_DIR}/{rel}: its checksum differs from the manifest's")
    return problems


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
