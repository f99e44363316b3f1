"""Source rows -> `Tokenized` samples or `Rejected` rows with a reason, never an exception.

Accepted row schemas, one JSON object per line of a JSONL file, or one row of a parquet or arrow
file or `datasets` folder with these columns (`extract.sources`); the first matching key wins,
in this order:
- OpenAI: `{"messages": [{"role": ..., "content": ...}, ...]}` (extra keys such as
  `reasoning_content` are passed to the chat template); a content given as a list of text parts
  (`[{"type": "text", "text": ...}, ...]`) goes as it is to a template that reads parts (a
  multimodal model's) and as their texts joined by newlines to one that reads strings, as
  vLLM's server does; other parts (images, audio) reject the row. Tool use in
  OpenAI's form is read: assistant messages with `tool_calls` (their content may be null),
  `tool` messages, and the row's `tools`, all rendered by the chat template (a template that
  leaves the tool calls out rejects the row: it would supervise turns without them);
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

from extract.chat import ChatTemplateError, render_chat, tokenize_chat
from extract.messages import (  # noqa: F401 (the row schemas' names, used from here too)
    ACCEPTED_KEYS,
    SHAREGPT_ROLES,
    RowError,
    ToolMessages,
    joined_parts,
    parse_row,
)
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
INDEX_EVERY = 4096  # rows between two seek points of a RowIndex
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


def _tokenize_row(
    raw: bytes, tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None
) -> tuple[np.ndarray, np.ndarray]:
    parsed = parse_row(raw)
    if isinstance(parsed, dict):
        return _pretokenized(parsed, len(tokenizer))
    if not _reads_parts(tokenizer):
        parsed = joined_parts(parsed)
    if isinstance(parsed, ToolMessages):
        template_kwargs = {**(template_kwargs or {}), "tools": parsed.tools}
    try:
        ids_T, mask_T = tokenize_chat(tokenizer, parsed, template_kwargs=template_kwargs)
        _check_tool_calls_rendered(tokenizer, parsed, template_kwargs)
    except ChatTemplateError as e:
        raise RowError("template_error", str(e)) from e
    if len(ids_T) == 0:
        raise RowError("empty", "the chat template rendered no tokens")
    return ids_T, mask_T


_PROBE_PARTS = ("dflash-probe-part-one", "dflash-probe-part-two")
_READS_PARTS: dict[str, bool] = {}  # by chat template


def _reads_parts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders a content given as text parts itself (a multimodal
    model's, which loops over them, as vLLM detects): then it gets them as they are. Otherwise
    they are joined first (`joined_parts`); a template that reads strings fails on a list, or
    writes its repr."""
    key = repr(getattr(tokenizer, "chat_template", None))
    if key not in _READS_PARTS:
        parts = [{"type": "text", "text": t} for t in _PROBE_PARTS]
        probe = [{"role": "user", "content": parts}, {"role": "assistant", "content": "x"}]
        try:
            text = render_chat(tokenizer, probe)
        except ChatTemplateError:
            text = ""
        shown = "'type'" in text or '"type"' in text  # the list's repr or JSON, not read
        _READS_PARTS[key] = all(t in text for t in _PROBE_PARTS) and not shown
    return _READS_PARTS[key]


def _check_tool_calls_rendered(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    template_kwargs: Mapping[str, Any] | None,
) -> None:
    """Raise ChatTemplateError when a template renders the row the same without its tool calls
    (it would train the drafter on assistant turns without them)."""
    if not any(m.get("tool_calls") for m in messages):
        return
    without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    try:
        bare = render_chat(tokenizer, without, template_kwargs=template_kwargs)
    except ChatTemplateError:  # the template needs them: it renders them
        return
    if bare == render_chat(tokenizer, messages, template_kwargs=template_kwargs):
        raise ChatTemplateError(
            "the chat template does not render tool calls (the row renders the same without "
            "them): use the target's own template, which knows its tool-call format"
        )


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
