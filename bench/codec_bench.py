"""Lossless bf16 codecs on a cache's own hidden states: size against raw bf16, speed per core.

    python bench/codec_bench.py --cache CACHE [--max-samples N]

Reads the cache's bf16 samples (any codec), cuts them as the zarr writer does (64 rows of one
layer, a sample's last chunk zero-padded), and for Blosc zstd-1 byte shuffle (the codec before
`planes`), `planes` (`shared.planes.planes_compress`: exponent bytes as a zstd frame) and
`planes-blosc-exp` (the same planes with the exponent bytes through Blosc zstd-1, as `planes`
caches were written before) prints the stored bytes against the raw
bf16 bytes of the real tokens, overall and per layer, and compress / decompress throughput of
one thread (raw token bytes per second), after checking every chunk decodes bit for bit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numcodecs
import numcodecs.blosc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import planes  # noqa: E402
from shared.cache import open_part  # noqa: E402
from shared.codec import CHUNK_ROWS, blosc_compressor  # noqa: E402
from shared.manifest import read_manifest  # noqa: E402
from shared.planes import planes_compress, planes_decompress  # noqa: E402


def layer_chunks(cache: Path, max_samples: int) -> tuple[list[list[np.ndarray]], int]:
    """Per layer, the writer's 64-row chunks; and the raw bf16 bytes of the real tokens."""
    manifest = read_manifest(cache)
    if manifest.store != "bf16":
        raise SystemExit(f"{cache}: store {manifest.store}, this compares bf16 codecs")
    chunks: list[list[np.ndarray]] = [[] for _ in manifest.layer_ids]
    raw, seen = 0, 0
    for rec in manifest.parts:
        reader = open_part(cache / rec.name)
        for n in range(reader.num_samples):
            if seen == max_samples:
                return chunks, raw
            h = np.asarray(reader.read(n).hidden)
            raw += h.nbytes
            seen += 1
            for k in range(h.shape[1]):
                for row in range(0, len(h), CHUNK_ROWS):
                    block = np.zeros((CHUNK_ROWS, h.shape[2]), np.uint16)
                    part = h[row : row + CHUNK_ROWS, k]
                    block[: len(part)] = part
                    chunks[k].append(block)
    return chunks, raw


def measure(chunks: list[np.ndarray], compress, decompress) -> tuple[int, float, float]:  # noqa: ANN001
    t = time.perf_counter()
    blobs = [compress(c) for c in chunks]
    enc = time.perf_counter() - t
    t = time.perf_counter()
    out = [decompress(b) for b in blobs]
    dec = time.perf_counter() - t
    for c, o in zip(chunks, out, strict=True):
        if not np.array_equal(np.frombuffer(o, np.uint16), c.reshape(-1)):
            raise SystemExit("a chunk did not decode bit for bit")
    return sum(len(b) for b in blobs), enc, dec


def planes_blosc_exponent(a: np.ndarray) -> bytes:
    """`planes` as written before its exponent frame was zstd: Blosc zstd-1 (PLANES_BLOSC)."""
    return b"".join(planes.planes_frames(a, planes.blosc_exponent_frame))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--max-samples", type=int, default=-1)
    args = p.parse_args()
    numcodecs.blosc.use_threads = False
    chunks, raw = layer_chunks(args.cache, args.max_samples)
    layers = read_manifest(args.cache).layer_ids
    codecs = {
        "blosc zstd-1 shuffle": (blosc_compressor(2), numcodecs.blosc.decompress),
        "planes": (planes_compress, lambda b: planes_decompress(b).view(np.uint8)),
        "planes-blosc-exp": (planes_blosc_exponent, lambda b: planes_decompress(b).view(np.uint8)),
    }
    per_token = raw / len(layers) / 2 / chunks[0][0].shape[1]  # tokens
    print(f"{args.cache}: {int(per_token):,} tokens, layers {list(layers)}, raw {raw / 1e6:.1f} MB")
    print(f"numcodecs {numcodecs.__version__}, one thread")
    for name, (compress, decompress) in codecs.items():
        sizes, enc, dec = [], 0.0, 0.0
        for layer in chunks:
            size, e, d = measure(layer, compress, decompress)
            sizes.append(size)
            enc, dec = enc + e, dec + d
        per_layer = ", ".join(f"{s / (raw / len(layers)):.3f}" for s in sizes)
        print(
            f"{name:22s} {sum(sizes) / raw:.4f} of raw ({sum(sizes) / per_token:,.0f} B/token; "
            f"per layer {per_layer}), compress {raw / enc / 1e9:.3f} GB/s, "
            f"decompress {raw / dec / 1e9:.3f} GB/s"
        )


if __name__ == "__main__":
    main()
