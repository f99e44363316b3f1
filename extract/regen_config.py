"""The inputs and outputs of `python -m extract.regenerate`, everything but the model.

Options (`RegenConfig`), source rows (`iter_chats`), and the output: chunk files and the state
file in `OUT.parts/`, and OUT itself. The state file is the commit record, like a cache's
manifest: a chunk counts as done only when the state lists it with its full row range (a
`--max-rows` run may have cut the last one short) and its file exists. Every update is a locked
read-modify-write with an atomic replace, so several processes record chunks at once and a
crash leaves the previous state intact.

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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from extract.data import Rejected, RowError, RowIndex, parse_row, raw_rows
from shared.cli import option
from shared.fsio import atomic_write_json, atomic_write_text, file_lock, fsync_dir
from shared.progress import read_counters

log = logging.getLogger(__name__)

STATE_VERSION = 1
STATE = "state.json"
PROGRESS_DIR = ".progress"  # per-rank counter files of the progress bar, in OUT.parts/
MAX_LISTED_REJECTS = 200  # per chunk; counts stay exact, the list of rows is capped
REGEN_REJECT_REASONS = (
    "malformed_json",  # not valid UTF-8 JSON
    "unknown_schema",  # JSON, but neither `messages` nor `conversations` (or a bad message)
    "pretokenized",  # `input_ids` rows hold no text to regenerate
    "no_assistant_turn",  # nothing to regenerate
    "empty",  # no messages, or a prompt that renders to no tokens
    "template_error",  # the chat template failed on a prompt
    "too_long",  # a turn's prompt plus --max-new-tokens exceeds --max-length
)


@dataclass(frozen=True, kw_only=True)
class RegenConfig:
    target: str = option(help="Target model: a local Hugging Face folder.")
    data: tuple[Path, ...] = option(
        help="Input JSONL file(s): OpenAI `messages` or ShareGPT `conversations` rows. "
        "Several files: repeat --data, or list them after it."
    )
    out: Path = option(
        help="Output JSONL of OpenAI `messages` rows; OUT.parts/ holds chunks and resume state."
    )
    gpus: str | None = option(
        None, help="Devices: 0-4, 0,2,5, cpu or cpu:N. Default: all visible GPUs, else cpu."
    )
    max_new_tokens: int = option(512, help="Longest generated assistant turn, in tokens.")
    max_length: int | None = option(
        None,
        help="Reject a conversation when a turn's prompt plus --max-new-tokens exceeds this "
        "many tokens. Default: the target's max_position_embeddings.",
    )
    batch_size: int = option(32, help="Conversations generated together on one device.")
    rows_per_chunk: int = option(256, help="Source rows per chunk (the unit of work and resume).")
    max_rows: int | None = option(None, help="Only the first N source rows (quick runs).")
    overwrite: bool = option(
        False, help="Replace an existing output that was made with other settings."
    )
    verbose: bool = option(False, help="Debug logging on every rank.")

    def __post_init__(self) -> None:
        checks = {
            "max_new_tokens": self.max_new_tokens >= 1,
            "max_length": self.max_length is None or self.max_length >= 2,
            "batch_size": self.batch_size >= 1,
            "rows_per_chunk": self.rows_per_chunk >= 1,
            "max_rows": self.max_rows is None or self.max_rows >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')}: {getattr(self, name)} is too small")
        if not self.data:
            raise ValueError("--data: give at least one JSONL file")


class RegenError(ValueError):
    """A problem with the request, found before any work; the message says what to do."""


@dataclass(frozen=True)
class Chat:
    row: int
    source: str
    line: int
    messages: list[dict[str, Any]]


def parse_chat(raw: bytes) -> list[dict[str, Any]]:
    """The OpenAI-style messages of one JSONL row (ShareGPT converted); raises `RowError`."""
    parsed = parse_row(raw)
    if isinstance(parsed, dict):
        raise RowError("pretokenized", "a pre-tokenized row holds no text to regenerate")
    return parsed


def iter_chats(
    files: Sequence[Path], rows: range, index: RowIndex | None = None
) -> Iterator[Chat | Rejected]:
    """One `Chat` or `Rejected` per row of `rows`, in row order (rows as in `iter_rows`)."""
    for row, source, line, raw in raw_rows(files, rows.start, rows.stop, index):
        try:
            yield Chat(row, source, line, parse_chat(raw))
        except RowError as e:
            yield Rejected(row, source, line, e.reason, e.detail)


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
    version: int = STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        chunks = [dataclasses.asdict(self.chunks[c]) for c in sorted(self.chunks)]
        return {**dataclasses.asdict(self), "chunks": chunks}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RegenState:
        chunks = {}
        for c in obj["chunks"]:
            record = ChunkRecord(**{**c, "rejected_rows": tuple(c["rejected_rows"])})
            chunks[record.chunk] = record
        return cls(
            settings=obj["settings"],
            config=obj["config"],
            chunks=chunks,
            merged_rows=obj["merged_rows"],
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
        }


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
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise StateError(f"{path}: malformed state file ({e})") from None


def write_state(parts: Path, state: RegenState) -> None:
    atomic_write_json(Path(parts) / STATE, state.to_json())


def update_state(parts: Path, change: Callable[[RegenState], RegenState]) -> RegenState:
    """Locked read-modify-write: safe with several processes recording chunks at once."""
    with file_lock(Path(parts) / ".state.lock"):
        state = change(read_state(parts))
        write_state(parts, state)
    return state


def settings_mismatches(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two runs' settings."""
    keys = list(dict.fromkeys([*old, *new]))
    return [
        f"{k}: output has {old.get(k)!r}, requested {new.get(k)!r}"
        for k in keys
        if old.get(k) != new.get(k)
    ]


