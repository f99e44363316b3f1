"""Direct reads and checks of the shard files of a zarr part's ``hidden`` array.

`shard_buffers` writes each shard as zarr v3 ``sharding_indexed`` declares
it (per layer an inner chunk: codec, then crc32c; the index at the end, with its crc32c). When a
part's metadata is exactly that layout (`inner_codec`), the reader and the verifier read the
files themselves (`ShardFiles`: plain preads, only the requested layers' chunks, every checksum
checked): several times less CPU than zarr's read path (``python bench/part_read_bench.py``).
Any other layout is read through zarr.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import crc32c
import numcodecs.blosc
import numpy as np

from shared.codec import CHUNK_ROWS, Bf16Planes, payload_dtype, payload_width, torch_bits
from shared.int4_frames import int4_unframe
from shared.planes import planes_decompress

# The names under which the `planes` and `int4` codecs are registered with zarr
# (``shared.zarr_part``).
PLANES_CODEC_NAME = "dflash_offline.planes"
INT4_CODEC_NAME = "dflash_offline.int4"
# The hidden array's chunk keys: `c.<i>.0.0`, every shard file in the array's own folder. A key
# of '/' (`c/<i>/0/0`, what parts were written with before) costs two new folders a file, which
# cut the disk threads' rate 1.4-2x at an int4 shard's size on a 2-core CPU machine (`python
# bench/shard_write.py`); parts with either are read.
KEY_SEPARATOR = "."
KEY_SEPARATORS = (".", "/")


def inner_codec(meta: Path, K: int, H: int) -> tuple[str, str] | None:
    """('planes', 'int4' or 'blosc', the chunk keys' separator) when the hidden array's metadata
    is the layout `shard_buffers` writes (shards [CHUNK_ROWS, K, H] of inner chunks
    [CHUNK_ROWS, 1, H], H the payload's width, bytes -> codec -> crc32c, index at the end with
    crc32c; keys `c.<i>.0.0`, or `c/<i>/0/0` in parts written before flat keys); None
    otherwise."""
    try:
        m = json.loads(meta.read_text())
        (shard,) = m["codecs"]
        cfg = shard["configuration"]
        names = [c["name"] for c in cfg["codecs"]]
        index = [c["name"] for c in cfg["index_codecs"]]
        layout_ok = (
            shard["name"] == "sharding_indexed"
            and m["chunk_grid"]["configuration"]["chunk_shape"] == [CHUNK_ROWS, K, H]
            and cfg["chunk_shape"] == [CHUNK_ROWS, 1, H]
            and cfg.get("index_location", "end") == "end"
            and index == ["bytes", "crc32c"]
            and m["chunk_key_encoding"]["name"] == "default"
            and m["chunk_key_encoding"]["configuration"]["separator"] in KEY_SEPARATORS
            and names[0] == "bytes"
            and names[-1] == "crc32c"
            and len(names) == 3
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    codec = {PLANES_CODEC_NAME: "planes", INT4_CODEC_NAME: "int4", "blosc": "blosc"}.get(names[1])
    if not layout_ok or codec is None:
        return None
    return codec, m["chunk_key_encoding"]["configuration"]["separator"]


def shard_key(i: int, separator: str = KEY_SEPARATOR) -> str:
    """Shard file i of `hidden`, relative to the part: its zarr chunk key under `separator`.

    >>> shard_key(7), shard_key(7, "/")
    ('hidden/c.7.0.0', 'hidden/c/7/0/0')
    """
    return f"hidden/c{separator}{i}{separator}0{separator}0"


def shard_problems(shards: ShardFiles, i: int) -> list[str]:
    """Problems of shard file i of `hidden` (rows i*CHUNK_ROWS ..); a missing file is none here
    (zarr's fill value; `nchunks_initialized` reports it)."""
    try:
        shards.chunks(i, range(shards.num_layers))
    except FileNotFoundError:
        return []
    except (OSError, ShardError) as e:
        reason = e.reason if isinstance(e, ShardError) else f"{type(e).__name__}: {e}"
        return [f"hidden rows {i * CHUNK_ROWS}..{(i + 1) * CHUNK_ROWS}: {reason}"]
    return []


class ShardError(ValueError):
    """A hidden shard file fails a check: `reason` says which, the message names the file."""

    def __init__(self, file: str, reason: str):
        super().__init__(f"{file}: {reason} (python -m extract.verify finds every such part)")
        self.reason = reason


class ShardFiles:
    """Direct reads of the hidden shards `shard_buffers` writes, as zarr would read them: per
    shard the index (its crc32c checked), then only the requested layers' inner chunks, each
    crc32c-checked and decoded with the part's codec (`inner_codec`) to [CHUNK_ROWS, W] (W the
    payload's width: the hidden size, or an int4 record's). Plain preads of one file, no event
    loop: several times less CPU than zarr's read path."""

    def __init__(
        self, path: Path, store: str, inner: tuple[str, str], num_layers: int, hidden_size: int
    ):
        """`inner`: (codec, key separator), `inner_codec`'s."""
        self.path, (self.inner, self.separator) = str(path), inner
        self.dtype = payload_dtype(store)
        self.num_layers, self.width = num_layers, payload_width(store, hidden_size)

    def read(self, rows: slice, layers: Sequence[int]) -> np.ndarray:
        """[rows, len(layers), H] of the payload; raises ShardError, or FileNotFoundError for a
        missing shard (zarr would return zeros: a part that misses one is damaged)."""
        start, stop = int(rows.start), int(rows.stop)
        out = np.empty((stop - start, len(layers), self.width), self.dtype)
        for shard in range(start // CHUNK_ROWS, -(-stop // CHUNK_ROWS)):
            first = shard * CHUNK_ROWS
            lo, hi = max(start, first), min(stop, first + CHUNK_ROWS)
            for j, values in enumerate(self.chunks(shard, layers)):
                out[lo - start : hi - start, j] = values[lo - first : hi - first]
        return out

    def chunks(self, shard: int, layers: Sequence[int]) -> list[np.ndarray]:
        """The decoded [CHUNK_ROWS, W] chunks of `layers` in shard file `shard`."""
        file = f"{self.path}/{shard_key(shard, self.separator)}"
        fd = os.open(file, os.O_RDONLY)
        try:
            size, n_index = os.fstat(fd).st_size, 16 * self.num_layers
            if size < n_index + 4:
                raise ShardError(file, f"shard of {size} bytes, shorter than its index")
            tail = os.pread(fd, n_index + 4, size - n_index - 4)
            if crc32c.crc32c(tail[:-4]) != int.from_bytes(tail[-4:], "little"):
                raise ShardError(file, "the shard index fails its crc32c checksum")
            entries = struct.unpack(f"<{2 * self.num_layers}Q", tail[:-4])
            return [self._chunk(fd, file, k, entries, size - n_index - 4) for k in layers]
        finally:
            os.close(fd)

    def _chunk(self, fd: int, file: str, k: int, entries: tuple, end: int) -> np.ndarray:
        offset, size = entries[2 * k], entries[2 * k + 1]
        if offset == size == (1 << 64) - 1:
            raise ShardError(file, f"layer {k}'s chunk is missing from its shard")
        if size < 4 or offset + size > end:
            raise ShardError(file, f"layer {k}'s chunk lies outside its shard")
        data = os.pread(fd, size, offset)
        chunk = memoryview(data)[:-4]
        if len(data) != size or crc32c.crc32c(chunk) != int.from_bytes(data[-4:], "little"):
            raise ShardError(file, f"layer {k}'s chunk fails its crc32c checksum")
        try:
            if self.inner == "planes":
                values = planes_decompress(chunk)
            elif self.inner == "int4":
                values = int4_unframe(chunk, self.width)
            else:
                values = np.frombuffer(numcodecs.blosc.decompress(chunk), self.dtype)
        except Exception as e:  # whatever the codec raises, named as a damaged chunk
            raise ShardError(
                file, f"layer {k}'s chunk does not decode: {type(e).__name__}: {e}"
            ) from e
        if values.size != CHUNK_ROWS * self.width:
            raise ShardError(file, f"layer {k}'s chunk decodes to the wrong size")
        return values.reshape(CHUNK_ROWS, self.width)


def shard_buffers(
    block: np.ndarray | Bf16Planes, compress: Callable[[np.ndarray | Bf16Planes], list[bytes]]
) -> list[bytes]:
    """The file of one ``hidden`` shard ([CHUNK_ROWS, K, H] rows, little-endian, or their bf16
    planes) as its zarr metadata declares, as consecutive buffers: per layer an inner chunk
    bytes -> its codec (`compress`, from `hidden_compressor`) -> crc32c, then the shard index
    (uint64 offset and size per inner chunk, little-endian) and its crc32c (zarr v3
    ``sharding_indexed``, index at the end). Runs in the calling thread; Blosc and crc32c release
    the GIL, the Python around them is kept short (it holds the GIL, which the thread launching
    the forward pass waits for), and the buffers are never joined (a copy under the GIL): write
    them with ``write_buffers``."""
    out, index, offset = [], [], 0
    for k in range(block.shape[1]):
        pieces = compress(block[:, k])  # no copy for a layer-major block
        size, crc = 0, 0
        for piece in pieces:
            size, crc = size + len(piece), crc32c.crc32c(piece, crc)
        out += [*pieces, crc.to_bytes(4, "little")]
        index += [offset, size + 4]
        offset += size + 4
    index_bytes = struct.pack(f"<{len(index)}Q", *index)
    return out + [index_bytes, crc32c.crc32c(index_bytes).to_bytes(4, "little")]


def zero_padded(block: np.ndarray | Bf16Planes) -> np.ndarray | Bf16Planes:
    """[n, K, H] -> [CHUNK_ROWS, K, H], zero rows after the n given: a view of layer-major
    memory (each layer's rows contiguous, as `shard_buffers` wants), copied by torch, which
    releases the GIL (numpy's strided copy holds it). Planes are padded each (a zero bf16 has
    zero planes)."""
    if isinstance(block, Bf16Planes):
        return Bf16Planes(zero_padded(block.exponent), zero_padded(block.sign_mantissa))
    n, layers, hidden = block.shape
    out = np.zeros((layers, CHUNK_ROWS, hidden), block.dtype)
    torch_bits(out)[:, :n].copy_(torch_bits(block).transpose(0, 1))
    return out.transpose(1, 0, 2)
