"""The cache manifest: what was extracted, from what, and which parts are complete.

`manifest.json` is the commit record of a cache. A part counts as present only when the manifest
lists it; files on disk are never trusted by themselves. Every update is a locked
read-modify-write followed by an atomic replace, so several extract processes can record parts
concurrently and a crash leaves the previous manifest intact.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.format import FORMAT_VERSION
from shared.fsio import atomic_write_json, file_lock, within
from shared.json_types import wrong_types
from shared.rows import unit_rows

MANIFEST = "manifest.json"
LAYER_CONVENTION = (
    "id i = output of target decoder layer i (0-based) = HF hidden_states[i + 1] "
    "(the last layer's after the final norm)"
)
# Said by extract and by train when the last target layer is used.
LAST_LAYER_WARNING = (
    "target layer %d is the target's last: SGLang and vLLM cannot serve a drafter that uses it "
    "(they capture the input of layer i + 1, which does not exist for it); only z-lab's `dflash` "
    "package and `python -m train.proof.speculate` feed it"
)
# Said by extract, which cannot know how the cache will use the last layer.
LAST_LAYER_NOTE = (
    "target layer %d is the target's last: the kl/tv/mix losses and DSpark read the target's "
    "distribution from it; as a drafter's input (a tap) SGLang and vLLM cannot serve it (they "
    "capture the input of layer i + 1, which does not exist for it); only z-lab's `dflash` "
    "package and `python -m train.proof.speculate` feed it"
)
MAX_LISTED_REJECTS = 200  # per part; counts stay exact, the list of rows is capped
MAX_DETAIL = 200  # characters of a rejected row's detail kept in the manifest


class CacheMismatch(ValueError):
    """A cache cannot serve the request; `problems` lists every reason at once."""

    def __init__(self, cache: Path | str, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"cache {cache} cannot be used:\n{lines}")


@dataclass(frozen=True, kw_only=True)
class TargetInfo:
    path: str
    revision: str  # content hash of config + weight files, or a hub revision
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int  # rows of the embedding matrix
    tokenizer_vocab_size: int
    # bytes sampled across the weight files (shared/target_identity.py); None: before it
    weights_sample: str | None = None


@dataclass(frozen=True, kw_only=True)
class SourceFile:
    path: str
    sha256: str
    rows: int


@dataclass(frozen=True, kw_only=True)
class RejectedRow:
    row: int
    source: str
    line: int
    reason: str
    detail: str = ""  # what exactly is wrong with it (cut at MAX_DETAIL characters)

    @classmethod
    def of(cls, r: Any) -> RejectedRow:
        """The record of a rejected row `r` (any object with these fields), its detail cut."""
        return cls(
            row=r.row, source=r.source, line=r.line, reason=r.reason, detail=r.detail[:MAX_DETAIL]
        )

    def describe(self) -> str:
        """`source:line: reason (detail)`, the row's line in a summary or an error."""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.source}:{self.line}: {self.reason}{detail}"


