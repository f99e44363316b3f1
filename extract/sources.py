"""Where rows come from: JSONL files, parquet and arrow files, Hugging Face `datasets` folders.

A JSONL row is a line, handed on as bytes (`extract.data` parses it). A table's row is a dict of
the columns `extract.data` reads (`COLUMNS`, only those are read), taken batch by batch from a
memory-mapped file with pyarrow, so a large file is streamed rather than loaded; a row range
starts at the batch (parquet: row group) holding its first row. A `datasets` folder is what
`Dataset.save_to_disk` writes: `state.json` naming its arrow files, read in that order as one
table. A table's rows are numbered from 1 in the file (or folder), as JSONL lines are, for the
error reports; arrow fills the fields a row lacks with nulls, which are dropped here so that a
row reads as the JSON object it came from.

pyarrow is imported only for tables (`pip install pyarrow`, or the package's `data` extra).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

COLUMNS = ("messages", "conversations", "input_ids", "loss_mask")
ACCEPTED_INPUT = (
    "--data takes JSONL files, parquet or arrow files, and Hugging Face `datasets` folders "
    "(written by save_to_disk), whose rows hold OpenAI `messages`, ShareGPT `conversations`, "
    "or pre-tokenized `input_ids` + `loss_mask`"
)
_PARQUET_MAGIC = b"PAR1"
_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # an IPC stream's first message (save_to_disk's files)
_DATASET_STATE = "state.json"
_COMPRESSED = {b"\x1f\x8b": "gzip", b"(\xb5/\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ": "xz"}


class SourceError(ValueError):
    """A --data path that cannot be read as rows; the message names it and what is accepted."""


def source_kind(path: Path | str) -> str:
    """ "jsonl", "parquet", "arrow" or "dataset" (a `save_to_disk` folder), by content."""
    path = Path(path)
    if path.is_dir():
        if (path / _DATASET_STATE).is_file():
            return "dataset"
        splits = _splits(path)
        if splits:
            raise SourceError(
                f"--data {path} is a Hugging Face DatasetDict with splits {', '.join(splits)}: "
                f"name the split to read, e.g. --data {path / splits[0]}"
            )
        raise SourceError(f"--data {path} is a folder, not a data file. {ACCEPTED_INPUT}")
    with open(path, "rb") as f:  # FileNotFoundError for a missing one
        head = f.read(4096)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise SourceError(f"--data {path} is UTF-16 text: save it as UTF-8. {ACCEPTED_INPUT}")
    text = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    if text.split(b"\n", 1)[0].strip() == b"[" or text.startswith(b"[{"):  # a list of rows
        raise SourceError(
            f"--data {path} is one JSON document (a list), not JSON Lines: write one row per "
            f"line, e.g. jq -c '.[]' {path} > rows.jsonl. {ACCEPTED_INPUT}"
        )
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if head.startswith(_ARROW_FILE_MAGIC) or head.startswith(_ARROW_STREAM_MAGIC):
        return "arrow"
    for magic, how in _COMPRESSED.items():
        if head.startswith(magic):
            raise SourceError(
                f"--data {path} is {how}-compressed: decompress it first. {ACCEPTED_INPUT}"
            )
    return "jsonl"


def _splits(folder: Path) -> list[str]:
    try:
        return list(json.loads((folder / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 (pyarrow.parquet.ParquetFile)
    except ImportError:
        raise SourceError(
            "reading parquet or arrow data needs pyarrow: pip install pyarrow "
            '(or pip install -e ".[data]")'
        ) from None
    return pyarrow


def table_files(path: Path | str) -> list[Path]:
    """The arrow or parquet files of a table source, in row order."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    try:
        state = json.loads((path / _DATASET_STATE).read_text())
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"--data {path}: {_DATASET_STATE} unreadable ({e})") from None


def _open(path: Path) -> tuple[Any, str]:
    """(reader, "parquet" | "file" | "stream") of one table file, memory-mapped."""
    pa = _pyarrow()
    try:
        if source_kind(path) == "parquet":
            return pa.parquet.ParquetFile(pa.memory_map(str(path))), "parquet"
        source = pa.memory_map(str(path))
        if source.read(6) == _ARROW_FILE_MAGIC:
            return pa.ipc.open_file(source), "file"
        source.seek(0)
        return pa.ipc.open_stream(source), "stream"
    except (OSError, pa.ArrowException) as e:
        raise SourceError(f"--data {path} cannot be read as a table ({e})") from None


