"""webdataset parts: member order, truncation, damage, long payloads, webdataset compatibility."""

from __future__ import annotations

import io
import json
import random
import tarfile

import numpy as np
import pytest
import webdataset

from shared import wds, wds_frames
from shared.cache import open_part, verify_part
from shared.checksum import part_checksum
from tests.test_cache import K, assert_matches, make_records, write_part

LENGTHS = [5, 64, 70, 1]


@pytest.fixture(params=["bf16", "fp8"])
def part(tmp_path, request):
    records = make_records(lengths=LENGTHS)
    stats = write_part(tmp_path, 0, records, fmt="wds", store=request.param)
    return tmp_path / "part-000000.tar", records, stats, request.param


def rewrite_tar(src, dst, reorder) -> None:
    """Copy a tar with its members (after ``__part__``) in the order ``reorder`` gives."""
    with tarfile.open(src) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    head, rest = members[:1], reorder(members[1:])
    with tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as out:
        for info, data in head + rest:
            out.addfile(info, io.BytesIO(data))


def test_commit_checksum_from_the_written_bytes_equals_a_full_read(part):
    # The writer hashes every byte of the tar as it appends it; commit takes that hash instead
    # of reading the tar back (its pages may have left the page cache). It must equal a full
    # read, and a size that no longer matches the tar must make it read the tar.
    path, _, stats, _ = part
    assert part_checksum(path) == stats.checksum
    assert part_checksum(path, {"": (path.stat().st_size + 1, 0)}) == stats.checksum
    assert part_checksum(path, {"": (path.stat().st_size, 0)}) != stats.checksum  # taken as said


def test_members_and_keys(part):
    path, records, _, store = part
    with tarfile.open(path) as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile(names[0]).read())
        first = json.loads(tar.extractfile(f"s{records[0].sample_index:012d}.json").read())
    assert names[0] == wds.PART_MEMBER and meta["num_samples"] == len(records)
    exts = ["hidden.blosc", "ids.npy", "mask.npy", "json"] + (
        ["scale.npy"] if store == "fp8" else []
    )
    want = {f"s{r.sample_index:012d}.{e}" for r in records for e in exts}
    assert set(names[1:]) == want and len(names) == len(want) + 1
    assert first["length"] == LENGTHS[0] and first["shape"] == [LENGTHS[0], K, 64]
    assert first["store"] == store and first["crc32c"].startswith("crc32c:")


def test_reader_does_not_depend_on_member_order(part, tmp_path):
    path, records, _, store = part
    shuffled = tmp_path / "shuffled.tar"
    rewrite_tar(path, shuffled, lambda ms: random.Random(3).sample(ms, len(ms)))
    reader = open_part(shuffled)
    got = list(reader.iter_indexed(layers=[2, 0]))
    assert [s.sample_index for _, s in got] != [r.sample_index for r in records]  # shuffled
    assert sorted(n for n, _ in got) == list(range(len(records)))
    # numbered as written (the writer's n, a zarr part's order), whatever the tar's order
    assert reader.sample_indices.tolist() == [r.sample_index for r in records]
    assert reader.lengths.tolist() == [len(r.input_ids) for r in records]
    for n, s in got:
        assert_matches(s, records[n], store, [2, 0])
    assert verify_part(shuffled) == []


def test_random_access_is_refused_clearly(part):
    with pytest.raises(NotImplementedError, match="random access"):
        open_part(part[0]).read(0)


