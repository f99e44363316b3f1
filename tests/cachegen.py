"""A tiny synthetic hidden-state cache for stage-two tests, written with the shared writer.

The data is learnable, so a short training run shows a falling loss: token ids follow a fixed
chain (each token determines the next), and every captured layer's hidden state at a position is
a fixed random code of that position's token plus noise. A prompt prefix has loss_mask 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from shared.cache import open_part_writer, part_name
from shared.codec import codec_description
from shared.manifest import (
    Manifest,
    PartRecord,
    SourceFile,
    TargetInfo,
    write_manifest,
)
from shared.target_files import EMBED_FILE, EMBED_KEY, LM_HEAD_KEY, target_checksums, target_dir

HIDDEN = 64
NUM_TARGET_LAYERS = 4
VOCAB = 320  # embedding rows
TOKENIZER_VOCAB = 300  # so row 300 is the default mask token


def target_config(*, hidden: int = HIDDEN, vocab: int = VOCAB) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": NUM_TARGET_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
    }


def _write_target(cache: Path, rng: np.random.Generator, hidden: int) -> None:
    folder = target_dir(cache)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(target_config(hidden=hidden), indent=2))
    embed = torch.from_numpy(rng.normal(0, 0.5, (VOCAB, hidden)).astype(np.float32))
    head = torch.from_numpy(rng.normal(0, 0.5, (VOCAB, hidden)).astype(np.float32))
    save_file(
        {EMBED_KEY: embed.to(torch.bfloat16), LM_HEAD_KEY: head.to(torch.bfloat16)},
        str(folder / EMBED_FILE),
    )


def _sample(rng: np.random.Generator, length: int, codes: np.ndarray) -> tuple:
    """(input_ids int32 [L], loss_mask uint8 [L], hidden bf16 [L, K, H]) of one sample."""
    ids = np.empty(length, np.int64)
    ids[0] = rng.integers(0, TOKENIZER_VOCAB)
    for t in range(1, length):
        ids[t] = (ids[t - 1] * 7 + 3) % TOKENIZER_VOCAB
    mask = np.ones(length, np.uint8)
    mask[: max(1, length // 5)] = 0
    noise = rng.normal(0, 0.1, (length, codes.shape[0], codes.shape[2]))
    hidden = codes[:, ids, :].transpose(1, 0, 2) + noise
    return (
        ids.astype(np.int32),
        mask,
        torch.from_numpy(hidden.astype(np.float32)).to(torch.bfloat16),
    )


def _write_part(
    root: Path,
    part: int,
    lens: list[int],
    codes: np.ndarray,
    rng: np.random.Generator,
    *,
    fmt: str,
    store: str,
) -> PartRecord:
    writer = open_part_writer(
        root,
        part,
        fmt=fmt,
        store=store,
        num_layers=codes.shape[0],
        hidden_size=codes.shape[2],
        lengths=lens,
    )
    first = part * len(lens)
    for n, length in enumerate(lens):
        ids, mask, hidden = _sample(rng, length, codes)
        writer.write(n, sample_index=first + n, input_ids=ids, loss_mask=mask, hidden=hidden)
    stats = writer.commit()
    return PartRecord.committed(
        stats, name=part_name(part, fmt), unit=part, rows=range(first, first + len(lens))
    )


def write_cache(
    root: Path,
    *,
    num_parts: int = 3,
    samples_per_part: int = 6,
    lengths: tuple[int, int] = (40, 300),
    layer_ids: tuple[int, ...] = (0, 1, 3),
    hidden: int = HIDDEN,
    fmt: str = "zarr",
    store: str = "bf16",
    complete: bool = True,
    max_length: int = 512,
    seed: int = 0,
) -> Path:
    """Write a cache of `num_parts` parts under `root` and return `root`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    _write_target(root, rng, hidden)
    codes = rng.normal(0, 1.0, (len(layer_ids), TOKENIZER_VOCAB, hidden))
    records = []
    for part in range(num_parts):
        lens = [int(n) for n in rng.integers(lengths[0], lengths[1] + 1, samples_per_part)]
        records.append(_write_part(root, part, lens, codes, rng, fmt=fmt, store=store))
    manifest = Manifest(
        complete=complete,
        format=fmt,
        store=store,
        codec=codec_description(store),
        target=TargetInfo(
            path="synthetic",
            revision="synthetic-0",
            model_type="qwen3",
            num_layers=NUM_TARGET_LAYERS,
            hidden_size=hidden,
            vocab_size=VOCAB,
            tokenizer_vocab_size=TOKENIZER_VOCAB,
        ),
        tokenizer_sha256="0" * 64,
        chat_template_sha256="0" * 64,
        layer_ids=tuple(layer_ids),
        max_length=max_length,
        rows_per_part=samples_per_part,
        sources=(SourceFile(path="synthetic.jsonl", sha256="0" * 64, rows=0),),
        total_rows=num_parts * samples_per_part,
        parts=tuple(records),
        target_files=target_checksums(root),
    )
    write_manifest(root, manifest)
    return root
