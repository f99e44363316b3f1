"""Codec settings and value transforms of the hidden-state cache (format version 1).

Everything here is independent of the container (zarr folder or webdataset tar): the Blosc
settings (those of the bf16 `planes` codec too; its code: ``shared/planes.py``), the bf16 <->
uint16 views, the fp8 e4m3 quantisation with one scale per token per layer (checksums:
``shared/checksum.py``).

Blosc threading: we compress from our own writer threads (and zarr from its worker pool), so
Blosc's internal threads stay off. With ``use_threads = False`` numcodecs calls
``blosc_compress_ctx`` with one internal thread and releases the GIL around it, so N Python
threads compress on N cores (measured in ``shared/cache.py``). zarr sets the same flag when it
is imported; we set it here too so the webdataset path does not depend on import order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numcodecs.blosc
import numpy as np
import torch
from numcodecs import Blosc

from shared.format import FORMAT_VERSION, FORMATS, STORES  # noqa: F401 (the format's names)
from shared.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: F401  (the fp8 store)
from shared.int4 import Int4Scheme, encode_int4
from shared.int4_frames import INT4_FRAMES, INT4_ZSTD

# Each sample's first row in a zarr part is a multiple of this; also the row extent of a chunk.
CHUNK_ROWS = 64
# Measured on synthetic bf16 activations (DESIGN.md section 3): zstd-1 with byte shuffle beats
# bitshuffle, lz4 and an automatic blocksize. typesize is 1 for fp8 payloads.
BLOSC = dict(cname="zstd", clevel=1, shuffle="shuffle", typesize=2, blocksize=1 << 20)
# bf16 payloads: "planes" (`shared.planes`: the exponent bytes apart from sign+mantissa;
# `bench/codec_bench.py` on SmolLM2-135M-Instruct's states of 240 shipped chats: 0.680 of raw
# bf16 against 0.787 for Blosc's byte shuffle); "blosc" for caches written before it (their
# parts say so, and read as before).
BF16_CODEC = "planes"
PLANES_LAYOUT = (
    "u32le exponent-frame size, exponent frame (zstd; Blosc in caches written before zstd), "
    "sign+mantissa frame (Blosc)"
)
# The exponent bytes: a plain zstd frame of zstd's fast strategy with a 64-entry hash table and
# 7-byte matches, so that it codes the bytes nearly as literals (Huffman: about 2.5 bits a byte on
# real activations) and finds only the long runs (the zero rows that align samples). Against
# zstd-1 through Blosc, on SmolLM2's real states and on random ones (`python
# bench/codec_bench.py --cache C`, "planes" against "planes-blosc-exp"): smaller and over twice
# as fast to write, faster to read; the compression is most of a writer thread's work.
PLANES_EXPONENT_ZSTD = dict(
    strategy="fast", window_log=18, hash_log=6, chain_log=6, search_log=1, min_match=7
)
# Per plane (bench/codec_bench.py, real activations): sign+mantissa bytes are noise that no
# entropy coder shrinks (zstd-1 gives the size lz4 does, at a quarter of its speed): lz4 only
# squeezes the zero rows that align samples. The exponent settings are those of caches written
# before zstd (read as ever; bench/codec_bench.py compares them).
PLANES_BLOSC = {
    "exponent": dict(cname="zstd", clevel=1, shuffle="noshuffle", typesize=1, blocksize=1 << 20),
    "sign_mantissa": dict(
        cname="lz4", clevel=1, shuffle="noshuffle", typesize=1, blocksize=1 << 20
    ),
}
# A zstd frame's first four bytes; a Blosc frame starts with its format version (2).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

numcodecs.blosc.use_threads = False
numcodecs.blosc.set_nthreads(1)

_SHUFFLE_IDS = {
    "noshuffle": Blosc.NOSHUFFLE,
    "shuffle": Blosc.SHUFFLE,
    "bitshuffle": Blosc.BITSHUFFLE,
}


@dataclass(frozen=True)
class Bf16Planes:
    """A bf16 payload already split into the two byte planes of the `planes` codec (uint8
    arrays or tensors of one shape; `shared.planes.split_planes` makes them, on the device):
    the writers then only compress, with no pass over the values on the host."""

    exponent: np.ndarray | torch.Tensor
    sign_mantissa: np.ndarray | torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.exponent.shape)

    def __len__(self) -> int:
        return len(self.exponent)

    def __getitem__(self, index) -> Bf16Planes:  # noqa: ANN001
        return Bf16Planes(self.exponent[index], self.sign_mantissa[index])


HiddenInput = (
    torch.Tensor | Bf16Planes | tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray]
)


def check_store(store: str) -> None:
    """Raise ValueError unless ``store`` is one of STORES."""
    if store not in STORES:
        raise ValueError(f"store must be one of {STORES}, got {store!r}")


def check_format(fmt: str) -> None:
    """Raise ValueError unless ``fmt`` is one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def payload_dtype(store: str) -> np.dtype:
    """numpy dtype of the stored hidden payload: bf16 bit patterns, or bytes (e4m3 bits, int4
    records)."""
    check_store(store)
    return np.dtype(np.uint16) if store == "bf16" else np.dtype(np.uint8)