def test_webdataset_reads_the_part(part):
    path, records, _, store = part
    samples = list(webdataset.WebDataset(str(path), shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in samples] == [f"s{r.sample_index:012d}" for r in records]
    for s, r in zip(samples, records, strict=True):
        assert np.array_equal(np.load(io.BytesIO(s["ids.npy"])), r.input_ids)
        assert ("scale.npy" in s) == (store == "fp8")


def test_verify_catches_truncation_anywhere(part, tmp_path):
    path, _, stats, _ = part
    data = path.read_bytes()
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    boundary = members[-6].offset  # a member boundary, before the last sample's members
    end = members[-1].offset_data + 512  # the last member's data, without the end marker
    for cut in (boundary, members[-3].offset_data + 10, end, len(data) // 2):
        short = tmp_path / f"cut-{cut}.tar"
        short.write_bytes(data[:cut])
        assert verify_part(short) != [], cut
        assert verify_part(short, stats.checksum) != [], cut


def test_verify_and_reader_catch_a_flipped_payload_byte(part, tmp_path):
    path, _, stats, _ = part
    with tarfile.open(path) as tar:
        info = next(
            m for m in tar.getmembers() if m.name.endswith(".hidden.blosc") and m.size > 600
        )
    data = bytearray(path.read_bytes())
    data[info.offset_data + info.size - 40] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_part(path, stats.checksum)
    assert any("checksum" in p for p in problems)
    assert any(p.startswith(info.name.split(".")[0]) for p in problems)
    with pytest.raises(Exception):  # noqa: B017 - Blosc or the crc32c check, whichever sees it
        list(open_part(path))


@pytest.mark.parametrize("ext", ["ids.npy", "mask.npy", "scale.npy"])
def test_verify_and_reader_catch_damaged_ids_mask_or_scales(part, tmp_path, ext):
    """The .npy members have their own crc32c: a changed token id, mask byte or fp8 scale is
    named by sample, not trained on."""
    path, _, stats, store = part
    if ext == "scale.npy" and store != "fp8":
        pytest.skip("only fp8 parts store scales")
    with tarfile.open(path) as tar:
        info = next(m for m in tar.getmembers() if m.name.endswith(ext) and m.size > 130)
    data = bytearray(path.read_bytes())
    data[info.offset_data + info.size - 1] ^= 0x01  # the last element's low bits
    path.write_bytes(bytes(data))
    key = info.name.split(".")[0]
    problems = verify_part(path)  # no part checksum given: the sample's own check finds it
    assert any(p.startswith(key) and "token ids, loss mask or scales" in p for p in problems)
    with pytest.raises(ValueError, match="crc32c mismatch of its token ids"):
        list(open_part(path).iter_samples())


def test_long_payloads_are_split_into_frames(tmp_path, monkeypatch):
    monkeypatch.setattr(wds_frames, "FRAME_BYTES", 1000)  # Blosc's ~2 GiB limit, scaled down
    records = make_records(lengths=[9, 40])
    write_part(tmp_path, 0, records, fmt="wds", store="bf16")
    path = tmp_path / "part-000000.tar"
    with tarfile.open(path) as tar:
        meta = json.loads(tar.extractfile(f"s{records[1].sample_index:012d}.json").read())
    assert len(meta["frames"]) == -(-40 * K * 64 * 2 // 1000)
    for s, r in zip(open_part(path), records, strict=True):
        assert_matches(s, r, "bf16")
    assert verify_part(path) == []


def test_reading_some_samples_decodes_only_those(part):
    """`iter_indexed(only=...)` (a training worker's share of a tar) passes over the other
    samples undecoded: a damaged sample it does not want is none of its business."""
    path, records, _, store = part
    reader = open_part(path)
    with tarfile.open(path) as tar:
        members = tar.getmembers()
    keys = list(dict.fromkeys(m.name.split(".")[0] for m in members[1:]))  # the tar's order
    number = {wds.sample_key(i): n for n, i in enumerate(reader.sample_indices.tolist())}
    want = {number[keys[0]], number[keys[-1]]}
    payload = next(m for m in members if m.name == f"{keys[1]}.hidden.blosc")
    data = bytearray(path.read_bytes())
    data[payload.offset_data : payload.offset_data + payload.size] = bytes(payload.size)
    path.write_bytes(bytes(data))
    got = dict(open_part(path).iter_indexed(layers=[0], only=want))
    assert set(got) == want
    for n, s in got.items():
        assert_matches(s, records[n], store, [0])
    with pytest.raises(Exception):  # noqa: B017 - all of them: the zeroed payload is decoded
        list(open_part(path).iter_indexed())