def _schema_names(reader: Any, how: str) -> list[str]:
    schema = reader.schema_arrow if how == "parquet" else reader.schema
    return list(schema.names)


def check_table(path: Path | str) -> None:
    """Raise SourceError unless every file of the table opens and has a column to read."""
    for file in table_files(path):
        names = _schema_names(*_open(file))
        if not any(c in names for c in ("messages", "conversations", "input_ids")):
            raise SourceError(
                f"--data {path}: the columns of {file.name} ({', '.join(names)}) hold none of "
                f"`messages`, `conversations` or `input_ids`. {ACCEPTED_INPUT}"
            )


# Rows turned into Python objects at once: a file written as one huge batch is still streamed.
SLICE_ROWS = 1024


def _batches(file: Path, skip: int) -> Iterator[tuple[int, Any]]:
    """(row of its first row in the file, record batch of `COLUMNS` of at most `SLICE_ROWS`
    rows), from the one holding row `skip` on; rows before it are passed over unread."""
    reader, how = _open(file)
    columns = [c for c in COLUMNS if c in _schema_names(reader, how)]
    first = 0
    if how == "parquet":
        meta = reader.metadata
        for group in range(meta.num_row_groups):
            rows = meta.row_group(group).num_rows
            if first + rows > skip:
                batches = reader.iter_batches(
                    batch_size=SLICE_ROWS, row_groups=[group], columns=columns
                )
                for batch in batches:
                    if first + batch.num_rows > skip:
                        yield first, batch
                    first += batch.num_rows
            else:
                first += rows
        return
    batches = (
        (reader.get_batch(i) for i in range(reader.num_record_batches)) if how == "file" else reader
    )
    for batch in batches:  # memory-mapped: rows passed over are never copied
        for at in range(0, batch.num_rows, SLICE_ROWS):
            part = batch.slice(at, SLICE_ROWS)
            if first + at + part.num_rows > skip:
                yield first + at, part.select(columns)
        first += batch.num_rows


def table_rows(path: Path | str, start: int, stop: int | None) -> Iterator[tuple[int, dict]]:
    """(0-based row in the source, row dict) of rows start..stop-1 of a table source (to its
    end when stop is None), nulls dropped."""
    offset = 0  # rows of the files before this one
    for file in table_files(path):
        if stop is not None and offset >= stop:
            return
        for first, batch in _batches(file, max(0, start - offset)):
            at = offset + first
            if stop is not None and at >= stop:
                return
            for i, row in enumerate(batch.to_pylist()):
                if at + i >= start and (stop is None or at + i < stop):
                    yield at + i, _without_nulls(row)
        offset += table_row_count(file)


def table_row_count(path: Path | str) -> int:
    """Rows of a table source, from its files' metadata."""
    total = 0
    for file in table_files(path):
        reader, how = _open(file)
        if how == "parquet":
            total += reader.metadata.num_rows
        elif how == "file":
            total += sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
        else:
            total += sum(batch.num_rows for batch in reader)
    return total


def _without_nulls(value: Any) -> Any:
    """A row as its JSON object read: arrow's nulls for absent fields dropped, at any depth.

    >>> _without_nulls({"messages": [{"role": "user", "content": "hi", "name": None}], "x": None})
    {'messages': [{'role': 'user', 'content': 'hi'}]}
    """
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def fingerprint(path: Path | str) -> str:
    """sha256 (hex) of a file's bytes; of a `datasets` folder, of its data files' names and
    hashes in order (its state.json also holds a cache fingerprint that changes by itself)."""
    path = Path(path)
    if not path.is_dir():
        return _file_sha256(path)
    h = hashlib.sha256()
    for file in table_files(path):
        h.update(f"{file.name}\0{_file_sha256(file)}\n".encode())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def streams(files) -> str | None:  # noqa: ANN001 (paths as given)
    """The refusal for --data paths that are pipes or devices (`/dev/stdin`, `<(cmd)`), None
    when there are none: the rows are read several times (fingerprint, index, every process),
    and a pipe would look empty the second time."""
    odd = [str(f) for f in files if not Path(f).is_file() and not Path(f).is_dir()]
    if not odd:
        return None
    return (
        f"--data {', '.join(odd)}: not a regular file (a pipe?): the rows are read several "
        "times, so write them to a file first"
    )
