"""Source rows -> `Tokenized` samples or `Rejected` rows with a reason, never an exception.

Accepted row schemas, one JSON object per line of a JSONL file, or one row of a parquet or arrow
file or `datasets` folder with these columns (`extract.sources`); the first matching key wins,
in this order:
- OpenAI: `{"messages": [{"role": ..., "content": ...}, ...]}` (extra keys such as
  `reasoning_content` are passed to the chat template); a content given as a list of text parts
  (`[{"type": "text", "text": ...}, ...]`) is their texts joined by newlines, as vLLM's server
  joins them for a text-only model; other parts (images, audio) reject the row;
- ShareGPT: `{"conversations": [{"from": ..., "value": ...}, ...]}` with `from` one of system,
  human, user, gpt, assistant;
- pre-tokenized: `{"input_ids": [...], "loss_mask": [...]}` (ints, equal lengths, mask 0/1, ids
  below `len(tokenizer)`).

Rows and lines: several files are read in the given order. A line that is empty or whitespace
only is not a row and is skipped silently; every other line is a row, numbered 0, 1, ... across
all files (the global row number, the sample's identity for resume). `line` is the 1-based
physical line number in its file (a table's rows count from 1), for error reports.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from extract.chat import ChatTemplateError, tokenize_chat
from extract.sources import fingerprint, source_kind, table_row_count, table_rows

if TYPE_CHECKING:  # the type only: importing transformers takes seconds
    from transformers import PreTrainedTokenizerBase

REJECT_REASONS = (
    "malformed_json",  # not valid UTF-8 JSON
    "unknown_schema",  # JSON, but not one of the accepted schemas (or a malformed message)
    "bad_tokens",  # pre-tokenized row with wrong types, lengths, mask values or ids
    "no_assistant_turn",  # a chat without any assistant message
    "empty",  # no messages, or no tokens
    "too_few_supervised_tokens",  # no two consecutive supervised tokens, after truncation
    "template_error",  # the chat template failed, or assistant turns could not be located
)
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
INDEX_EVERY = 4096  # rows between two seek points of a RowIndex
ACCEPTED_KEYS = (
    "a row needs `messages` (OpenAI), `conversations` (ShareGPT), or `input_ids` + `loss_mask`"
)
# Said beside a reason's count in the summary, where the reason alone does not say what to do.
REASON_HINTS = {
    "malformed_json": "not JSON: is --data a JSONL, parquet or arrow file?",
    "unknown_schema": ACCEPTED_KEYS,
}


def demo_dataset() -> Path:
    """The small chat dataset shipped with the package (used when no dataset is given)."""
    return Path(__file__).resolve().parent / "data" / "demo.jsonl"


@dataclass(frozen=True)
class Tokenized:
    row: int
    source: str
    line: int
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool


@dataclass(frozen=True)
class Rejected:
    row: int
    source: str
    line: int
    reason: str  # one of REJECT_REASONS
    detail: str


@dataclass(frozen=True)
class RowIndex:
    """Row counts and seek points of source files, so a row range is read without a full scan.

    `seeks[f][k]` is `(byte offset, line number)` of row `k * every` of file f. Valid only for
    the files exactly as they were when indexed.
    """

    counts: tuple[int, ...]
    every: int
    seeks: tuple[tuple[tuple[int, int], ...], ...]


class RowError(Exception):
    """A row that cannot be used: `reason` (e.g. one of REJECT_REASONS) and a `detail`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def index_rows(files: Sequence[Path | str], *, every: int = INDEX_EVERY) -> RowIndex:
    """Scan the JSONL files once (no JSON parsing) for their row counts and seek points; a
    table's count comes from its metadata, and a row range seeks by its batches instead."""
    counts, seeks = [], []
    for path in files:
        if source_kind(path) != "jsonl":
            counts.append(table_row_count(path))
            seeks.append(())
            continue
        points, rows, offset = [], 0, 0
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    if rows % every == 0:
                        points.append((offset, line_no))
                    rows += 1
                offset += len(raw)
        counts.append(rows)
        seeks.append(tuple(points))
    return RowIndex(counts=tuple(counts), every=every, seeks=tuple(seeks))


def count_rows(files: Sequence[Path | str]) -> list[int]:
    """Rows per file: every line that is not blank (blank lines are skipped, not rows)."""
    return list(index_rows(files).counts)


