"""The output of `python -m extract.regen`: chunk files and the state file in
`OUT.parts/`, and OUT itself.

The state file is the commit record, like a cache's manifest: a chunk counts as done only when
the state lists it with its full row range (a `--max-rows` run may have cut the last one short)
and its file exists with the size recorded (one cut short or appended to is made again, and OUT
merged again where its size is not the chunks'). Every update is a locked read-modify-write with
an atomic replace, so several processes record chunks at once and a crash leaves the previous
state intact.

A run resumes an output only if its settings match the state's: target (content hash),
tokenizer and chat template, data files (sha256), --max-new-tokens, --max-length,
--rows-per-chunk and the compute dtype (bf16 on GPU, fp32 on CPU): they decide the answers.
--batch-size, --gpus and --max-rows may change from run to run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extract.data import Rejected
from extract.regen.config import RegenError
from shared.fsio import (
    atomic_write_bytes,
    atomic_write_json,
    file_lock,
    fsync_dir,
    remove_path,
)
from shared.lock import LOCK_FILE
from shared.rows import unit_rows

log = logging.getLogger(__name__)

STATE_VERSION = 1
STATE = "state.json"
PROGRESS_DIR = ".progress"  # per-rank counter files of the progress bar, in OUT.parts/
MAX_LISTED_REJECTS = 200  # per chunk; counts stay exact, the list of rows is capped
DISK_FULL_RERUN = "Free space there, then run the same command: the committed chunks are kept."


def parts_dir(out: Path) -> Path:
    """`OUT.jsonl.parts`: chunk files and the state file of the output `out`."""
    return Path(out).with_name(Path(out).name + ".parts")


def chunk_name(chunk: int) -> str:
    return f"chunk-{chunk:06d}.jsonl"


@dataclass(frozen=True, kw_only=True)
class ChunkRecord:
    """One committed chunk: source rows [first_row, end_row) and what became of them."""

    chunk: int
    first_row: int
    end_row: int
    kept: int
    rejected: dict[str, int]
    rejected_rows: tuple[dict[str, Any], ...]  # row, source, line, reason, detail (capped)
    turns: int  # assistant turns generated
    turns_at_limit: int  # of which stopped by --max-new-tokens, not by eos
    new_tokens: int
    turns_retokenized: int = 0  # turns extraction will read as other tokens (`turns`)
    size: int | None = None  # bytes of its file (None: recorded before sizes were)

    @property
    def name(self) -> str:
        return chunk_name(self.chunk)


@dataclass(frozen=True, kw_only=True)
class RegenState:
    """`settings` must match for a resume; `config` is the latest run's resolved options."""

    settings: dict[str, Any]
    config: dict[str, Any]
    chunks: dict[int, ChunkRecord] = field(default_factory=dict)
    merged_rows: int | None = None  # rows 0..merged_rows-1 are in OUT, None before a merge
    # The latest run's conversations that failed (--server: timeouts, server errors), by reason;
    # their chunks stay pending, so the next run requests them again.
    failed: dict[str, int] = field(default_factory=dict)
    version: int = STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        chunks = [dataclasses.asdict(self.chunks[c]) for c in sorted(self.chunks)]
        return {**dataclasses.asdict(self), "chunks": chunks}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RegenState:
        """Raises TypeError (or KeyError) where `obj` is not a state as `to_json` writes it."""
        chunks = {}
        for c in obj["chunks"]:
            record = ChunkRecord(**{**c, "rejected_rows": tuple(c["rejected_rows"])})
            if not _is_record(record):
                raise TypeError(f"chunk record {c}: a count that is no integer")
            chunks[record.chunk] = record
        if not isinstance(obj["settings"], dict) or not isinstance(obj["config"], dict):
            raise TypeError("settings or config: no object")
        if not (obj["merged_rows"] is None or type(obj["merged_rows"]) is int):
            raise TypeError(f"merged_rows: {obj['merged_rows']!r}")
        return cls(
            settings=obj["settings"],
            config=obj["config"],
            chunks=chunks,
            merged_rows=obj["merged_rows"],
            failed=obj.get("failed", {}),
            version=obj["version"],
        )

    def with_chunk(self, record: ChunkRecord) -> RegenState:
        return dataclasses.replace(self, chunks={**self.chunks, record.chunk: record})

    def totals(self, chunks: range) -> dict[str, Any]:
        """Sums over the records of `chunks` (those not recorded count nothing)."""
        records = [self.chunks[c] for c in chunks if c in self.chunks]
        rejected: dict[str, int] = {}
        for r in records:
            for reason, n in r.rejected.items():
                rejected[reason] = rejected.get(reason, 0) + n
        return {
            "chunks": len(records),
            "rows_read": sum(r.end_row - r.first_row for r in records),
            "rows_kept": sum(r.kept for r in records),
            "rows_rejected": sum(rejected.values()),
            "rejected": dict(sorted(rejected.items())),
            "rejected_rows": [row for r in records for row in r.rejected_rows],
            "turns": sum(r.turns for r in records),
            "turns_at_limit": sum(r.turns_at_limit for r in records),
            "new_tokens": sum(r.new_tokens for r in records),
            "turns_retokenized": sum(r.turns_retokenized for r in records),
        }


