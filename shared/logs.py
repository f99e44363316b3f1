"""Logging set-up: stdlib logging, rank 0 at INFO by default, other ranks at WARNING."""

from __future__ import annotations

import logging
import sys


def setup_logging(rank: int = 0, *, verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if rank != 0 and not verbose:
        level = logging.WARNING
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if rank != 0:
        fmt = f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for noisy in ("urllib3", "filelock", "asyncio", "numcodecs", "zarr"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
