"""zarr's side of the cache's codecs: the `hidden` array's codecs as its metadata declares
them (`hidden_compressors`), the functions that encode its chunks as those declare
(`hidden_compressor`), and the `planes` and `int4` codecs registered with zarr by name, so that
zarr reads such chunks like any other (``shared/zarr_part.py`` writes the shards itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zarr.registry
from zarr.abc.codec import BytesBytesCodec
from zarr.codecs import BloscCodec, Crc32cCodec
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer

from shared.codec import (
    Bf16Planes,
    blosc_compressor,
    blosc_settings,
    c_contiguous,
    hidden_codec,
    payload_dtype,
)
from shared.int4 import Int4Scheme
from shared.int4_frames import int4_frames, int4_unframe
from shared.planes import planes_compress, planes_decompress, planes_frames
from shared.zarr_shards import INT4_CODEC_NAME, PLANES_CODEC_NAME


def zarr_compressors(typesize: int) -> list:
    """Blosc (cache settings) then crc32c, so every chunk is checksummed when decoded."""
    return [BloscCodec(**blosc_settings(typesize)), Crc32cCodec()]


@dataclass(frozen=True)
class PlanesCodec(BytesBytesCodec):
    """zarr's side of `shared.planes.planes_compress` (bf16 chunks), registered by name, so zarr
    reads such chunks like any other; `hidden` arrays written before it name Blosc instead."""

    is_fixed_size = False

    @classmethod
    def from_dict(cls, data: dict) -> PlanesCodec:
        return cls()

    def to_dict(self) -> dict:
        return {"name": PLANES_CODEC_NAME}

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        values = planes_decompress(memoryview(chunk_bytes.as_numpy_array()))
        return chunk_spec.prototype.buffer.from_array_like(values.view(np.uint8))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        data = chunk_bytes.as_numpy_array().view(np.uint16)
        return chunk_spec.prototype.buffer.from_bytes(planes_compress(data))

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


zarr.registry.register_codec(PLANES_CODEC_NAME, PlanesCodec)


@dataclass(frozen=True)
class Int4Codec(BytesBytesCodec):
    """zarr's side of `shared.int4_frames.int4_frames` (int4 records' chunks [CHUNK_ROWS, 1, W]),
    registered by name, so zarr reads such chunks like any other."""

    is_fixed_size = False

    @classmethod
    def from_dict(cls, data: dict) -> Int4Codec:
        return cls()

    def to_dict(self) -> dict:
        return {"name": INT4_CODEC_NAME}

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        values = int4_unframe(memoryview(chunk_bytes.as_numpy_array()), chunk_spec.shape[-1])
        return chunk_spec.prototype.buffer.from_array_like(values.reshape(-1))

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        width = chunk_spec.shape[-1]
        records = chunk_bytes.as_numpy_array().reshape(-1, width)
        pieces = int4_frames(records, Int4Scheme(hidden=width - 4).int4_bytes)
        return chunk_spec.prototype.buffer.from_bytes(b"".join(pieces))

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


zarr.registry.register_codec(INT4_CODEC_NAME, Int4Codec)


def hidden_compressors(store: str) -> list:
    """The `hidden` array's codecs: the store's codec (`shared.codec.hidden_codec`), crc32c."""
    if hidden_codec(store) == "planes":
        return [PlanesCodec(), Crc32cCodec()]
    if hidden_codec(store) == "int4":
        return [Int4Codec(), Crc32cCodec()]
    return zarr_compressors(payload_dtype(store).itemsize)


def hidden_compressor(
    store: str, hidden_size: int
) -> Callable[[np.ndarray | Bf16Planes], list[bytes]]:
    """The function encoding one inner chunk of `hidden` ([CHUNK_ROWS, W]: the store's bits or
    records, or bf16 planes) as `hidden_compressors` declares, as buffers to write one after
    another."""
    if hidden_codec(store) == "planes":
        return planes_frames
    if hidden_codec(store) == "int4":
        split = Int4Scheme(hidden=hidden_size).int4_bytes
        return lambda block: int4_frames(c_contiguous(block), split)
    blosc = blosc_compressor(payload_dtype(store).itemsize)
    return lambda block: [blosc(c_contiguous(block))]