def _is_record(record: ChunkRecord) -> bool:
    """Whether the record's counts are integers (its size: or None), as `to_json` writes them."""
    counts = dataclasses.asdict(record)
    size, rejected = counts.pop("size"), counts.pop("rejected")
    del counts["rejected_rows"]
    return all(type(n) is int for n in [*counts.values(), *dict(rejected).values()]) and (
        size is None or type(size) is int
    )


class StateError(ValueError):
    """The state file is missing or unreadable."""


def read_state(parts: Path) -> RegenState:
    path = Path(parts) / STATE
    try:
        obj = json.loads(path.read_text())
        if obj.get("version") != STATE_VERSION:
            raise StateError(f"{path}: state version {obj.get('version')}, not {STATE_VERSION}")
        return RegenState.from_json(obj)
    except FileNotFoundError:
        raise StateError(f"{path}: no state file") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise StateError(f"{path}: malformed state file ({e})") from None


def write_state(parts: Path, state: RegenState) -> None:
    atomic_write_json(Path(parts) / STATE, state.to_json())


def update_state(parts: Path, change: Callable[[RegenState], RegenState]) -> RegenState:
    """Locked read-modify-write: safe with several processes recording chunks at once."""
    with file_lock(Path(parts) / ".state.lock"):
        state = change(read_state(parts))
        write_state(parts, state)
    return state


def settings_mismatches(old: dict, new: dict, unknown: Collection[str] = ()) -> list[str]:
    """Human-readable differences between two runs' settings, but for the keys `unknown`."""
    keys = [k for k in dict.fromkeys([*old, *new]) if k not in unknown]
    return [
        f"{k}: output has {old.get(k)!r}, requested {new.get(k)!r}"
        for k in keys
        if old.get(k) != new.get(k)
    ]


def existing_state(
    out: Path, settings: dict[str, Any], *, overwrite: bool, unknown: Collection[str] = ()
) -> RegenState | None:
    """The state to resume, None for a fresh start; raises if OUT holds something else.
    `unknown`: keys of `settings` not known yet (a server's), left out of the comparison."""
    parts = parts_dir(out)
    if (parts / STATE).is_file():
        try:
            state = read_state(parts)
        except StateError as e:
            if overwrite:
                return None
            raise RegenError(
                f"--out {out}: {e}, so its chunks cannot be resumed; --overwrite to start it "
                "again, or another --out"
            ) from None
        problems = settings_mismatches(state.settings, settings, unknown)
        if not problems:
            return state
    elif out.exists() or (parts.exists() and any(p.name != LOCK_FILE for p in parts.iterdir())):
        raise RegenError(  # --overwrite replaces only this command's own output
            f"--out {out}: it or {parts} exists without {STATE}, so this command did not write "
            "it; give another --out, or move it away"
        )
    else:
        return None
    if overwrite:
        return None
    lines = "\n".join(f"  - {p}" for p in problems)
    raise RegenError(
        f"--out {out} holds another regeneration:\n{lines}\n"
        "Use the same settings to resume it, another --out, or --overwrite to replace it."
    )