def payload_width(store: str, hidden_size: int) -> int:
    """The payload's last dimension: the hidden size, or an int4 record's bytes.

    >>> payload_width("fp8", 576), payload_width("int4", 576)
    (576, 580)
    """
    check_store(store)
    return Int4Scheme(hidden=hidden_size).width if store == "int4" else hidden_size


def blosc_settings(typesize: int) -> dict:
    """BLOSC with the given typesize (2 for bf16 payloads, 1 for fp8, the itemsize otherwise)."""
    return {**BLOSC, "typesize": int(typesize)}


def numcodecs_blosc(typesize: int) -> Blosc:
    """A numcodecs Blosc codec with the cache settings (used by the webdataset format)."""
    s = blosc_settings(typesize)
    return Blosc(
        cname=s["cname"],
        clevel=s["clevel"],
        shuffle=_SHUFFLE_IDS[s["shuffle"]],
        blocksize=s["blocksize"],
        typesize=s["typesize"],
    )


def blosc_compressor(typesize: int) -> Callable[[np.ndarray], bytes]:
    """A function compressing a C-contiguous array exactly as `numcodecs_blosc(typesize).encode`
    does (same bytes), calling numcodecs' compress directly: the writer threads run it per
    64-row layer chunk, and `encode`'s argument checks are Python time under the GIL."""
    s = blosc_settings(typesize)
    cname, clevel, shuffle = s["cname"].encode(), s["clevel"], _SHUFFLE_IDS[s["shuffle"]]
    blocksize, size = s["blocksize"], s["typesize"]

    def compress(a: np.ndarray) -> bytes:
        return numcodecs.blosc.compress(a, cname, clevel, shuffle, blocksize, size)

    return compress


def hidden_codec(store: str) -> str:
    """The codec the writers use for a store's hidden payload (readers take what a part says)."""
    check_store(store)
    return {"bf16": BF16_CODEC, "fp8": "blosc", "int4": "int4"}[store]


def codec_description(store: str) -> dict:
    """What the manifest records about the stored values and their codec."""
    ptype = payload_dtype(store)
    if hidden_codec(store) == "planes":
        compressor = {
            "id": "planes",
            "layout": PLANES_LAYOUT,
            "planes": {
                "exponent": {"id": "zstd", **PLANES_EXPONENT_ZSTD},
                "sign_mantissa": {"id": "blosc", **PLANES_BLOSC["sign_mantissa"]},
            },
        }
    elif store == "int4":
        compressor = {"id": "int4", "layout": INT4_FRAMES, "zstd": INT4_ZSTD}
    else:
        compressor = {"id": "blosc", **blosc_settings(ptype.itemsize)}
    meaning = {
        "bf16": "bfloat16 bits",
        "fp8": "float8_e4m3fn bits",
        "int4": "int4 records of H + 4 bytes (shared.int4), H the target's hidden size",
    }
    out = {
        "format_version": FORMAT_VERSION,
        "store": store,
        "hidden_dtype": str(ptype),
        "hidden_meaning": meaning[store],
        "scale": "float32 per token per layer, amax/448" if store == "fp8" else None,
        "compressor": compressor,
        "checksum": "crc32c",
        "chunk_rows": CHUNK_ROWS,
    }
    if store == "int4":  # the scheme's parameters (each part records its own, with H)
        out["int4"] = {k: v for k, v in Int4Scheme(hidden=64).to_dict().items() if k != "hidden"}
    return out


