"""The `planes` codec of bf16 payloads: exponent bytes and sign+mantissa bytes apart.

Its settings and the `Bf16Planes` value are in ``shared/codec.py`` (with the manifest's codec
description); here are the split (on the host, or where a tensor lives: `split_planes`), the
encoding (`planes_frames`, `planes_compress`) and its inverse (`planes_decompress`), which also
reads the exponent frames of caches written before they were zstd (Blosc, named by their magic).
"""

from __future__ import annotations

from collections.abc import Callable

import numcodecs.blosc
import numcodecs.zstd
import numpy as np
import torch
from numcodecs import Blosc

from shared.codec import (
    PLANES_BLOSC,
    PLANES_EXPONENT_ZSTD,
    ZSTD_MAGIC,
    Bf16Planes,
    c_contiguous,
)
from shared.zstd_frames import zstd_frame

# Values per step of `split_planes` (its int16 temporaries: 128 MiB each).
SPLIT_ELEMENTS = 1 << 26


def planes_compress(a: np.ndarray) -> bytes:
    """bf16 bit patterns -> the `planes` encoding: exponent bytes and sign+mantissa bytes, each
    compressed alone.

    A bf16 is sign (1 bit), exponent (8), mantissa (7): Blosc's byte shuffle puts the sign and 7
    exponent bits in one byte stream and the last exponent bit with the mantissa in the other,
    and zstd then codes both streams with one Huffman table. Here the exponent is one stream
    (activations use few exponents: about 3 bits of entropy on a real target), a zstd frame
    (`exponent_frame`), and sign+mantissa the other, a Blosc lz4 frame. Layout: uint32
    little-endian size of the exponent frame, the exponent frame, the sign+mantissa frame
    (`planes_frames` gives the three pieces without joining them).

    >>> a = np.array([0x3F80, 0xC000, 0x0001, 0xFFFF], np.uint16)
    >>> np.array_equal(planes_decompress(planes_compress(a)), a)
    True
    """
    return b"".join(planes_frames(a))


def planes_frames(
    x: np.ndarray | Bf16Planes, exponent_coder: Callable[[np.ndarray], bytes] | None = None
) -> list[bytes]:
    """The `planes` encoding of bf16 bits (uint16) or of their planes (`Bf16Planes`, numpy), as
    its three consecutive pieces: size, exponent frame, sign+mantissa frame. Written as they are
    (os.writev) they need no joined copy, which would hold the GIL. `exponent_coder`: default
    `exponent_frame`; `blosc_exponent_frame` writes them as caches were written before zstd."""
    if not isinstance(x, Bf16Planes):
        x = _split_planes_host(x)
    exponent = c_contiguous(x.exponent).reshape(-1)
    if exponent.size == 0:  # Blosc does not decode an empty frame
        return [bytes(4)]
    e = (exponent_coder or exponent_frame)(exponent)
    sm = _planes_blosc(c_contiguous(x.sign_mantissa).reshape(-1), PLANES_BLOSC["sign_mantissa"])
    return [len(e).to_bytes(4, "little"), e, sm]


def exponent_frame(plane: np.ndarray) -> bytes:
    """The exponent bytes as a zstd frame (PLANES_EXPONENT_ZSTD)."""
    return zstd_frame(plane, PLANES_EXPONENT_ZSTD)


def blosc_exponent_frame(plane: np.ndarray) -> bytes:
    """The exponent bytes as `planes` caches wrote them before zstd: Blosc zstd-1."""
    return _planes_blosc(plane, PLANES_BLOSC["exponent"])


def _exponent_bytes(frame: memoryview) -> bytes:
    """Decode an exponent frame: zstd, or Blosc in caches written before zstd."""
    if bytes(frame[:4]) == ZSTD_MAGIC:
        return numcodecs.zstd.decompress(frame)
    return numcodecs.blosc.decompress(frame)