def init_output(
    out: Path, settings: dict[str, Any], config: dict[str, Any], resume: RegenState | None
) -> RegenState:
    """Start a fresh state (deleting any old output) or record this run's options in `resume`."""
    parts = parts_dir(out)
    if resume is None:
        parts.mkdir(parents=True, exist_ok=True)
        for old in parts.iterdir():  # all but the lock this run holds (`shared.lock`)
            if old.name not in (LOCK_FILE, STATE):
                remove_path(old)
        out.unlink(missing_ok=True)  # an output never outlives its state
        # The old state, which marks the folder as this command's, is replaced last: a removal
        # that fails part-way (a file that cannot be removed) leaves what --overwrite replaces.
        write_state(parts, RegenState(settings=settings, config=config))
    else:
        update_state(parts, lambda s: dataclasses.replace(s, config=config, failed={}))
    shutil.rmtree(parts / PROGRESS_DIR, ignore_errors=True)
    for leftover in [*parts.glob(".*.tmp.*"), *out.parent.glob(f".{out.name}.tmp.*")]:
        leftover.unlink(missing_ok=True)  # an atomic write cut short by a crash
    return read_state(parts)


def pending_chunks(
    state: RegenState, parts: Path, *, rows_per_chunk: int, total_rows: int
) -> tuple[int, ...]:
    """Chunks of rows 0..total_rows-1 that are not done (see the module docstring); a chunk
    file of another size than recorded (cut short, appended to) is not done either."""

    def done(chunk: int) -> bool:
        record = state.chunks.get(chunk)
        rows = unit_rows(chunk, rows_per_part=rows_per_chunk, total_rows=total_rows)
        if record is None or (record.first_row, record.end_row) != (rows.start, rows.stop):
            return False
        path = parts / record.name
        if not path.is_file():
            return False
        if record.size is not None and path.stat().st_size != record.size:
            log.warning(
                "%s: %d bytes, %d when committed: generated again",
                path,
                path.stat().st_size,
                record.size,
            )
            return False
        return True

    num_chunks = -(-total_rows // rows_per_chunk)
    return tuple(c for c in range(num_chunks) if not done(c))


@dataclass
class ChunkResult:
    """What regenerating one chunk gave: output rows and rejected rows, in row order."""

    rows: list[dict[str, Any]]
    rejected: list[Rejected]
    turns: int = 0
    turns_at_limit: int = 0
    new_tokens: int = 0
    turns_retokenized: int = 0


def commit_chunk(parts: Path, chunk: int, rows: range, result: ChunkResult) -> ChunkRecord:
    """Write the chunk's output rows atomically, then record it (its rejected rows listed,
    capped): only then is it done."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rows).encode()
    atomic_write_bytes(parts / chunk_name(chunk), data)
    reasons: dict[str, int] = {}
    for r in result.rejected:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    record = ChunkRecord(
        chunk=chunk,
        first_row=rows.start,
        end_row=rows.stop,
        kept=len(result.rows),
        rejected=dict(sorted(reasons.items())),
        rejected_rows=tuple(dataclasses.asdict(r) for r in result.rejected[:MAX_LISTED_REJECTS]),
        turns=result.turns,
        turns_at_limit=result.turns_at_limit,
        new_tokens=result.new_tokens,
        turns_retokenized=result.turns_retokenized,
        size=len(data),
    )
    update_state(parts, lambda s: s.with_chunk(record))
    log.info(
        "committed %s: %d rows kept, %d rejected, %d turns (%d at --max-new-tokens), %d tokens",
        record.name,
        record.kept,
        len(result.rejected),
        record.turns,
        record.turns_at_limit,
        record.new_tokens,
    )
    return record


def merge_chunks(out: Path, parts: Path, num_chunks: int) -> None:
    """OUT = chunk files 0..num_chunks-1 concatenated (row order), replaced atomically."""
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in range(num_chunks):
                with open(parts / chunk_name(chunk), "rb") as src:
                    shutil.copyfileobj(src, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:  # a full disk, a signal: no partial copy left taking its space
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