def bf16_to_u16(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a bf16 tensor, as a C-contiguous numpy view of its CPU copy."""
    return _bf16_bits(t.contiguous())


def u16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """Reinterpret uint16 bit patterns as a bf16 tensor sharing the array's memory."""
    if a.dtype != np.uint16:
        raise TypeError(f"expected a uint16 array, got {a.dtype}")
    return torch.from_numpy(np.ascontiguousarray(a)).view(torch.bfloat16)


def encode_hidden(
    hidden: HiddenInput, store: str, shape: tuple[int, int, int]
) -> tuple[np.ndarray | Bf16Planes, np.ndarray | None]:
    """The stored payload of one sample: (uint16 or uint8 [L, K, H], float32 scale [L, K] or None;
    int4: uint8 records [L, K, H + 4] and None). ``shape`` is (L, K, H).

    The payload keeps the input's strides (a layer-major [L, K, H] view stays one, see
    `extract.capture.LayerCapture`); writers that need C order call `c_contiguous`.

    bf16 takes a bf16 tensor or its planes (`Bf16Planes`, from `shared.planes.split_planes`:
    the payload is then a `Bf16Planes` of numpy uint8 [L, K, H]); fp8 takes a bf16/float tensor
    (quantised here, on its device) or an already quantised ``(q uint8 [L, K, H], scale float32
    [L, K])``; int4 takes a bf16/float tensor (encoded here, on its device: `shared.int4`) or its
    records (uint8 [L, K, H + 4]).
    """
    if store == "int4":
        return _int4_payload(hidden, shape), None
    if isinstance(hidden, Bf16Planes):
        if store != "bf16":
            raise TypeError("bf16 planes are only accepted by store 'bf16'")
        planes = Bf16Planes(*(host_array(x) for x in (hidden.exponent, hidden.sign_mantissa)))
        for name, x in (("exponent", planes.exponent), ("sign_mantissa", planes.sign_mantissa)):
            if x.shape != shape or x.dtype != np.uint8:
                raise ValueError(f"{name} plane must be uint8 {shape}, got {x.dtype} {x.shape}")
        return planes, None
    if isinstance(hidden, tuple):
        if store != "fp8":
            raise TypeError("a (q, scale) tuple is only accepted by store 'fp8'")
        q, scale = (host_array(x) for x in hidden)
    elif store == "fp8":
        q, scale = (x.cpu().numpy() for x in quantize_fp8(hidden))
    elif isinstance(hidden, torch.Tensor):
        q, scale = _bf16_bits(hidden), None
    else:
        raise TypeError(f"store 'bf16' takes a bfloat16 tensor, got {type(hidden).__name__}")
    if q.shape != shape or q.dtype != payload_dtype(store):
        raise ValueError(f"hidden must be {payload_dtype(store)} {shape}, got {q.dtype} {q.shape}")
    if scale is not None:
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        if scale.shape != shape[:2]:
            raise ValueError(f"scale must be float32 {shape[:2]}, got {scale.shape}")
    return q, scale


def _int4_payload(hidden: HiddenInput, shape: tuple[int, int, int]) -> np.ndarray:
    scheme = Int4Scheme(hidden=shape[2])
    if isinstance(hidden, torch.Tensor) and hidden.is_floating_point():
        hidden = encode_int4(hidden, scheme)
    if not isinstance(hidden, torch.Tensor | np.ndarray):
        raise TypeError(f"store 'int4' takes states or their records, got {type(hidden).__name__}")
    records = host_array(hidden)
    want = (*shape[:2], scheme.width)
    if records.shape != want or records.dtype != np.uint8:
        raise ValueError(f"int4 records must be uint8 {want}, got {records.dtype} {records.shape}")
    return records


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    """The uint16 bit patterns of a bf16 tensor as a numpy view with the tensor's strides (no
    copy on the CPU)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.detach().cpu().view(torch.uint16).numpy()


# Same-size dtypes torch copies natively (it has no uint16 copy on every version we support).
_COPY_AS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def torch_bits(a: np.ndarray) -> torch.Tensor | None:
    """A torch view (same memory, same strides) of `a`'s bits as a same-size integer dtype, for
    copies that release the GIL (numpy's strided copy holds it); None for other item sizes."""
    as_int = _COPY_AS.get(a.dtype.itemsize)
    return None if as_int is None else torch.from_numpy(a.view(as_int))


def c_contiguous(a: np.ndarray) -> np.ndarray:
    """`a` as a C-contiguous array: itself when it is one, else a copy made by torch. numpy's
    strided copy holds the GIL for its whole length (a layer-major sample of an 8B target is
    tens of MB), which stalls the thread that launches the forward pass; torch's does not."""
    if a.flags.c_contiguous:
        return a
    bits = torch_bits(a)
    if bits is None:
        return np.ascontiguousarray(a)
    return bits.contiguous().numpy().view(a.dtype)


def host_array(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """A numpy view of a (CPU copy of a) tensor, or the array itself."""
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def token_array(x: torch.Tensor | np.ndarray, dtype: type, length: int, name: str) -> np.ndarray:
    """A per-token input (tensor, array or list) as a numpy array of ``dtype`` and ``length``."""
    a = host_array(x)
    if a.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {a.shape}")
    return a.astype(dtype, copy=False)
