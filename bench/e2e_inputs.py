"""The inputs of `bench/e2e_gpu.py`'s run: a random-weight target folder of a real shape, and
pre-tokenized rows with a long-tailed length mix like chat data."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from shapes import hf_config


def long_tailed_lengths(tokens: int, *, seed: int, lo: int = 64, hi: int = 3072) -> list[int]:
    """Lengths summing to at least `tokens`: 6% at `hi`, the rest log-normal around 500."""
    rng, out = random.Random(seed), []
    while sum(out) < tokens:
        if rng.random() < 0.06:
            out.append(hi)
        else:
            out.append(int(min(hi, max(lo, rng.lognormvariate(math.log(500), 1.0)))))
    return out


def write_rows(path: Path, lengths: list[int], vocab: int, seed: int) -> None:
    """Pre-tokenized JSONL rows: a prompt (5-40% of the row, unsupervised), then the answer."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for n in lengths:
            prompt = max(1, int(n * rng.uniform(0.05, 0.4)))
            ids = rng.integers(0, vocab, n).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)}))
            f.write("\n")


def word_tokenizer(size: int):
    """A word-level tokenizer of `size` entries (pre-tokenized rows never touch its merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def write_target(shape: str, folder: Path, layers: int | None, device: str) -> dict[str, Any]:
    """A random-weight target folder of `shape` (first `layers` layers); returns its config."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    if layers:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")  # one shard's bytes at a time in memory
    # Qwen vocabularies hold ~290 rows past the tokenizer: the mask token lives there.
    word_tokenizer(cfg.vocab_size - 293).save_pretrained(folder)
    return cfg.to_dict()
