"""Cache parts in both formats: round trips, concurrency, commit/abort/crash, checksums."""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.cache import (
    PartStats,
    aligned_offsets,
    open_part,
    open_part_writer,
    part_name,
    verify_part,
)
from shared.checksum import part_checksum
from shared.codec import CHUNK_ROWS, FORMATS, STORES, payload_width, quantize_fp8
from shared.int4 import Int4Scheme, decode_int4, encode_int4

K, H, VOCAB = 3, 64, 300
LENGTHS = [5, 64, 70, 1, 130]


@dataclass
class Record:
    sample_index: int
    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden: torch.Tensor  # bf16 [L, K, H]


def make_records(lengths=LENGTHS, seed: int = 0, first_index: int = 1000) -> list[Record]:
    """Samples with a massive activation in each, as real targets have."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, length in enumerate(lengths):
        h = torch.randn(length, K, H, generator=g) * 3
        h[0, n % K, n % H] = 3000.0
        ids = torch.randint(0, VOCAB, (length,), generator=g).numpy().astype(np.int32)
        mask = (torch.rand(length, generator=g) > 0.3).numpy().astype(np.uint8)
        out.append(Record(first_index + 7 * n, ids, mask, h.to(torch.bfloat16)))
    return out


def write_part(
    out: Path, part_id: int, records, *, fmt: str, store: str, order=None, threads=1, io=None
):
    """Write records (in ``order``, from ``threads`` threads; file writes queued on ``io``) and
    commit; returns the stats."""
    writer = open_part_writer(
        out,
        part_id,
        fmt=fmt,
        store=store,
        num_layers=K,
        hidden_size=H,
        lengths=[len(r.input_ids) for r in records],
        io=io,
    )

    def one(n: int) -> None:
        r = records[n]
        writer.write(
            n, sample_index=r.sample_index, input_ids=r.input_ids, loss_mask=r.loss_mask,
            hidden=r.hidden,
        )  # fmt: skip

    order = list(range(len(records))) if order is None else order
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, order))
    return writer.commit()


def assert_matches(sample, record: Record, store: str, layers=None) -> None:
    layers = list(range(K)) if layers is None else list(layers)
    assert sample.sample_index == record.sample_index
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert np.array_equal(sample.input_ids, record.input_ids)
    assert np.array_equal(sample.loss_mask, record.loss_mask)
    got = sample.hidden_tensor("cpu")
    want = record.hidden[:, layers]
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    if store == "bf16":
        assert torch.equal(got, want)
    elif store == "int4":  # the records come back byte for byte: decoded as if never stored
        scheme = Int4Scheme(hidden=H)
        assert torch.equal(got, decode_int4(encode_int4(want, scheme), scheme))
    else:
        # e4m3 rounding (2^-4 relative, or half a subnormal step 2^-10 * scale near zero) plus
        # the bf16 rounding of the dequantised value.
        scale = want.float().abs().amax(-1, True) / 448
        bound = want.float().abs() * (2.0**-4 + 2.0**-8) + scale * 2.0**-10
        assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", STORES)
def test_round_trip_all_layers_and_subsets(tmp_path, fmt, store):
    records = make_records()
    stats = write_part(tmp_path, 3, records, fmt=fmt, store=store)
    path = tmp_path / part_name(3, fmt)
    assert path.exists() and not list(tmp_path.glob("*.tmp"))
    tokens = sum(LENGTHS)
    supervised = int(sum(r.loss_mask.sum() for r in records))
    stored = int(aligned_offsets(LENGTHS)[-1]) if fmt == "zarr" else tokens
    assert stats == PartStats(
        rows=len(records),
        tokens=tokens,
        supervised_tokens=supervised,
        stored_rows=stored,
        nbytes=stats.nbytes,
        checksum=part_checksum(path),
    )
    assert stats.nbytes > 0
    reader = open_part(path)
    assert (reader.store, reader.num_layers, reader.hidden_size) == (store, K, H)
    assert reader.num_samples == len(records) and reader.tokens == tokens
    assert reader.lengths.tolist() == LENGTHS
    assert reader.sample_indices.tolist() == [r.sample_index for r in records]
    for sample, record in zip(reader, records, strict=True):
        assert_matches(sample, record, store)
    for layers in ([1], [2, 0], [0, 2, 1]):
        samples = list(reader.iter_samples(layers=layers))
        assert len(samples) == len(records)
        for sample, record in zip(samples, records, strict=True):
            width = payload_width(store, H)
            assert sample.hidden.shape == (len(record.input_ids), len(layers), width)
            assert_matches(sample, record, store, layers)
    with pytest.raises(IndexError):
        next(reader.iter_samples(layers=[K]))
    assert verify_part(path, stats.checksum) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_accepts_tensors_quantised_by_the_caller(tmp_path, fmt):
    records = make_records(lengths=[9, 66])
    here = write_part(tmp_path / "here", 0, records, fmt=fmt, store="fp8")
    writer = open_part_writer(
        tmp_path / "caller", 0, fmt=fmt, store="fp8", num_layers=K, hidden_size=H, lengths=[9, 66]
    )
    for n, r in enumerate(records):
        q, scale = quantize_fp8(r.hidden)
        writer.write(
            n, sample_index=r.sample_index, input_ids=r.input_ids, loss_mask=r.loss_mask,
            hidden=(q, scale),
        )  # fmt: skip
    assert writer.commit().checksum == here.checksum


@pytest.mark.parametrize("fmt", FORMATS)
def test_concurrent_writes_in_random_order(tmp_path, fmt):
    records = make_records(lengths=[3, 200, 64, 65, 17, 128, 1, 90], seed=1)
    order = list(range(len(records)))
    random.Random(0).shuffle(order)
    stats = write_part(tmp_path, 0, records, fmt=fmt, store="bf16", order=order, threads=4)
    reader = open_part(tmp_path / part_name(0, fmt))
    got = list(reader.iter_indexed())
    assert sorted(n for n, _ in got) == list(range(len(records)))
    # numbered as written (n), whatever order the threads finished in
    assert reader.sample_indices.tolist() == [r.sample_index for r in records]
    assert reader.lengths.tolist() == [len(r.input_ids) for r in records]
    for n, sample in got:
        assert_matches(sample, records[n], "bf16")
    assert verify_part(reader.path, stats.checksum) == []
    if fmt == "zarr":  # the layout, hence every file, does not depend on the write order
        sequential = write_part(tmp_path / "seq", 0, records, fmt=fmt, store="bf16")
        assert sequential.checksum == stats.checksum


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", STORES)
def test_checksum_is_stable_across_identical_writes(tmp_path, fmt, store):
    records = make_records(lengths=[4, 80])
    one = write_part(tmp_path / "one", 5, records, fmt=fmt, store=store)
    two = write_part(tmp_path / "two", 5, records, fmt=fmt, store=store)
    assert one == two
    other = make_records(lengths=[4, 80], seed=9)
    assert write_part(tmp_path / "three", 5, other, fmt=fmt, store=store).checksum != one.checksum


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", STORES)
def test_empty_part_round_trips(tmp_path, fmt, store):
    stats = write_part(tmp_path, 7, [], fmt=fmt, store=store)
    assert (stats.rows, stats.tokens, stats.supervised_tokens, stats.stored_rows) == (0, 0, 0, 0)
    reader = open_part(tmp_path / part_name(7, fmt))
    assert reader.num_samples == 0 and reader.tokens == 0 and list(reader) == []
    assert (reader.store, reader.num_layers, reader.hidden_size) == (store, K, H)
    assert verify_part(reader.path, stats.checksum) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_commit_refuses_missing_samples_and_abort_removes_tmp(tmp_path, fmt):
    records = make_records(lengths=[6, 7])
    writer = open_part_writer(
        tmp_path, 1, fmt=fmt, store="bf16", num_layers=K, hidden_size=H, lengths=[6, 7]
    )
    r = records[1]
    writer.write(1, sample_index=r.sample_index, input_ids=r.input_ids, loss_mask=r.loss_mask,
                 hidden=r.hidden)  # fmt: skip
    with pytest.raises(RuntimeError, match="missing"):
        writer.commit()
    with pytest.raises(RuntimeError, match="already written"):
        writer.write(1, sample_index=5, input_ids=r.input_ids, loss_mask=r.loss_mask,
                     hidden=r.hidden)  # fmt: skip
    assert writer.tmp.exists() and not writer.final.exists()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_crash_leftover_is_removed_and_an_unrecorded_part_replaced(tmp_path, fmt):
    records = make_records(lengths=[6, 7])
    old = write_part(tmp_path, 2, make_records(lengths=[6, 7], seed=5), fmt=fmt, store="bf16")
    crashed = open_part_writer(
        tmp_path, 2, fmt=fmt, store="bf16", num_layers=K, hidden_size=H, lengths=[6, 7]
    )
    r = records[0]
    crashed.write(0, sample_index=r.sample_index, input_ids=r.input_ids, loss_mask=r.loss_mask,
                  hidden=r.hidden)  # fmt: skip
    del crashed  # a crash: neither commit nor abort
    leftovers = list(tmp_path.glob("*.tmp"))
    assert len(leftovers) == 1
    stats = write_part(tmp_path, 2, records, fmt=fmt, store="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == [part_name(2, fmt)]
    assert stats.checksum != old.checksum
    assert [s.sample_index for s in open_part(tmp_path / part_name(2, fmt))] == [
        r.sample_index for r in records
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_context_manager_aborts_on_error_and_bad_inputs_are_refused(tmp_path, fmt):
    r = make_records(lengths=[6])[0]
    kw = dict(fmt=fmt, store="bf16", num_layers=K, hidden_size=H, lengths=[6])
    with pytest.raises(ValueError, match="input_ids"):
        with open_part_writer(tmp_path, 0, **kw) as writer:
            writer.write(0, sample_index=1, input_ids=r.input_ids[:5], loss_mask=r.loss_mask,
                         hidden=r.hidden)  # fmt: skip
    assert list(tmp_path.iterdir()) == []
    with open_part_writer(tmp_path, 0, **kw) as writer:
        with pytest.raises(TypeError):
            writer.write(0, sample_index=1, input_ids=r.input_ids, loss_mask=r.loss_mask,
                         hidden=r.hidden.float())  # fmt: skip
        with pytest.raises(ValueError, match="hidden"):
            writer.write(0, sample_index=1, input_ids=r.input_ids, loss_mask=r.loss_mask,
                         hidden=r.hidden[:, :2])  # fmt: skip
        with pytest.raises(IndexError):
            writer.write(1, sample_index=1, input_ids=r.input_ids, loss_mask=r.loss_mask,
                         hidden=r.hidden)  # fmt: skip
        writer.abort()
    with pytest.raises(ValueError, match="length"):
        open_part_writer(tmp_path, 0, **{**kw, "lengths": [3, 0]})
    with pytest.raises(ValueError, match="fmt"):
        open_part_writer(tmp_path, 0, **{**kw, "fmt": "hdf5"})


def test_part_names_and_aligned_offsets():
    assert part_name(123, "zarr") == "part-000123"
    assert part_name(123, "wds") == "part-000123.tar"
    offsets = aligned_offsets(LENGTHS)
    assert offsets.dtype == np.int64 and len(offsets) == len(LENGTHS) + 1
    assert (offsets % CHUNK_ROWS == 0).all()
    gaps = np.diff(offsets)
    assert (gaps >= LENGTHS).all() and (gaps - LENGTHS < CHUNK_ROWS).all()
    assert aligned_offsets([]).tolist() == [0]


@pytest.mark.parametrize("syncfs", [True, False], ids=["syncfs", "fsync-per-file"])
def test_both_durability_paths_commit_the_same_part(tmp_path, monkeypatch, syncfs):
    # Platforms without syncfs(2) fsync every file and folder instead: same part, same checksum.
    import shared.writeback as writeback

    records = make_records(lengths=[4, 80, 70])
    reference = write_part(tmp_path / "ref", 2, records, fmt="zarr", store="bf16")
    if syncfs:
        assert writeback._syncfs(tmp_path) == sys.platform.startswith("linux")
    else:
        monkeypatch.setattr(writeback, "_syncfs", lambda path, fd=None: False)
    stats = write_part(tmp_path / "p", 2, records, fmt="zarr", store="bf16")
    assert stats == reference
    assert verify_part(tmp_path / "p" / part_name(2, "zarr"), stats.checksum) == []


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_early_writeback_leaves_the_part_unchanged(tmp_path, monkeypatch, fmt):
    # The writers start each file's writeback as they go; with it off (or on a platform with
    # neither sync_file_range nor posix_fadvise) the committed part is byte-for-byte the same.
    import os

    import shared.writeback as writeback
    import shared.zarr_part as zarr_part

    records = make_records(lengths=[4, 80, 70])
    early = write_part(tmp_path / "early", 3, records, fmt=fmt, store="bf16")
    monkeypatch.setattr(zarr_part, "EARLY_WRITEBACK", False)
    monkeypatch.setattr(writeback, "_sync_file_range", lambda: None)
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    late = write_part(tmp_path / "late", 3, records, fmt=fmt, store="bf16")
    assert early == late
    assert verify_part(tmp_path / "early" / part_name(3, fmt), early.checksum) == []


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_layer_major_views_give_the_same_part_as_contiguous_samples(tmp_path, fmt, store):
    # Extraction hands the writers [L, K, H] views of layer-major [K, L, H] memory (no host
    # copy); the committed part must be byte-identical to one written from C-order samples.
    records = make_records(lengths=[4, 64, 70, 130])
    reference = write_part(tmp_path / "rows", 4, records, fmt=fmt, store=store)
    views = [
        Record(
            r.sample_index,
            r.input_ids,
            r.loss_mask,
            r.hidden.transpose(0, 1).contiguous().transpose(0, 1),
        )  # fmt: skip
        for r in records
    ]
    assert not views[1].hidden.is_contiguous()
    stats = write_part(tmp_path / "layers", 4, views, fmt=fmt, store=store)
    assert stats == reference


@pytest.mark.parametrize("dtype", [np.uint16, np.uint8, np.float32, np.float64])
def test_c_contiguous_copies_strided_arrays_exactly(dtype):
    from shared.codec import c_contiguous

    a = (np.arange(2 * 5 * 7) % 251).astype(dtype).reshape(2, 5, 7)
    strided = a.transpose(1, 0, 2)
    out = c_contiguous(strided)
    assert out.flags.c_contiguous and out.dtype == a.dtype
    assert np.array_equal(out, strided)
    assert c_contiguous(a) is a  # already C order: no copy
