"""A long sample written in pieces by several threads is the sample written whole: at the part
writer (zarr takes pieces of whole shard files, a tar takes whole samples) and through
`python -m extract`, whose writer tasks split long samples so one thread never holds a
batch's end."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from extract.config import ExtractConfig
from extract.pipeline import PIECE_ROWS, sample_pieces
from extract.run import run
from shared.cache import open_part, open_part_writer
from shared.codec import CHUNK_ROWS, STORES
from shared.manifest import read_manifest
from tests.test_cache import H, K, assert_matches, make_records, write_part
from tests.test_extract import reference_states

LONG = [5, 700, 130, 1100, 64]


def write_in_pieces(out: Path, records, *, store: str, size: int, threads: int = 4):
    """Each record in pieces of `size` rows, all pieces in a shuffled order from `threads`
    threads; returns the commit's stats."""
    writer = open_part_writer(
        out, 0, fmt="zarr", store=store, num_layers=K, hidden_size=H,
        lengths=[len(r.input_ids) for r in records],
    )  # fmt: skip
    tasks = [(n, p) for n, r in enumerate(records) for p in sample_pieces(len(r.input_ids), size)]
    random.Random(0).shuffle(tasks)

    def one(task) -> None:
        n, p = task
        r = records[n]
        writer.write(
            n, sample_index=r.sample_index, input_ids=r.input_ids[p], loss_mask=r.loss_mask[p],
            hidden=r.hidden[p], rows=p,
        )  # fmt: skip

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, tasks))
    return writer.commit()


@pytest.mark.parametrize("store", STORES)
def test_a_sample_written_in_pieces_is_the_sample_written_whole(tmp_path, store):
    records = make_records(lengths=LONG)
    whole = write_part(tmp_path / "whole", 0, records, fmt="zarr", store=store)
    for size in (CHUNK_ROWS, 3 * CHUNK_ROWS, PIECE_ROWS):
        pieces = write_in_pieces(tmp_path / f"pieces{size}", records, store=store, size=size)
        assert pieces == whole  # the same bytes in every file, the same counts
        part = open_part(tmp_path / f"pieces{size}" / "part-000000")
        for sample, record in zip(part.iter_samples(), records, strict=True):
            assert_matches(sample, record, store)


def test_pieces_are_checked(tmp_path):
    records = make_records(lengths=[300, 200])
    r = records[0]

    def piece(writer, n, rows, sample_index=None):
        rec = records[n]
        writer.write(
            n, sample_index=rec.sample_index if sample_index is None else sample_index,
            input_ids=rec.input_ids[rows], loss_mask=rec.loss_mask[rows], hidden=rec.hidden[rows],
            rows=rows,
        )  # fmt: skip

    kw = dict(store="bf16", num_layers=K, hidden_size=H, lengths=[300, 200])
    tar = open_part_writer(tmp_path / "t", 0, fmt="wds", **kw)
    with pytest.raises(ValueError, match="takes whole samples"):
        piece(tar, 0, slice(0, 128))
    piece(tar, 0, slice(0, 300))  # a whole sample as its one piece is a sample
    tar.abort()

    writer = open_part_writer(tmp_path / "z", 0, fmt="zarr", **kw)
    for rows in (slice(10, 128), slice(0, 100), slice(128, 128), slice(0, 300, 2)):
        with pytest.raises(ValueError, match="a piece starts at a multiple"):
            piece(writer, 0, rows)
    with pytest.raises(ValueError, match="hidden"):  # a failed piece leaves its rows free
        writer.write(0, sample_index=r.sample_index, input_ids=r.input_ids[:128],
                     loss_mask=r.loss_mask[:128], hidden=r.hidden[:127],
                     rows=slice(0, 128))  # fmt: skip
    piece(writer, 0, slice(0, 128))
    with pytest.raises(RuntimeError, match="already written"):
        piece(writer, 0, slice(64, 192))
    with pytest.raises(ValueError, match="written twice"):  # sample 1 with sample 0's index
        piece(writer, 1, slice(0, 200), sample_index=r.sample_index)
    with pytest.raises(ValueError, match="pieces carry sample_index"):
        piece(writer, 0, slice(128, 256), sample_index=r.sample_index + 1)
    piece(writer, 1, slice(0, 200))
    with pytest.raises(RuntimeError, match=r"missing \[0\]"):  # rows 128..300 of sample 0
        writer.commit()
    writer.abort()


