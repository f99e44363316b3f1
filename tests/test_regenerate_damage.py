"""Damaged files of a `python -m extract.regen` output: journal lines that are not entries, and
chunk files or an output changed on disk, are redone rather than read as rows or a traceback; a
full disk, or an old output that cannot be removed, is one message."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from extract.data import Rejected
from extract.regen.config import RegenError
from extract.regen.journal import OpenChunk
from extract.regen.state import (
    STATE,
    ChunkRecord,
    RegenState,
    chunk_name,
    existing_state,
    merge_chunks,
    parts_dir,
)
from tests.test_extract_safety import small_disk
from tests.test_regenerate import regen, write_chats

pytestmark = pytest.mark.usefixtures("one_thread")


def _rejected(row: int) -> str:
    rejected = Rejected(row=row, source="in.jsonl", line=row + 1, reason="too_long", detail="")
    return json.dumps({"row": row, "rejected": asdict(rejected)}) + "\n"


def _kept(row: int, text: str = "") -> str:
    kept = {"messages": [{"role": "assistant", "content": text}], "source_row": row}
    entry = {"row": row, "kept": kept, "turns": 1, "at_limit": 0, "new_tokens": 3}
    return json.dumps({**entry, "retokenized": 0}, ensure_ascii=False) + "\n"


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


def test_journal_bytes_that_are_no_utf8_are_dropped_and_a_line_separator_kept(tmp_path):
    journal = tmp_path / "chunk-000000.journal"
    good = (_rejected(0) + _kept(1, "one\u2028two")).encode()  # as Journal.handle writes it
    journal.write_bytes(good + b"\xff\xfe garbage\n")
    loaded = OpenChunk.load(tmp_path, 0, range(0, 4))
    assert set(loaded.entries) == {0, 1} and journal.read_bytes() == good
    assert loaded.entries[1]["kept"]["messages"][0]["content"] == "one\u2028two"


def test_a_chunk_file_or_output_changed_on_disk_is_made_again(tiny_qwen3, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "out.jsonl"
    regen(out, tiny_qwen3, data, max_rows=8, max_new_tokens=4)
    whole, chunk = out.read_bytes(), parts_dir(out) / chunk_name(1)
    kept = chunk.read_bytes()
    chunk.write_bytes(kept[: len(kept) // 2])  # cut short
    with out.open("ab") as f:
        f.write(b"garbage\n")
    state = regen(out, tiny_qwen3, data, max_rows=8, max_new_tokens=4)
    assert chunk.read_bytes() == kept and out.read_bytes() == whole and state.merged_rows == 8
    with out.open("ab") as f:
        f.write(b"garbage\n")
    regen(out, tiny_qwen3, data, max_rows=8, max_new_tokens=4)
    assert out.read_bytes() == whole


def _state_text(change) -> str:  # noqa: ANN001
    record = ChunkRecord(
        chunk=0, first_row=0, end_row=2, kept=2, rejected={}, rejected_rows=(), turns=2,
        turns_at_limit=0, new_tokens=9, size=100,
    )  # fmt: skip
    obj = RegenState(settings={"target_revision": "x"}, config={}, chunks={0: record}).to_json()
    change(obj)
    return json.dumps(obj)


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(settings=None),
        lambda s: s.update(merged_rows="2"),
        lambda s: s["chunks"][0].update(chunk="0"),
        lambda s: s["chunks"][0].update(kept="2"),
        lambda s: s["chunks"][0].update(rejected={"too_long": None}),
    ],
)
def test_a_state_file_of_other_types_is_named_as_damaged(tmp_path, change):
    out = tmp_path / "out.jsonl"
    parts_dir(out).mkdir()
    (parts_dir(out) / STATE).write_text(_state_text(lambda s: None))
    assert existing_state(out, {"target_revision": "x"}, overwrite=False) is not None
    (parts_dir(out) / STATE).write_text(_state_text(change))
    with pytest.raises(RegenError, match="malformed state file"):
        existing_state(out, {"target_revision": "x"}, overwrite=False)


def test_a_damaged_state_file_is_named_with_what_to_do(tmp_path):
    out = tmp_path / "out.jsonl"
    parts_dir(out).mkdir()
    (parts_dir(out) / STATE).write_text('{"version": 1, "settings": {"target')  # cut short
    with pytest.raises(RegenError) as e:
        existing_state(out, {"target_revision": "x"}, overwrite=False)
    message = str(e.value)
    assert str(parts_dir(out) / STATE) in message and "malformed state file" in message
    assert "--overwrite" in message and "same settings" not in message
    assert existing_state(out, {"target_revision": "x"}, overwrite=True) is None


def test_a_full_disk_is_a_message_and_the_same_command_resumes(tiny_qwen3, tmp_path):
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    data = write_chats(tmp_path / "chats.jsonl")
    whole = tmp_path / "whole.jsonl"
    regen(whole, tiny_qwen3, data, max_rows=8, max_new_tokens=4, rows_per_chunk=2)
    with small_disk(tmp_path / "disk", "8k") as disk:  # full at the first chunk's commit
        args = ["--target", str(tiny_qwen3), "--data", str(data), "--out", str(disk / "o.jsonl")]
        args += ["--gpus", "cpu", "--max-rows", "8", "--max-new-tokens", "4"]
        args += ["--max-length", "160", "--batch-size", "3", "--rows-per-chunk", "2"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert f"Error: the disk holding {disk / 'o.jsonl.parts'} is full" in result.output
        assert "run the same command" in result.output
        assert [p.name for p in disk.glob(".*tmp*")] == []
        subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert (disk / "o.jsonl").read_bytes() == whole.read_bytes()


def test_a_merge_that_fills_the_disk_leaves_no_partial_copy(tmp_path):
    (tmp_path / chunk_name(0)).write_text("x" * 20_000)
    with small_disk(tmp_path / "disk", "8k") as disk:
        with pytest.raises(OSError) as e:
            merge_chunks(disk / "o.jsonl", tmp_path, 1)
        assert e.value.errno == errno.ENOSPC and list(disk.iterdir()) == []


@contextlib.contextmanager
def undeletable(folder: Path) -> Iterator[Path]:
    """`folder` made a read-only file system holding one file, which no one (root included) can
    remove: that file's path. Skips where none can be mounted."""
    with small_disk(folder, "1m") as disk:
        (disk / "kept").write_text("x")
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        yield disk / "kept"


