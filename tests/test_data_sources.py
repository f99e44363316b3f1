"""Inputs beyond JSONL: parquet and arrow files and `datasets` folders read as the same rows, and
the messages a wrong --data gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from extract.data import Rejected, Tokenized, index_rows, iter_rows
from shared.manifest import read_manifest
from tests.test_extract import chat

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

ROWS = [chat(i, 1 + i % 2) for i in range(11)]
ROWS[3] = {"messages": [{"role": "user", "content": "no answer here"}]}  # rejected: no answer


def sharegpt(row: dict) -> dict:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in row]}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """The same rows as JSONL, parquet (row groups of 3), arrow file, arrow stream and a
    `datasets` folder; a ShareGPT parquet twin of them."""
    root = tmp_path_factory.mktemp("sources")
    table = pa.Table.from_pylist(ROWS)
    out = {"jsonl": root / "rows.jsonl", "parquet": root / "rows.parquet"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pq.write_table(table, out["parquet"], row_group_size=3)
    out["arrow"] = root / "rows.arrow"
    with pa.ipc.new_file(out["arrow"], table.schema) as w:
        for batch in table.to_batches(max_chunksize=4):
            w.write_batch(batch)
    out["stream"] = root / "rows-stream.arrow"
    with pa.ipc.new_stream(out["stream"], table.schema) as w:
        w.write_table(table, max_chunksize=5)
    out["dataset"] = root / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(out["dataset"]), max_shard_size="1KB")
    out["sharegpt"] = root / "sharegpt.parquet"
    pq.write_table(pa.Table.from_pylist([sharegpt(r["messages"]) for r in ROWS]), out["sharegpt"])
    return out


def summary(items) -> list[tuple]:
    return [
        (i.row, i.line, tuple(i.input_ids.tolist()))
        if isinstance(i, Tokenized)
        else (i.row, i.line, i.reason)
        for i in items
    ]


def test_every_table_reads_as_its_jsonl(sources, tokenizer):
    want = summary(iter_rows([sources["jsonl"]], tokenizer, max_length=512))
    assert len(want) == len(ROWS) and want[3] == (3, 4, "no_assistant_turn")
    assert len(list((sources["dataset"]).glob("*.arrow"))) > 1  # several files, one table
    for kind in ("parquet", "arrow", "stream", "dataset", "sharegpt"):
        got = summary(iter_rows([sources[kind]], tokenizer, max_length=512))
        assert got == want, kind


@pytest.mark.parametrize("slice_rows", [1024, 2])
def test_row_ranges_of_tables_start_mid_batch(sources, tokenizer, monkeypatch, slice_rows):
    monkeypatch.setattr("extract.sources.SLICE_ROWS", slice_rows)  # batches read in slices
    files = [sources["parquet"], sources["jsonl"], sources["dataset"], sources["arrow"]]
    every = summary(iter_rows(files, tokenizer, max_length=512))
    index = index_rows(files)
    assert index.counts == (len(ROWS),) * 4
    for start, stop in [(4, 8), (10, 13), (20, 30), (25, 33), (34, 43), (39, 44)]:
        rows = range(start, stop)
        got = iter_rows(files, tokenizer, max_length=512, rows=rows, index=index)
        assert summary(got) == every[start:stop], (start, stop)


def test_tables_without_a_known_column_or_a_split_are_refused_before_any_work(
    sources, tmp_path, tiny_qwen3
):
    from extract.__main__ import main

    def run(data: Path) -> str:
        r = CliRunner().invoke(
            main, ["--out", str(tmp_path / "c"), "--target", str(tiny_qwen3), "--data", str(data)]
        )
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert not (tmp_path / "c").exists()
        return r.output

    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "answer": "yo"}]), odd)
    assert "columns of odd.parquet (prompt, answer) hold none of `messages`" in run(odd)
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:2]), test=datasets.Dataset.from_list(ROWS[2:4])
    ).save_to_disk(str(tmp_path / "dd"))
    assert f"splits train, test: name the split to read, e.g. --data {tmp_path}/dd/train" in run(
        tmp_path / "dd"
    )
    (tmp_path / "plain").mkdir()
    said = run(tmp_path / "plain")
    assert "is a folder, not a data file" in said and "parquet or arrow" in said


def test_a_row_of_unknown_keys_says_which_are_accepted(tmp_path, tokenizer):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    (item,) = iter_rows([path], tokenizer, max_length=512)
    assert isinstance(item, Rejected) and item.reason == "unknown_schema"
    assert "`messages`" in item.detail and "`input_ids` + `loss_mask`" in item.detail
    assert "['completion', 'prompt']" in item.detail


def test_extract_reads_a_datasets_folder_with_rejections_counted(sources, tmp_path, tiny_qwen3):
    from extract.__main__ import main

    out = tmp_path / "c"
    args = ["--out", str(out), "--target", str(tiny_qwen3), "--data", str(sources["dataset"])]
    args += ["--gpus", "cpu", "--rows-per-part", "4", "--layers", "0,2", "--writer-threads", "1"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    m = read_manifest(out)
    assert m.complete and m.sources[0].path == str(sources["dataset"])
    assert m.totals()["rows_kept"] == len(ROWS) - 1
    (bad,) = [r for p in m.parts for r in p.rejected_rows]
    assert (bad.source, bad.line, bad.reason) == (str(sources["dataset"]), 4, "no_assistant_turn")
