"""The `planes` bf16 codec: bit-exact round trips, smaller than Blosc's byte shuffle on
activation-like values, and caches written with the earlier Blosc codec still read."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from shared import codec, planes
from shared.cache import open_part
from shared.codec import blosc_compressor
from shared.planes import planes_compress, planes_decompress
from tests.test_cache import assert_matches, make_records, write_part


def test_every_bf16_bit_pattern_round_trips():
    rng = np.random.default_rng(0)
    every = np.arange(1 << 16, dtype=np.uint16)
    for a in (every, rng.permutation(every), every[:7], every[:0]):
        assert np.array_equal(planes_decompress(planes_compress(a)), a)
    out = np.empty(every.size, np.uint16)
    assert planes_decompress(planes_compress(every), out=out) is out
    assert np.array_equal(out, every)
    with pytest.raises(ValueError):
        planes_decompress(planes_compress(every), out=np.empty(10, np.uint16))


def test_strided_input_gives_the_bytes_of_its_copy():
    a = (torch.randn(64, 3, 96) * 5).to(torch.bfloat16).view(torch.uint16).numpy()
    layer = a[:, 1]  # not contiguous
    assert planes_compress(layer) == planes_compress(np.ascontiguousarray(layer))


def test_planes_beat_byte_shuffle_on_activation_like_values():
    """Few distinct exponents (a Gaussian) and a few massive channels, as in real activations."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 576, generator=g) * 0.5
    h[:, [3, 77]] *= 2000
    a = h.to(torch.bfloat16).view(torch.uint16).numpy()
    assert len(planes_compress(a)) < 0.95 * len(blosc_compressor(2)(a))


def _old_and_new_parts_read(tmp_path, monkeypatch, fmt: str) -> None:
    """A part written under the monkeypatched (earlier) codec, then the patch undone and one
    written with today's: both read back bit for bit, in tmp_path/old and tmp_path/new."""
    records = make_records()
    write_part(tmp_path / "old", 0, records, fmt=fmt, store="bf16")
    monkeypatch.undo()
    write_part(tmp_path / "new", 0, records, fmt=fmt, store="bf16")
    for cache in ("old", "new"):
        reader = open_part(next((tmp_path / cache).glob("part-000000*")))
        for n, r in enumerate(records):
            assert_matches(reader.read(n) if fmt == "zarr" else list(reader)[n], r, "bf16")


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_parts_written_with_blosc_still_read(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(codec, "BF16_CODEC", "blosc")
    _old_and_new_parts_read(tmp_path, monkeypatch, fmt)
    if fmt == "zarr":
        meta = [
            json.loads((tmp_path / c / "part-000000" / "hidden" / "zarr.json").read_text())
            for c in ("old", "new")
        ]
        names = [[x["name"] for x in m["codecs"][0]["configuration"]["codecs"]] for m in meta]
        assert "blosc" in names[0] and "dflash_offline.planes" in names[1]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint16).numpy()


def test_split_planes_equals_the_host_split_on_every_bit_pattern(monkeypatch):
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    want = planes_compress(_bits(every))
    monkeypatch.setattr(planes, "SPLIT_ELEMENTS", 1000)  # several steps, the last one short
    for shape in ((1 << 16,), (256, 16, 16)):
        split = planes.split_planes(every.reshape(shape))
        assert split.shape == shape and split.exponent.dtype == torch.uint8
        assert b"".join(planes.planes_frames(_numpy(split))) == want
        assert np.array_equal(planes.merge_planes(_numpy(split)), _bits(every).reshape(shape))
    with pytest.raises(TypeError):
        planes.split_planes(every.float())


def _numpy(p: codec.Bf16Planes) -> codec.Bf16Planes:
    return codec.Bf16Planes(p.exponent.numpy(), p.sign_mantissa.numpy())


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_parts_written_from_planes_equal_parts_written_from_values(tmp_path, fmt):
    """What extraction stages (planes split on the device, layer-major [K, N, H] views) gives
    the same files, byte for byte, as the bf16 values."""
    records = make_records()
    as_planes = []
    for r in records:
        p = planes.split_planes(r.hidden.transpose(0, 1).contiguous())  # layer-major, as staged
        e, sm = p.exponent.transpose(0, 1), p.sign_mantissa.transpose(0, 1)
        as_planes.append(replace(r, hidden=codec.Bf16Planes(e, sm)))
    threads = 3 if fmt == "zarr" else 1  # a tar's member order is the order of the writes
    stats = [
        write_part(tmp_path / "planes", 0, as_planes, fmt=fmt, store="bf16", threads=threads),
        write_part(tmp_path / "values2", 0, records, fmt=fmt, store="bf16", threads=threads),
    ]
    assert stats[0].checksum == stats[1].checksum and stats[0].nbytes == stats[1].nbytes
    reader = open_part(next((tmp_path / "planes").glob("part-000000*")))
    for n, r in enumerate(records):
        assert_matches(reader.read(n) if fmt == "zarr" else list(reader)[n], r, "bf16")


def test_planes_are_refused_where_they_do_not_fit(tmp_path):
    r = make_records()[0]
    p = planes.split_planes(r.hidden)
    shape = tuple(r.hidden.shape)
    with pytest.raises(TypeError, match="only accepted by store 'bf16'"):
        codec.encode_hidden(p, "fp8", shape)
    with pytest.raises(ValueError, match="exponent plane must be uint8"):
        codec.encode_hidden(codec.Bf16Planes(p.exponent[1:], p.sign_mantissa), "bf16", shape)


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_planes_parts_with_blosc_exponent_frames_still_read(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(planes, "exponent_frame", planes.blosc_exponent_frame)
    _old_and_new_parts_read(tmp_path, monkeypatch, fmt)


def test_exponent_frames_are_zstd_and_smaller_than_blosc_on_activation_like_values():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(64, 576, generator=g) * 0.5
    h[:, [3, 77]] *= 2000
    split = planes.split_planes(h.to(torch.bfloat16))
    exponent = split.exponent.numpy().reshape(-1)
    frame = planes.exponent_frame(exponent)
    assert frame[:4] == codec.ZSTD_MAGIC
    assert len(frame) < len(planes.blosc_exponent_frame(exponent))
    every = np.arange(1 << 16, dtype=np.uint16)
    assert planes_compress(every)[4:8] == codec.ZSTD_MAGIC
