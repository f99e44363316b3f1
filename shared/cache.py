"""The cache's parts, one entry point for both formats: open a writer, open a reader, verify.

A part is one work unit's samples, packed without padding: a zarr folder (``shared/zarr_part.py``)
or a webdataset tar (``shared/wds.py``), both built on the classes of ``shared/part.py``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

from shared.checksum import part_checksum, tree_file_sizes
from shared.codec import check_format, check_store
from shared.diskqueue import DiskQueue
from shared.fsio import remove_path
from shared.part import (  # noqa: F401  (re-exported: the cache's public names)
    PartReader,
    PartStats,
    PartWriter,
    Sample,
    aligned_offsets,
    layout_problems,
    part_name,
)
from shared.wds import WdsPartReader, WdsPartWriter, verify_wds
from shared.zarr_part import ZarrPartReader, ZarrPartWriter, verify_zarr

log = logging.getLogger(__name__)

# Names written by extract: the manifest and its lock, the resolved config, the parts (zarr
# folders or wds tars) with their `.tmp`/`.old` forms, `target/` with its `.tmp`/`.old` forms,
# progress counters, the output lock, and the temporary files of atomic writes (`.NAME.tmp.*`).
_OWN = re.compile(
    r"^(manifest\.json|\.manifest\.lock|extract_config\.json|\.progress|\.lock"
    r"|\.lock\.[^/]+"
    r"|part-\d{6}(\.tar)?(\.tmp|\.old)?"
    r"|target(\.tmp|\.old)?"
    r"|\.(manifest|extract_config)\.json\.tmp\.[\d.]+)$"
)


def open_part_writer(
    out_dir: Path,
    part_id: int,
    *,
    fmt: str,
    store: str,
    num_layers: int,
    hidden_size: int,
    lengths: Sequence[int],
    io: DiskQueue | None = None,
) -> PartWriter:
    """Start writing part ``part_id`` under ``out_dir``; a ``.tmp`` left by a crash is removed.
    ``io``: a queue for the zarr format's shard file writes (see `shared.diskqueue`)."""
    check_format(fmt)
    check_store(store)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / part_name(part_id, fmt)
    leftover = final.with_name(final.name + ".tmp")
    if leftover.exists():
        log.warning("removing %s left by an interrupted writer", leftover)
        remove_path(leftover)
    kw = dict(store=store, num_layers=num_layers, hidden_size=hidden_size, lengths=lengths, io=io)
    if fmt == "zarr":
        return ZarrPartWriter(final, **kw)
    return WdsPartWriter(final, **kw)


def open_part(path: Path) -> PartReader:
    """Open a part: a zarr folder or a webdataset ``.tar``."""
    path = Path(path)
    if path.is_dir():
        return ZarrPartReader(path)
    if path.suffix == ".tar" and path.is_file():
        return WdsPartReader(path)
    raise FileNotFoundError(f"{path}: not a part folder or .tar file")


def verify_part(path: Path, expected_checksum: str | None = None, *, threads: int = 1) -> list[str]:
    """Problems found in a part (empty if fine): checksum, decodability of every chunk or
    member (crc32c), layout consistency; a zarr part's chunks are checked on `threads`
    threads."""
    path = Path(path)
    if not path.exists():
        return [f"{path}: missing"]
    problems = []
    if expected_checksum is not None:
        actual = part_checksum(path)
        if actual != expected_checksum:
            problems.append(f"checksum {actual} != expected {expected_checksum}")
    if path.is_dir():
        problems += verify_zarr(path, threads=threads)
    else:
        problems += verify_wds(path)
    return problems


def part_size(path: Path) -> int | None:
    """Bytes of a part on disk as its writer records them (`PartStats.nbytes`); None if missing."""
    path = Path(path)
    if path.is_dir():
        return sum(tree_file_sizes(path).values())
    return path.stat().st_size if path.is_file() else None


def missing_or_resized(cache: Path, records: Sequence) -> list[str]:
    """Problems of listed parts that are cheap to see (no read): missing, or another size."""
    problems = []
    for rec in records:
        size = part_size(Path(cache) / rec.name)
        if size is None:
            problems.append(f"{rec.name}: listed in the manifest but missing on disk")
        elif size != rec.nbytes:
            problems.append(f"{rec.name}: {size} bytes on disk, the manifest says {rec.nbytes}")
    return problems


def is_own_entry(name: str) -> bool:
    """True for a name extraction writes into a cache folder."""
    return bool(_OWN.match(name))
