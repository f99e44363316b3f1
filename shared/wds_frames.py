"""A webdataset sample's payload as compressed frames (`KEY.hidden.blosc` in `shared.wds`): Blosc,
bf16 `planes` or int4 records, a long sample in several frames."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.codec import c_contiguous, numcodecs_blosc
from shared.int4_frames import int4_frames, int4_unframe
from shared.planes import planes_compress, planes_decompress

# Blosc takes at most ~2 GiB per call; a long sample is stored as several frames.
FRAME_BYTES = 1 << 29


def compress_payload(payload: np.ndarray, codec: str = "blosc", split: int = 0) -> list[bytes]:
    """Frames of a C-contiguous array's bytes: Blosc (cache settings, typesize = itemsize) or,
    for bf16 bits, `planes` (`shared.planes.planes_compress`), or for int4 records [..., W]
    `shared.int4_frames.int4_frames` (`split`: the records' int4 bytes)."""
    if codec == "int4":
        rows = c_contiguous(payload).reshape(-1, payload.shape[-1])
        step = max(1, FRAME_BYTES // rows.shape[1])
        return [b"".join(int4_frames(rows[i : i + step], split)) for i in range(0, len(rows), step)]
    if codec == "planes":
        flat = c_contiguous(payload).reshape(-1)
        step = FRAME_BYTES // 2
        return [planes_compress(flat[i : i + step]) for i in range(0, flat.size, step)]
    blosc = numcodecs_blosc(payload.itemsize)
    flat = c_contiguous(payload).reshape(-1).view(np.uint8)
    return [blosc.encode(flat[i : i + FRAME_BYTES]) for i in range(0, flat.size, FRAME_BYTES)]


def decompress_payload(
    blob: bytes,
    frames: Sequence[int],
    dtype: np.dtype,
    shape: Sequence[int],
    codec: str = "blosc",
) -> np.ndarray:
    """Inverse of compress_payload; ``frames`` are the compressed frame sizes."""
    out = np.empty(tuple(shape), dtype)
    if codec == "int4":
        return _decompress_int4(blob, frames, out)
    planes = codec == "planes"
    flat = out.reshape(-1) if planes else out.reshape(-1).view(np.uint8)
    step = FRAME_BYTES // 2 if planes else FRAME_BYTES
    blosc = numcodecs_blosc(out.itemsize)
    view, pos, done = memoryview(blob), 0, 0
    for size in frames:
        n = min(step, flat.size - done)
        if planes:
            planes_decompress(view[pos : pos + size], out=flat[done : done + n])
        else:
            blosc.decode(view[pos : pos + size], out=flat[done : done + n])
        pos, done = pos + size, done + n
    if pos != len(view) or done != flat.size:
        raise ValueError(f"payload of {len(view)} bytes does not decode to {tuple(shape)}")
    return out


def _decompress_int4(blob: bytes, frames: Sequence[int], out: np.ndarray) -> np.ndarray:
    rows = out.reshape(-1, out.shape[-1])
    view, pos, done = memoryview(blob), 0, 0
    for size in frames:
        n = len(int4_unframe(view[pos : pos + size], rows.shape[1], out=rows[done:]))
        pos, done = pos + size, done + n
    if pos != len(view) or done != len(rows):
        raise ValueError(f"payload of {len(view)} bytes does not decode to {out.shape}")
    return out