@dataclass(frozen=True, kw_only=True)
class PartRecord:
    """One committed work unit: source rows [first_row, end_row)."""

    name: str
    unit: int
    first_row: int
    end_row: int
    rows_kept: int
    rows_truncated: int
    rejected: dict[str, int]
    rejected_rows: tuple[RejectedRow, ...]
    tokens: int
    supervised_tokens: int
    stored_rows: int
    nbytes: int
    checksum: str
    # The codec this part was written with where it differs from the manifest's `codec`: a part
    # written on a resume by a version whose codec changed. None: the manifest's (older
    # manifests have no such key). Readers go by each chunk's own frames either way.
    codec: dict[str, Any] | None = None
    # How the target was laid out over the ranks that made this part where it was sharded
    # (`tp=2; transformers 5.24.0 ...`); None: one model per process (and no such key).
    layout: str | None = None

    def with_codec(self, codec: dict[str, Any], manifest_codec: dict[str, Any]) -> PartRecord:
        """This record, naming `codec` where it is not the manifest's."""
        return dataclasses.replace(self, codec=None if codec == manifest_codec else codec)

    @property
    def rows_read(self) -> int:
        return self.end_row - self.first_row

    @classmethod
    def committed(
        cls,
        stats: Any,
        *,
        name: str,
        unit: int,
        rows: range,
        layout: str | None = None,
        rows_truncated: int = 0,
        rejected: dict[str, int] | None = None,
        rejected_rows: tuple[RejectedRow, ...] = (),
    ) -> PartRecord:
        """The record of a part whose writer's commit returned `stats` (shared.part.PartStats)."""
        return cls(
            name=name,
            unit=unit,
            first_row=rows.start,
            end_row=rows.stop,
            rows_kept=stats.rows,
            rows_truncated=rows_truncated,
            rejected=dict(sorted((rejected or {}).items())),
            rejected_rows=rejected_rows,
            tokens=stats.tokens,
            supervised_tokens=stats.supervised_tokens,
            stored_rows=stats.stored_rows,
            nbytes=stats.nbytes,
            checksum=stats.checksum,
            layout=layout,
        )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    format_version: int = FORMAT_VERSION
    complete: bool = False
    format: str
    store: str
    codec: dict[str, Any]
    target: TargetInfo
    tokenizer_sha256: str
    chat_template_sha256: str
    layer_ids: tuple[int, ...]
    layer_convention: str = LAYER_CONVENTION
    max_length: int
    rows_per_part: int
    sources: tuple[SourceFile, ...]
    total_rows: int
    parts: tuple[PartRecord, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)
    # {file under target/: {size, checksum}}; empty in caches written before it was recorded
    # (same format version: readers treat empty as "not recorded").
    target_files: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def num_units(self) -> int:
        return -(-self.total_rows // self.rows_per_part) if self.total_rows else 0

    def unit_rows(self, unit: int) -> range:
        return unit_rows(unit, rows_per_part=self.rows_per_part, total_rows=self.total_rows)

    def done_units(self) -> set[int]:
        return {p.unit for p in self.parts}

    def committed_prefix(self) -> tuple[PartRecord, ...]:
        """The parts of units 0, 1, 2, ... up to the first unit not recorded yet: what a reader
        of a cache still being written may use, in an order that does not depend on when (or
        by which rank) each part was committed."""
        prefix: list[PartRecord] = []
        for part in sorted(self.parts, key=lambda p: p.unit):
            if part.unit != len(prefix):
                break
            prefix.append(part)
        return tuple(prefix)

    @property
    def all_recorded(self) -> bool:
        """Every work unit has its part in the manifest: nothing more will be added."""
        return self.done_units() >= set(range(self.num_units))

    def totals(self) -> dict[str, Any]:
        rejected: dict[str, int] = {}
        for p in self.parts:
            for reason, n in p.rejected.items():
                rejected[reason] = rejected.get(reason, 0) + n
        return {
            "parts": len(self.parts),
            "rows_read": sum(p.rows_read for p in self.parts),
            "rows_kept": sum(p.rows_kept for p in self.parts),
            "rows_truncated": sum(p.rows_truncated for p in self.parts),
            "rows_rejected": sum(rejected.values()),
            "rejected": dict(sorted(rejected.items())),
            "tokens": sum(p.tokens for p in self.parts),
            "supervised_tokens": sum(p.supervised_tokens for p in self.parts),
            "nbytes": sum(p.nbytes for p in self.parts),
        }

    def identity(self) -> dict[str, Any]:
        """The settings that decide the cache's content: a resume must match all of them."""
        return {
            "format_version": self.format_version,
            "format": self.format,
            "store": self.store,
            "target": self.target.revision,
            "tokenizer_sha256": self.tokenizer_sha256,
            "chat_template_sha256": self.chat_template_sha256,
            "layer_ids": list(self.layer_ids),
            "max_length": self.max_length,
            "rows_per_part": self.rows_per_part,
            "sources": [s.sha256 for s in self.sources],
            "total_rows": self.total_rows,  # --max-rows: the same files, fewer rows
        }

    def extract_command(self, cache: Path | str) -> str:
        """The `python -m extract` command that resumes this cache in `cache`: the settings that
        decide its content, from its record. It redoes exactly the parts the manifest does not
        list (as after `python -m extract.verify --repair`)."""
        args = ["python", "-m", "extract", "--out", str(cache), "--target", self.target.path]
        for source in self.sources:
            args += ["--data", source.path]
        args += ["--layers", ",".join(map(str, self.layer_ids))]
        args += ["--max-length", str(self.max_length), "--format", self.format]
        args += ["--store", self.store, "--rows-per-part", str(self.rows_per_part)]
        if self.total_rows < sum(s.rows for s in self.sources):
            args += ["--max-rows", str(self.total_rows)]
        return shlex.join(args)

    def with_part(self, record: PartRecord) -> Manifest:
        parts = [p for p in self.parts if p.unit != record.unit] + [record]
        return dataclasses.replace(self, parts=tuple(sorted(parts, key=lambda p: p.unit)))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for part in out["parts"]:  # these keys only where set: older versions of this tool
            for key in ("codec", "layout"):  # read the rest as before
                if part[key] is None:
                    del part[key]
        out["totals"] = self.totals()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Manifest:
        obj = dict(obj)
        obj.pop("totals", None)
        version = obj.get("format_version")
        if version != FORMAT_VERSION:
            raise CacheMismatch(
                "manifest", [f"format version {version!r}, this tool reads {FORMAT_VERSION}"]
            )
        wrong = wrong_types(obj, cls) + [
            f"parts[{i}].{w}"
            for i, p in enumerate(obj.get("parts", []))
            for w in wrong_types(p, PartRecord)
        ]
        if wrong:
            raise CacheMismatch("manifest", [f"{MANIFEST} is malformed: {', '.join(wrong)}"])
        parts = tuple(
            PartRecord(**{**p, "rejected_rows": tuple(map(rejected_row, p["rejected_rows"]))})
            for p in obj.pop("parts", [])
        )
        return cls(
            **{
                **obj,
                "target": TargetInfo(**obj["target"]),
                "sources": tuple(SourceFile(**s) for s in obj["sources"]),
                "layer_ids": tuple(obj["layer_ids"]),
                "parts": parts,
            }
        )


def identity_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keys in which two recorded identities differ; a key one of them lacks (a record
    written before the identity held it) is not counted.

    >>> identity_changes({"store": "bf16", "layer_ids": [1]}, {"store": "fp8", "total_rows": 9})
    ['store']
    """
    return sorted(k for k in set(old) & set(new) if old[k] != new[k])


def rejected_row(obj: dict[str, Any]) -> RejectedRow:
    """A manifest's rejected row; keys a later version adds beside these are read past (a
    row is a record for people, not for the cache's reading)."""
    known = {f.name for f in dataclasses.fields(RejectedRow)}
    return RejectedRow(**{k: v for k, v in obj.items() if k in known})


def drop_parts(manifest: Manifest, names: set[str]) -> Manifest:
    """`manifest` without the parts named `names`, and so incomplete if it drops any: the same
    extract command extracts exactly those again."""
    kept = tuple(p for p in manifest.parts if p.name not in names)
    complete = manifest.complete and len(kept) == len(manifest.parts)
    return dataclasses.replace(manifest, parts=kept, complete=complete)


def repair_commands(cache: Path | str, manifest: Manifest | None = None) -> str:
    """The commands that repair damaged parts of `cache`, as one clause: `extract.verify
    --repair` drops them from the manifest, then the extract command writes them again (the
    exact one when the manifest is at hand)."""
    again = f"`{manifest.extract_command(cache)}`" if manifest else "the extract command"
    verify = shlex.join(["python", "-m", "extract.verify", str(cache), "--repair"])
    return f"run `{verify}`, then {again} to write them again"


def manifest_path(cache: Path) -> Path:
    return Path(cache) / MANIFEST


def enclosing_cache(folder: Path | str) -> Path | None:
    """The cache (a folder with a cache's manifest) that `folder` is or lies in, if any: no
    place for a run's files."""
    folder = Path(folder).resolve()
    return next((p for p in (folder, *folder.parents) if _holds_a_cache_manifest(p)), None)


def _holds_a_cache_manifest(folder: Path) -> bool:
    """Whether `folder/manifest.json` is a cache's (not another tool's file of that name)."""
    try:
        record = json.loads(manifest_path(folder).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"format_version", "layer_ids", "parts"} <= record.keys()


def refuse_inside_cache(out: Path, data: Path) -> str | None:
    """Why `out` cannot hold a run's or a sweep's files: it is in the cache `data` or another
    one; None where it can."""
    cache = Path(data) if within(out, data) else enclosing_cache(out)
    if cache is None:
        return None
    named = "--data" if cache == Path(data) else f"it holds {MANIFEST}"
    return (
        f"--out {out} is in the cache {cache} ({named}): give a folder of its own (e.g. "
        "runs/NAME): a cache holds only what extraction wrote"
    )


def read_manifest(cache: Path) -> Manifest:
    path = manifest_path(cache)
    if not Path(cache).is_dir():
        raise CacheMismatch(cache, ["no such folder" if not Path(cache).exists() else "a file"])
    if not path.is_file():
        raise CacheMismatch(cache, [f"no {MANIFEST}: not a cache, or extraction never started"])
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheMismatch(cache, [f"{MANIFEST} is not valid JSON ({e})"]) from None
    try:
        return Manifest.from_json(obj)
    except CacheMismatch as e:
        raise CacheMismatch(cache, e.problems) from None
    except (KeyError, TypeError) as e:
        raise CacheMismatch(cache, [f"{MANIFEST} is malformed ({e})"]) from None


def write_manifest(cache: Path, manifest: Manifest) -> None:
    atomic_write_json(manifest_path(cache), manifest.to_json())


def update_manifest(cache: Path, change: Callable[[Manifest], Manifest]) -> Manifest:
    """Locked read-modify-write: safe with several processes recording parts at once."""
    with file_lock(Path(cache) / ".manifest.lock"):
        manifest = change(read_manifest(cache))
        write_manifest(cache, manifest)
    return manifest
