"""Damaged files of a `python -m extract.regen` output: journal lines that are not entries, and
chunk files or an output changed on disk, are redone rather than read as rows or a traceback."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from extract.data import Rejected
from extract.regen.journal import OpenChunk


def _rejected(row: int) -> str:
    rejected = Rejected(row=row, source="in.jsonl", line=row + 1, reason="too_long", detail="")
    return json.dumps({"row": row, "rejected": asdict(rejected)}) + "\n"


def _kept(row: int) -> str:
    entry = {"row": row, "kept": {"messages": [], "source_row": row}, "turns": 1}
    return json.dumps({**entry, "at_limit": 0, "new_tokens": 3, "retokenized": 0}) + "\n"


@pytest.mark.parametrize(
    "garbage",
    ["42", "[1, 2]", "null", '{"row": 2}', '{"row": 2, "kept": 3}', '{"row": "2"}',
     '{"row": 2.0, "rejected": {"row": 2}}', '{"row": 2, "kept": {}, "turns": "1"}'],
)  # fmt: skip
def test_journal_lines_that_are_no_entry_are_dropped_and_their_row_asked_again(tmp_path, garbage):
    journal = tmp_path / "chunk-000000.journal"
    good = _rejected(0) + _kept(1)
    journal.write_text(good + garbage + "\n")
    loaded = OpenChunk.load(tmp_path, 0, range(0, 4))
    assert set(loaded.entries) == {0, 1} and journal.read_text() == good
    result = loaded.result()
    assert [r.row for r in result.rejected] == [0] and result.new_tokens == 3