def _split_planes_host(a: np.ndarray) -> Bf16Planes:
    # uint16 ops then a wrapping cast: several times faster than ops on strided uint8 views.
    flat = c_contiguous(a).reshape(-1)
    exponent = (flat >> 7).astype(np.uint8)  # the cast drops the sign (bit 8 after the shift)
    sign_mantissa = flat & 0x807F
    sign_mantissa |= sign_mantissa >> 8
    return Bf16Planes(exponent, sign_mantissa.astype(np.uint8))


def split_planes(h: torch.Tensor) -> Bf16Planes:
    """A bf16 tensor's two `planes` byte planes, computed where it lives (on a GPU, a few
    elementwise kernels instead of several host passes under the writers' threads): exponent =
    bits 7..14, sign+mantissa = bit 15 then bits 0..6; uint8 tensors of h's shape, contiguous.
    Bit-equal to the host split (`planes_frames` of the uint16 bits); SPLIT_ELEMENTS values at a
    time, so the int16 temporaries stay small.

    >>> p = split_planes(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    >>> p.exponent.tolist(), p.sign_mantissa.tolist()
    ([127, 128], [0, 128])
    """
    if h.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {h.dtype}")
    bits = h.contiguous().view(torch.int16).reshape(-1)
    exponent = torch.empty(bits.shape, dtype=torch.uint8, device=h.device)
    sign_mantissa = torch.empty_like(exponent)
    for start in range(0, bits.numel(), SPLIT_ELEMENTS):
        b = bits[start : start + SPLIT_ELEMENTS]
        exponent[start : start + SPLIT_ELEMENTS].copy_(b >> 7)  # int16 -> uint8: the low byte
        sm = (b >> 8).bitwise_and_(0x80).bitwise_or_(b & 0x7F)
        sign_mantissa[start : start + SPLIT_ELEMENTS].copy_(sm)
    return Bf16Planes(exponent.view(h.shape), sign_mantissa.view(h.shape))


def merge_planes(p: Bf16Planes) -> np.ndarray:
    """The uint16 bf16 bits of numpy planes (inverse of the split), C-contiguous, p's shape."""
    exponent, sm = (c_contiguous(np.asarray(x)) for x in (p.exponent, p.sign_mantissa))
    out = np.empty(exponent.shape, np.uint16)
    _merge_into(exponent.reshape(-1), sm.reshape(-1), out.reshape(-1))
    return out


def _merge_into(exponent: np.ndarray, sign_mantissa: np.ndarray, flat: np.ndarray) -> None:
    np.left_shift(exponent, 7, out=flat, dtype=np.uint16)
    sm = sign_mantissa.astype(np.uint16)
    flat |= sm & 0x7F
    sm &= 0x80
    sm <<= 8
    flat |= sm


def planes_decompress(buf: bytes | memoryview, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of planes_compress: uint16 [N] (written into `out`, C-contiguous uint16, if
    given)."""
    view = memoryview(buf)
    n = int.from_bytes(view[:4], "little")
    if n == 0:
        empty = np.empty(0, np.uint16) if out is None else out
        if empty.size:
            raise ValueError(f"planes payload of 0 values, expected {empty.size}")
        return empty
    exponent = np.frombuffer(_exponent_bytes(view[4 : 4 + n]), np.uint8)
    sign_mantissa = np.frombuffer(numcodecs.blosc.decompress(view[4 + n :]), np.uint8)
    if out is None:
        out = np.empty(exponent.size, np.uint16)
    if out.size != exponent.size or sign_mantissa.size != exponent.size:
        raise ValueError(f"planes payload of {exponent.size} values, expected {out.size}")
    _merge_into(exponent, sign_mantissa, out.reshape(-1))
    return out


def _planes_blosc(plane: np.ndarray, s: dict) -> bytes:
    return numcodecs.blosc.compress(
        plane, s["cname"].encode(), s["clevel"], Blosc.NOSHUFFLE, s["blocksize"], 1
    )