@pytest.mark.parametrize("fail_first", [True, False])
def test_a_piece_whose_write_fails_can_be_written_again(tmp_path, monkeypatch, fail_first):
    """A piece that fails while compressing gives back its rows (its sample's index stays held
    while another piece of the sample holds rows), and the part written after the retry is the
    part written whole."""
    import shared.zarr_part

    records = make_records(lengths=[300, 200])
    whole = write_part(tmp_path / "whole", 0, records, fmt="zarr", store="bf16")
    compress, calls = shared.zarr_part.shard_buffers, []

    def fails_once(*args):  # the codec or the memory failing once
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError("out of memory")
        return compress(*args)

    writer = open_part_writer(
        tmp_path / "retry", 0, fmt="zarr", store="bf16", num_layers=K, hidden_size=H,
        lengths=[300, 200],
    )  # fmt: skip

    def write(n, rows=None, sample_index=None):
        r = records[n]
        rows = rows or slice(0, len(r.input_ids))
        writer.write(
            n, sample_index=r.sample_index if sample_index is None else sample_index,
            input_ids=r.input_ids[rows], loss_mask=r.loss_mask[rows], hidden=r.hidden[rows],
            rows=rows,
        )  # fmt: skip

    first, second = slice(0, 128), slice(128, 300)
    if not fail_first:
        write(0, second)
    monkeypatch.setattr(shared.zarr_part, "shard_buffers", fails_once)
    with pytest.raises(MemoryError):
        write(0, first)
    if not fail_first:
        with pytest.raises(ValueError, match="written twice"):  # held by sample 0's other piece
            write(1, sample_index=records[0].sample_index)
    write(0, first)
    if fail_first:
        write(0, second)
    write(1)
    assert writer.commit() == whole


def long_chats(path: Path) -> Path:
    """Chats of about 170 to 3,072 tokens (the longest cut there): several samples longer than
    a writer task's piece."""
    lines = []
    for i in range(10):
        answer = f"step {i} then the next one. " * (10 + 90 * (i % 4))
        msgs = [{"role": "user", "content": f"Count for me, {i}."},
                {"role": "assistant", "content": answer}]  # fmt: skip
        lines.append(json.dumps({"messages": msgs}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("store", STORES)
def test_extraction_of_long_samples_in_pieces_stores_what_whole_samples_store(
    tmp_path, tiny_qwen3, store
):
    """zarr parts are written in pieces of PIECE_ROWS; wds parts one task per sample: the
    stored payloads are the same bits. Batches of 8,192 tokens hold two long samples, so a
    piece's rows in the staged batch start after another sample's."""
    data = long_chats(tmp_path / "chats.jsonl")
    caches = {}
    for fmt in ("zarr", "wds"):
        out = tmp_path / fmt
        cfg = ExtractConfig(
            out=out, target=str(tiny_qwen3), data=(data,), gpus="cpu", rows_per_part=4,
            batch_tokens=8192, layers="0,2,3", writer_threads=3, format=fmt, store=store,
        )  # fmt: skip
        assert run(cfg).complete
        caches[fmt] = {
            s.sample_index: s
            for p in read_manifest(out).parts
            for s in open_part(out / p.name).iter_samples()
        }
    zarr, wds = caches["zarr"], caches["wds"]
    assert zarr.keys() == wds.keys()
    long = [row for row, s in zarr.items() if len(s.input_ids) > PIECE_ROWS]
    assert len(long) >= 3
    if store == "bf16":  # each piece's rows are its own sample's (both formats stage alike)
        for row in long:
            ref = reference_states(tiny_qwen3, zarr[row].input_ids, (0, 2, 3))
            got = zarr[row].hidden_tensor("cpu").float()
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    for row, s in zarr.items():
        np.testing.assert_array_equal(s.input_ids, wds[row].input_ids)
        np.testing.assert_array_equal(s.loss_mask, wds[row].loss_mask)
        np.testing.assert_array_equal(s.hidden, wds[row].hidden)
        if s.scale is not None:
            np.testing.assert_array_equal(s.scale, wds[row].scale)