def iter_rows(
    files: Sequence[Path | str],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    rows: range | None = None,
    index: RowIndex | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> Iterator[Tokenized | Rejected]:
    """One `Tokenized` or `Rejected` per row of `rows` (all rows if None), in row order.

    Reading stops after the range's end. Without `index`, rows before the range are still read
    (but not parsed); with one (from `index_rows` on the same files) reading seeks close to the
    start. Samples longer than `max_length` are cut and flagged `truncated`.
    `template_kwargs` go to the chat template (e.g. `{"enable_thinking": False}`).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if rows is not None and rows.step != 1:
        raise ValueError(f"rows must be a contiguous range, got {rows}")
    start = rows.start if rows is not None else 0
    stop = rows.stop if rows is not None else None
    for row, source, line, raw in raw_rows(files, start, stop, index):
        try:
            ids_T, mask_T = _tokenize_row(raw, tokenizer, template_kwargs)
            truncated = len(ids_T) > max_length
            ids_T, mask_T = ids_T[:max_length], mask_T[:max_length]
            if not np.any(mask_T[:-1] & mask_T[1:]):
                cut = f" in its first {max_length} tokens (--max-length)" if truncated else ""
                detail = f"no two consecutive supervised tokens{cut}"
                raise RowError("too_few_supervised_tokens", detail)
            yield Tokenized(row, source, line, ids_T, mask_T, truncated)
        except RowError as e:
            yield Rejected(row, source, line, e.reason, e.detail)


def raw_rows(
    files: Sequence[Path | str], start: int, stop: int | None, index: RowIndex | None
) -> Iterator[tuple[int, str, int, bytes | dict]]:
    """(global row, source, line number, raw line) of rows start..stop-1 (to the end if stop is
    None), unparsed; with `index` (from `index_rows` on the same files) reading seeks close to
    `start`. A table's row comes as its dict, numbered from 1 in its source
    (`extract.sources`)."""
    first_row = 0  # global number of the current file's first row
    for file_no, path in enumerate(files):
        if stop is not None and first_row >= stop:
            return
        if index is not None and first_row + index.counts[file_no] <= start:
            first_row += index.counts[file_no]
            continue
        if source_kind(path) != "jsonl":
            local_stop = None if stop is None else stop - first_row
            for row, obj in table_rows(path, max(0, start - first_row), local_stop):
                yield first_row + row, str(path), row + 1, obj
            count = index.counts[file_no] if index is not None else table_row_count(path)
            first_row += count
            continue
        offset, line_no, row = 0, 0, first_row
        if index is not None and start > first_row:
            k = (start - first_row) // index.every
            offset, line_no = index.seeks[file_no][k]
            line_no -= 1
            row = first_row + k * index.every
        with open(path, "rb") as f:
            f.seek(offset)
            for raw in f:
                line_no += 1
                if not raw.strip():
                    continue
                if stop is not None and row >= stop:
                    return
                if row >= start:
                    yield row, str(path), line_no, raw
                row += 1
        first_row = row


def parse_row(raw: bytes | dict[str, Any]) -> list[dict[str, Any]] | dict[str, Any]:
    """The messages of one row (a JSONL line, or a table's row as a dict; ShareGPT converted
    to OpenAI roles), or, for a pre-tokenized row, its object (its tokens are checked by the
    caller).

    Raises `RowError` for bad JSON, an unknown schema, a malformed message or a chat without an
    assistant turn."""
    if isinstance(raw, dict):
        obj = raw
    else:
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, absurd nesting
            raise RowError("malformed_json", str(e)) from e
    if not isinstance(obj, dict):
        raise RowError("unknown_schema", f"a JSON {type(obj).__name__}, not an object")
    if "messages" in obj:
        messages = _openai_messages(obj["messages"])
    elif "conversations" in obj:
        messages = _sharegpt_messages(obj["conversations"])
    elif "input_ids" in obj:
        return obj
    else:
        raise RowError("unknown_schema", f"{ACCEPTED_KEYS}; its keys: {sorted(obj)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError("no_assistant_turn", f"roles: {[m['role'] for m in messages]}")
    return messages


def _tokenize_row(
    raw: bytes, tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None
) -> tuple[np.ndarray, np.ndarray]:
    parsed = parse_row(raw)
    if isinstance(parsed, dict):
        return _pretokenized(parsed, len(tokenizer))
    try:
        ids_T, mask_T = tokenize_chat(tokenizer, parsed, template_kwargs=template_kwargs)
    except ChatTemplateError as e:
        raise RowError("template_error", str(e)) from e
    if len(ids_T) == 0:
        raise RowError("empty", "the chat template rendered no tokens")
    return ids_T, mask_T


def _openai_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise RowError("unknown_schema", f"messages is a {type(messages).__name__}, not a list")
    if not messages:
        raise RowError("empty", "no messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]):
            raise RowError("unknown_schema", f"message {i} has no role")
    return [
        m
        if isinstance(m.get("content"), str)
        else {**m, "content": _text_content(m.get("content"), i)}
        for i, m in enumerate(messages)
    ]


def _text_content(content: Any, i: int) -> str:
    """A message's content given as OpenAI content parts: its text parts joined by newlines, as
    vLLM's OpenAI server joins them for a text-only model (what the drafter will be served by).

    >>> _text_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], 0)
    'a\\nb'
    """
    if content is None:
        raise RowError("unknown_schema", f"message {i} has no content")
    if not isinstance(content, list) or not content:
        what = "an empty list" if content == [] else f"a {type(content).__name__}"
        raise RowError(
            "unknown_schema", f"message {i} content is {what}, not a string or text parts"
        )
    if not all(isinstance(p, dict) for p in content):
        raise RowError("unknown_schema", f"message {i} content is a list of other than parts")
    other = sorted({str(p.get("type")) for p in content} - {"text"})
    if other:
        raise RowError(
            "unknown_schema",
            f"message {i} has {', '.join(other)} content parts: only text parts are read",
        )
    if not all(isinstance(p.get("text"), str) for p in content):
        raise RowError("unknown_schema", f"message {i} has a text part without a string text")
    return "\n".join(p["text"] for p in content)


def _sharegpt_messages(turns: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise RowError("unknown_schema", f"conversations is a {type(turns).__name__}, not a list")
    if not turns:
        raise RowError("empty", "no conversation turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
            who = turn.get("from") if isinstance(turn, dict) else turn
            raise RowError("unknown_schema", f"turn {i} from {who!r}")
        if not isinstance(turn.get("value"), str):
            raise RowError("unknown_schema", f"turn {i} value is not a string")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return messages


def _pretokenized(obj: dict[str, Any], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = obj["input_ids"], obj.get("loss_mask")
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise RowError("bad_tokens", "input_ids and loss_mask must both be lists")
    if len(ids) != len(mask):
        raise RowError("bad_tokens", f"{len(ids)} input_ids but {len(mask)} loss_mask values")
    if not ids:
        raise RowError("empty", "no input_ids")
    # `type(x) is int` also refuses bools and floats such as 1.0.
    if not all(type(x) is int for x in ids) or not all(type(x) is int for x in mask):
        raise RowError("bad_tokens", "input_ids and loss_mask must hold ints")
    bad_id = next((x for x in ids if not 0 <= x < vocab_size), None)
    if bad_id is not None:
        raise RowError("bad_tokens", f"token id {bad_id} outside the vocabulary [0, {vocab_size})")
    if any(x not in (0, 1) for x in mask):
        raise RowError("bad_tokens", "loss_mask values must be 0 or 1")
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)


def source_fingerprint(path: Path | str) -> str:
    """sha256 (hex) of the file's bytes (of a `datasets` folder: `extract.sources.fingerprint`)."""
    return fingerprint(path)


def template_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, str | None]:
    """sha256 of the tokenizer files as saved and of the chat template, for the manifest.

    `tokenizer` covers the saved files (tokenizer.json, or vocab files of a slow tokenizer) and
    the special tokens; tokenizer_config.json is left out because `from_pretrained` adds
    load-time flags to it, and the chat template is hashed on its own (`chat_template`, None
    when the tokenizer has none).
    """
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).iterdir()):
            if path.name == "tokenizer_config.json" or path.name.startswith("chat_template"):
                continue
            h.update(f"{path.name}\0{source_fingerprint(path)}\n".encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates
        template = json.dumps(template, sort_keys=True)
    return {
        "tokenizer": h.hexdigest(),
        "chat_template": hashlib.sha256(template.encode()).hexdigest() if template else None,
    }