def chunk_rows(chunk: int, *, rows_per_chunk: int, total_rows: int) -> range:
    first = chunk * rows_per_chunk
    return range(first, min(first + rows_per_chunk, total_rows))


def existing_state(out: Path, settings: dict[str, Any], *, overwrite: bool) -> RegenState | None:
    """The state to resume, None for a fresh start; raises if OUT holds something else."""
    parts = parts_dir(out)
    if (parts / STATE).is_file():
        try:
            state = read_state(parts)
        except StateError as e:
            problems = [str(e)]
        else:
            problems = settings_mismatches(state.settings, settings)
            if not problems:
                return state
    elif out.exists() or (parts.exists() and any(parts.iterdir())):
        problems = [f"{out} or {parts} exists without {STATE}: not made by this command"]
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
        shutil.rmtree(parts, ignore_errors=True)
        out.unlink(missing_ok=True)  # an output never outlives its state
        parts.mkdir(parents=True)
        write_state(parts, RegenState(settings=settings, config=config))
    else:
        update_state(parts, lambda s: dataclasses.replace(s, config=config))
    shutil.rmtree(parts / PROGRESS_DIR, ignore_errors=True)
    for leftover in [*parts.glob(".*.tmp.*"), *out.parent.glob(f".{out.name}.tmp.*")]:
        leftover.unlink(missing_ok=True)  # an atomic write cut short by a crash
    return read_state(parts)


def pending_chunks(
    state: RegenState, parts: Path, *, rows_per_chunk: int, total_rows: int
) -> tuple[int, ...]:
    """Chunks of rows 0..total_rows-1 that are not done (see the module docstring)."""

    def done(chunk: int) -> bool:
        record = state.chunks.get(chunk)
        rows = chunk_rows(chunk, rows_per_chunk=rows_per_chunk, total_rows=total_rows)
        if record is None or (record.first_row, record.end_row) != (rows.start, rows.stop):
            return False
        return (parts / record.name).is_file()

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


def commit_chunk(parts: Path, chunk: int, rows: range, result: ChunkResult) -> ChunkRecord:
    """Write the chunk's output rows atomically, then record it (its rejected rows listed,
    capped): only then is it done."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in result.rows)
    atomic_write_text(parts / chunk_name(chunk), text)
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
    with open(tmp, "wb") as f:
        for chunk in range(num_chunks):
            with open(parts / chunk_name(chunk), "rb") as src:
                shutil.copyfileobj(src, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    fsync_dir(out.parent)


class RowBar:
    """tqdm over rows, summed from every rank's counter file (`shared.progress`)."""

    def __init__(self, folder: Path, *, total: int):
        self.folder, self.start = folder, time.monotonic()
        self.bar = tqdm(total=total, desc="regenerate", unit="rows", dynamic_ncols=True)

    def refresh(self) -> None:
        counts = read_counters(self.folder)
        self.bar.n = int(counts.get("rows", 0))
        rate = counts.get("new_tokens", 0) / max(time.monotonic() - self.start, 1e-6)
        self.bar.set_postfix_str(f"{rate:,.0f} new tok/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.refresh()
        self.bar.close()


def format_summary(state: RegenState, *, out: Path, seconds: float, listed: int = 5) -> str:
    """The table printed at the end of a run: totals, and the first bad lines of each reason."""
    total = state.config["total_rows"]
    t = state.totals(range(-(-total // state.config["rows_per_chunk"])))
    merged = state.merged_rows == total
    rows = [
        ("output", f"{out} ({t['rows_kept']:,} rows)" if merged else f"{out} (not written)"),
        ("target", state.config["target"]),
        ("rows read", f"{t['rows_read']:,} of {total:,}"),
        ("rows kept", f"{t['rows_kept']:,}"),
        ("rows rejected", f"{t['rows_rejected']:,}"),
    ]
    for reason, n in t["rejected"].items():
        bad = [r for r in t["rejected_rows"] if r["reason"] == reason]
        where = [f"{Path(r['source']).name}:{r['line']}" for r in bad]
        more = ", ..." if n > listed else ""
        rows.append((f"  {reason}", f"{n:,} (lines {', '.join(where[:listed])}{more})"))
    rows += [
        ("turns", f"{t['turns']:,} ({t['turns_at_limit']:,} stopped at --max-new-tokens)"),
        ("new tokens", f"{t['new_tokens']:,}"),
        ("time", f"{seconds:,.1f} s this run"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
