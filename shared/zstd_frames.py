"""zstd frames with given compression parameters, one compressor per thread and settings.

python-zstandard releases the GIL while it compresses, so N writer threads use N cores; a
compressor is not safe to share between threads. The frames carry their content size, so any
zstd reader (zarr's codec, numcodecs) sizes its output.
"""

from __future__ import annotations

import threading

import numcodecs.zstd
import numpy as np

_local = threading.local()  # {settings key: compressor} per thread


def zstd_frame(data: np.ndarray | bytes, settings: dict) -> bytes:
    """One zstd frame of `data`'s bytes (C-contiguous) with `settings`: a strategy name
    ("fast", ...) and zstd's compression parameters (window_log, hash_log, ...).

    >>> f = zstd_frame(bytes(1000), dict(strategy="fast", window_log=18, hash_log=6))
    >>> len(f) < 30, zstd_unframe(f) == bytes(1000)
    (True, True)
    """
    key = tuple(sorted(settings.items()))
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(key)
    if cctx is None:
        try:
            import zstandard
        except ImportError as e:  # a dependency of the package; named for a bare environment
            raise ImportError(
                "writing the cache needs the zstandard package: pip install zstandard"
            ) from e
        s = dict(settings)
        strategy = getattr(zstandard, f"STRATEGY_{s.pop('strategy').upper()}")
        params = zstandard.ZstdCompressionParameters(  # the content size lets any reader
            strategy=strategy, write_content_size=True, write_checksum=False, **s
        )  # size its output (every chunk is crc32c-checked by the cache)
        cctx = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return cctx.compress(data)


def zstd_unframe(frame: bytes | memoryview) -> bytes:
    """The bytes of one zstd frame (numcodecs: no python-zstandard needed to read)."""
    return numcodecs.zstd.decompress(frame)
