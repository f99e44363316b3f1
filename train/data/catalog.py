"""The catalog of a cache's parts for training: each committed part's path and sample lengths,
and every way a part cannot serve (it does not open, or holds other than the manifest says)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.cache import open_part
from shared.manifest import Manifest, PartRecord
from shared.part import PartReader


@dataclass(frozen=True)
class PartInfo:
    path: str
    lengths: tuple[int, ...]


def load_catalog(
    cache: Path, manifest: Manifest, records: Sequence[PartRecord] | None = None
) -> tuple[list[PartInfo], list[str]]:
    """The path and sample lengths of every committed part (or of `records`), plus problems
    found opening them."""
    parts, problems = [], []
    expect_layers, expect_hidden = len(manifest.layer_ids), manifest.target.hidden_size
    for record in manifest.parts if records is None else records:
        path = Path(cache) / record.name
        try:
            reader = open_part(path)
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"part {record.name} cannot be opened ({e})")
            continue
        found = (reader.store, reader.num_layers, reader.hidden_size)
        if found != (manifest.store, expect_layers, expect_hidden):
            problems.append(
                f"part {record.name} holds store {found[0]}, {found[1]} layers, hidden "
                f"{found[2]}; the manifest says {manifest.store}, {expect_layers}, {expect_hidden}"
            )
            continue
        if problem := scheme_problem(reader, record, manifest):
            problems.append(f"part {record.name}: {problem}")
            continue
        parts.append(PartInfo(str(path), tuple(int(n) for n in reader.lengths)))
    return parts, problems


def scheme_problem(reader: PartReader, record: PartRecord, manifest: Manifest) -> str | None:
    """How an int4 part's own record of its scheme differs from the manifest's (the part's
    attributes are outside its checksum's reach at reading: a changed seed decodes other
    states without an error); None when they agree, or nothing is recorded to compare."""
    if reader.scheme is None:
        return None
    want = (record.codec or manifest.codec).get("int4")
    found = {k: v for k, v in reader.scheme.to_dict().items() if k != "hidden"}
    if want is None or found == want:
        return None
    return f"its int4 scheme {found} is not the manifest's {want}: the part is damaged"
