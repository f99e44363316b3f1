"""zarr parts: layout on disk, random access, per-layer chunks, verification."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import zarr

from shared.cache import layout_problems, open_part, verify_part
from shared.checksum import part_checksum
from shared.codec import CHUNK_ROWS
from tests.test_cache import LENGTHS, H, K, assert_matches, make_records, write_part


@pytest.fixture
def part(tmp_path):
    records = make_records()
    stats = write_part(tmp_path, 0, records, fmt="zarr", store="bf16")
    return tmp_path / "part-000000", records, stats


def shard_file(path, row: int):
    return path / "hidden" / f"c.{row // CHUNK_ROWS}.0.0"


def flip_byte(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def inner_chunk_range(shard, layer: int) -> tuple[int, int]:
    """(offset, nbytes) of one layer's inner chunk, from the shard index at the end of the file
    (zarr v3 sharding: uint64 pairs per inner chunk, then a 4-byte crc32c)."""
    index = np.frombuffer(shard.read_bytes()[-(16 * K + 4) : -4], dtype="<u8").reshape(K, 2)
    return int(index[layer, 0]), int(index[layer, 1])


def test_samples_start_on_chunk_boundaries_and_padding_is_zero(part):
    path, records, _ = part
    reader = open_part(path)
    offsets = reader.offsets
    assert (offsets % CHUNK_ROWS == 0).all() and offsets[-1] % CHUNK_ROWS == 0
    assert layout_problems(offsets, reader.lengths, int(offsets[-1])) == []
    hidden = zarr.open_group(path, mode="r")["hidden"]
    assert hidden.shape == (offsets[-1], K, H) and hidden.dtype == np.uint16
    for n, length in enumerate(LENGTHS):
        assert not hidden[offsets[n] + length : offsets[n + 1]].any()
    attrs = dict(zarr.open_group(path, mode="r").attrs)
    assert attrs["format_version"] == 1 and attrs["store"] == "bf16"
    assert (attrs["num_layers"], attrs["hidden_size"]) == (K, H)


def test_random_access_in_any_order(part):
    path, records, _ = part
    reader = open_part(path)
    for n in (4, 0, 2, 2, 3, 1):
        assert_matches(reader.read(n), records[n], "bf16")
        assert_matches(reader.read(n, layers=[2, 0]), records[n], "bf16", [2, 0])
    with pytest.raises(IndexError):
        reader.read(len(LENGTHS))


def test_reading_one_layer_does_not_decode_the_others(part):
    path, records, stats = part
    shard = shard_file(path, row=0)
    offset, nbytes = inner_chunk_range(shard, layer=1)
    flip_byte(shard, offset + nbytes // 2)
    reader = open_part(path)
    assert_matches(reader.read(0, layers=[0, 2]), records[0], "bf16", [0, 2])
    assert_matches(reader.read(1), records[1], "bf16")
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        reader.read(0, layers=[1])
    problems = verify_part(path, stats.checksum)
    assert any("checksum" in p and "expected" in p for p in problems)
    assert any("hidden rows 0.." in p for p in problems)
    assert any("hidden rows" in p for p in verify_part(path))


def test_verify_catches_a_flipped_byte_anywhere_in_a_chunk_file(part):
    path, _, stats = part
    assert verify_part(path, stats.checksum) == []
    shard = shard_file(path, row=int(open_part(path).offsets[4]))
    flip_byte(shard, shard.stat().st_size // 3)
    assert len(verify_part(path, stats.checksum)) >= 2  # checksum and the chunk itself
    assert verify_part(path, None) != []


def test_verify_catches_a_missing_shard_and_a_damaged_small_array(part, tmp_path):
    path, _, stats = part
    shard_file(path, row=64).unlink()
    assert any("chunks" in p for p in verify_part(path))
    ids = next((path / "input_ids").rglob("c/*"))
    flip_byte(ids, ids.stat().st_size - 10)
    assert any(p.startswith("input_ids: ") for p in verify_part(path))
    assert verify_part(tmp_path / "part-000999") != []


def test_layout_problems():
    lengths = np.array([5, 70])
    assert layout_problems(np.array([0, 64, 192]), lengths, 192) == []
    assert layout_problems(np.array([0, 64]), lengths, 192) != []  # wrong count
    assert any("aligned" in p for p in layout_problems(np.array([0, 65, 192]), lengths, 256))
    assert any("overlap" in p for p in layout_problems(np.array([0, 64, 128]), lengths, 256))
    assert any("beyond" in p for p in layout_problems(np.array([0, 64, 192]), lengths, 128))
    assert any(
        "non-positive" in p for p in layout_problems(np.array([0, 64, 128]), lengths * 0, 128)
    )


def test_write_buffers_survives_short_writes(tmp_path, monkeypatch):
    # os.writev may write less than asked (signals, pipes, some file systems): the rest follows.
    import os

    from shared.zarr_part import write_buffers

    buffers = [bytes(range(7)), b"", bytes(range(100, 140)), b"xyz"]
    real = os.writev

    def at_most_five_bytes(fd, bufs):
        return real(fd, [bytes(bufs[0])[:5]])

    monkeypatch.setattr(os, "writev", at_most_five_bytes)
    write_buffers(tmp_path / "f", buffers)
    assert (tmp_path / "f").read_bytes() == b"".join(buffers)


def test_commit_checksum_from_written_files_equals_a_full_read(part):
    # The writer hashes each shard file as it writes it; commit combines those hashes instead of
    # reading the part back. It must equal a full read, and a size that no longer matches the
    # file on disk must make it read that file.
    path, _, stats = part
    assert part_checksum(path) == stats.checksum
    rel = shard_file(path, 0).relative_to(path).as_posix()
    stale = {rel: (shard_file(path, 0).stat().st_size + 1, 0)}
    assert part_checksum(path, stale) == stats.checksum


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_every_shard_is_checked_directly_on_any_number_of_threads(tmp_path, store):
    """verify_zarr checks each shard's index and chunks itself (zarr reads the first and last):
    a damaged index, chunk or file length anywhere is found, the same on 1 and 4 threads."""
    from shared.zarr_part import verify_zarr

    write_part(tmp_path, 0, make_records(), fmt="zarr", store=store)
    path = tmp_path / "part-000000"
    assert verify_zarr(path, threads=4) == []
    middle = int(open_part(path).offsets[2])
    index_shard, chunk_shard = shard_file(path, middle), shard_file(path, middle + CHUNK_ROWS)
    flip_byte(index_shard, index_shard.stat().st_size - 10)  # inside the index
    offset, nbytes = inner_chunk_range(chunk_shard, layer=K - 1)
    flip_byte(chunk_shard, offset + nbytes // 2)
    found = verify_zarr(path, threads=4)
    assert found == verify_zarr(path, threads=1)
    rows = [f"hidden rows {r}..{r + CHUNK_ROWS}" for r in (middle, middle + CHUNK_ROWS)]
    assert found == [f"{rows[0]}: the shard index fails its crc32c checksum",
                     f"{rows[1]}: layer {K - 1}'s chunk fails its crc32c checksum"]  # fmt: skip
    last = shard_file(path, int(open_part(path).offsets[-1]) - 1)
    last.write_bytes(last.read_bytes()[:50])
    assert any("shorter than its index" in p for p in verify_zarr(path))


def test_a_layout_other_than_ours_is_decoded_through_zarr(part, monkeypatch):
    from shared import zarr_part

    path, _, _ = part
    monkeypatch.setattr(zarr_part, "inner_codec", lambda *a: None)
    assert zarr_part.verify_zarr(path) == []
    shard = shard_file(path, row=0)
    offset, nbytes = inner_chunk_range(shard, layer=1)
    flip_byte(shard, offset + nbytes // 2)
    assert any(p.startswith("hidden rows 0..1024") for p in zarr_part.verify_zarr(path))


def to_folder_keys(path) -> None:
    """Make a part as parts were written before flat keys: each shard file at `c/<i>/0/0` (two
    folders of its own), the hidden array's metadata naming '/' as its keys' separator."""
    meta = path / "hidden" / "zarr.json"
    m = json.loads(meta.read_text())
    m["chunk_key_encoding"]["configuration"]["separator"] = "/"
    meta.write_text(json.dumps(m))
    for f in (path / "hidden").glob("c.*"):
        dest = path / "hidden" / "c" / f.name.split(".")[1] / "0" / "0"
        dest.parent.mkdir(parents=True)
        f.rename(dest)


@pytest.mark.parametrize(
    ("store", "separator"), [("bf16", "."), ("fp8", "."), ("int4", "."), ("bf16", "/")]
)
def test_direct_shard_reads_equal_zarr_reads(tmp_path, store, separator):
    """The reader decodes our shards itself (`ShardFiles`); every sample and layer subset equals
    zarr's own read of the same rows, in parts whose shard files are all in the array's folder
    (`c.<i>.0.0`) and in parts written before that (`c/<i>/0/0`), which verify reads too."""
    records = make_records()
    write_part(tmp_path, 0, records, fmt="zarr", store=store)
    path = tmp_path / "part-000000"
    if separator == "/":
        to_folder_keys(path)
    files = {p.relative_to(path).as_posix() for p in (path / "hidden").rglob("*") if p.is_file()}
    shards = -(-int(open_part(path).offsets[-1]) // CHUNK_ROWS)
    keys = [separator.join(["c", str(i), "0", "0"]) for i in range(shards)]
    assert files == {"hidden/zarr.json", *(f"hidden/{key}" for key in keys)}
    reader = open_part(path)
    assert reader._shards is not None  # the direct path is the one under test
    assert verify_part(path) == []
    for n, record in enumerate(records):
        assert_matches(reader.read(n), record, store)
    hidden = zarr.open_group(path, mode="r")["hidden"]
    for n in range(reader.num_samples):
        start = int(reader.offsets[n])
        rows = slice(start, start + int(reader.lengths[n]))
        for layers in (None, [2, 0], [K - 1]):
            got = reader.read(n, layers=layers).hidden
            want = hidden[rows] if layers is None else hidden.oindex[rows, layers]
            assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_missing_shard_is_an_error_not_zeros(part):
    path, _, _ = part
    reader = open_part(path)
    shard_file(path, row=int(reader.offsets[1])).unlink()
    reader.read(0)
    with pytest.raises(FileNotFoundError):
        reader.read(1)


@pytest.mark.parametrize("name", ["input_ids", "loss_mask", "offsets", "sample_index", "scale"])
def test_a_small_arrays_missing_chunk_is_damage_not_zeros(tmp_path, name):
    """zarr reads a missing chunk file as zeros: every chunk is written, zeros too (a loss
    mask of zeros here), so that opening the part refuses a missing one and verify names it."""
    records = [replace(r, loss_mask=np.zeros_like(r.loss_mask)) for r in make_records()]
    write_part(tmp_path, 0, records, fmt="zarr", store="fp8")
    path = tmp_path / "part-000000"
    reader = open_part(path)  # every chunk there, zeros too
    for n, record in enumerate(records):
        assert_matches(reader.read(n), record, store="fp8")
    for chunk in (path / name / "c").rglob("*"):
        if chunk.is_file():
            chunk.unlink()
    with pytest.raises(ValueError, match=f"{name} has 0 of 1 chunks.*: the part is damaged"):
        open_part(path)
    assert f"{name} has 0 of 1 chunks" in verify_part(path)
