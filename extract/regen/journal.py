"""The journal of a chunk that `python -m extract.regen --server` is working on:
`OUT.parts/chunk-NNNNNN.journal`, one JSON line per finished row (its output row, or its
rejection), appended as each finishes, so a rerun after a crash requests only the rows it lacks.
When the chunk is complete it is committed like any other and its journal is deleted.
"""

from __future__ import annotations

import json
from collections.abc import Container
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from extract.data import Rejected
from extract.regen.state import ChunkResult, chunk_name
from shared.fsio import atomic_write_bytes


@dataclass
class OpenChunk:
    """A pending chunk: its rows finished so far (this run's and its journal's)."""

    chunk: int
    rows: range
    path: Path
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    file: Any = None

    @classmethod
    def load(cls, parts: Path, chunk: int, rows: range) -> OpenChunk:
        """The chunk with its journal's entries; a last line cut short by a crash, or any line
        that is not an entry of one of `rows` (damage), is dropped: the journal is rewritten
        without it and its row asked for again."""
        path = journal_path(parts, chunk)
        open_chunk = cls(chunk, rows, path)
        if not path.is_file():
            return open_chunk
        # Bytes split at newlines only: a row's text may hold U+2028, which str.splitlines
        # splits at, and damage may hold bytes that are no UTF-8.
        lines = path.read_bytes().splitlines(keepends=True)
        good = []
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                continue
            if line.endswith(b"\n") and _is_entry(entry, rows):
                open_chunk.entries[entry["row"]] = entry
                good.append(line)
        if len(good) != len(lines):
            atomic_write_bytes(path, b"".join(good))
        return open_chunk

    def add(self, entry: dict[str, Any]) -> None:
        if self.file is None:
            self.file = open(self.path, "a")  # noqa: SIM115 (closed by close())
        # One write of one line, flushed: a kill leaves whole lines (the OS keeps them).
        self.file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.file.flush()
        self.entries[entry["row"]] = entry

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.rows)

    def result(self) -> ChunkResult:
        result = ChunkResult(rows=[], rejected=[])
        for row in sorted(self.entries):
            entry = self.entries[row]
            if "rejected" in entry:
                result.rejected.append(Rejected(**entry["rejected"]))
                continue
            result.rows.append(entry["kept"])
            result.turns += entry["turns"]
            result.turns_at_limit += entry["at_limit"]
            result.new_tokens += entry["new_tokens"]
            result.turns_retokenized += entry["retokenized"]
        return result

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


_COUNTS = ("turns", "at_limit", "new_tokens", "retokenized")
_REJECTED = {f.name for f in fields(Rejected)}


def _is_entry(entry: Any, rows: range) -> bool:
    """Whether `entry` is a journal line as `Journal.handle` writes it, of one of `rows`."""
    if not isinstance(entry, dict) or type(entry.get("row")) is not int or entry["row"] not in rows:
        return False
    if "rejected" in entry:
        rejected = entry["rejected"]
        return isinstance(rejected, dict) and rejected.keys() == _REJECTED
    return isinstance(entry.get("kept"), dict) and all(type(entry.get(k)) is int for k in _COUNTS)


def journal_path(parts: Path, chunk: int) -> Path:
    return parts / (chunk_name(chunk).removesuffix(".jsonl") + ".journal")


def drop_committed(parts: Path, committed: Container[int]) -> None:
    """Delete the journals of committed chunks: left by a crash between a commit and the
    journal's deletion."""
    for path in parts.glob("chunk-*.journal"):
        if int(path.stem.removeprefix("chunk-")) in committed:
            path.unlink()