def _listed_after(folder: Path, name: str) -> str:
    """A name for a new folder in `folder` that the file system lists after `name` (removing
    entries in listing order reaches `name` first): the first of a few that does, else any."""
    candidates = [f"old-{i}" for i in range(16)]
    for c in candidates:
        (folder / c).mkdir()
    listed = os.listdir(folder)
    after = [c for c in listed[listed.index(name) :] if c in candidates]
    for c in candidates:
        (folder / c).rmdir()
    return (after or candidates)[0]


@pytest.mark.parametrize("gpus", ["cpu", pytest.param("cpu:2", marks=pytest.mark.slow)])
def test_an_old_output_that_cannot_be_removed_is_one_message_and_a_rerun_replaces_it(
    tiny_qwen3, tmp_path, monkeypatch, gpus
):
    """--overwrite of an output whose folder holds a file that cannot be removed: one message
    naming it and saying that the old output may be partly removed, from this process or from
    rank 0 of --gpus cpu:2 (which prepares the output). The state file, which marks the folder
    as this command's, goes last: once the file can be removed, the same command replaces what
    is left, as the message says."""
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # inherited by the spawned processes
    data = write_chats(tmp_path / "chats.jsonl")
    out = tmp_path / "o.jsonl"
    regen(out, tiny_qwen3, data, max_rows=4, max_new_tokens=2)
    parts = parts_dir(out)
    args = ["--target", str(tiny_qwen3), "--data", str(data), "--out", str(out)]
    args += ["--gpus", gpus, "--max-rows", "4", "--max-new-tokens", "4", "--overwrite"]
    with undeletable(parts / _listed_after(parts, STATE)) as stuck:
        result = CliRunner().invoke(main, args)
        assert (parts / STATE).is_file()
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: {stuck}: Read-only file system. The old output in --out {out} may be partly "
        "removed: once that file can be removed, the same command replaces what is left"
    )
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    fresh = tmp_path / "fresh.jsonl"
    regen(fresh, tiny_qwen3, data, max_rows=4, max_new_tokens=4)
    assert out.read_bytes() == fresh.read_bytes() and not stuck.parent.exists()
