"""Which checkpoint a target folder holds: the two hashes a cache's manifest records of its
target (`TargetInfo.revision` and `.weights_sample`), computed here so that extraction, which
records them, and the proof commands, which compare a `--target` with a drafter's record, hash
alike."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

HEADER_ONLY_BYTES = 64 << 20  # `content_hash` also hashes the bytes of smaller weight files
# `weights_sample`: windows read per weight file, and their size. A checkpoint of the same
# shape (another fine-tune, another revision) differs in nearly every byte, so 16 windows tell
# it apart; reading 1 MiB a file keeps it instant for any target.
SAMPLE_WINDOWS, SAMPLE_BYTES = 16, 64 << 10


def safetensors_files(target: Path | str) -> list[Path]:
    """The target folder's weight files, in the order both hashes read them."""
    return sorted(Path(target).glob("*.safetensors"))


def content_hash(config: Path, files: Sequence[Path]) -> str:
    """sha256 over `config` (config.json) and the safetensors headers of `files` (names, shapes,
    dtypes, offsets).

    Reading headers only keeps this fast for large checkpoints; with random-init checkpoints of
    the same shape, the weight bytes are hashed too when the files are small (< 64 MiB).
    """
    h = hashlib.sha256(Path(config).read_bytes())
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + fh.read(n))
            if f.stat().st_size < HEADER_ONLY_BYTES:
                h.update(fh.read())
    return "sha256:" + h.hexdigest()


def weights_sample(files: Sequence[Path]) -> str:
    """sha256 over each weight file's name, size and SAMPLE_WINDOWS windows spread over it (the
    whole file when it is no larger): what `content_hash` (headers only) cannot tell apart, two
    checkpoints of one shape."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            if size <= SAMPLE_WINDOWS * SAMPLE_BYTES:
                h.update(fh.read())
                continue
            step = (size - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
            for i in range(SAMPLE_WINDOWS):
                h.update(os.pread(fh.fileno(), SAMPLE_BYTES, i * step))
    return "sha256:" + h.hexdigest()
