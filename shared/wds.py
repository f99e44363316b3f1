"""Webdataset parts: the records of a zarr part as tar members, for object stores and streaming.

A part is ``part-XXXXXX.tar``. Its first member, ``__part__``, holds the part's JSON attributes
(format version, store, layer count, hidden size, sample count); webdataset's tar iterator skips
names of that shape. Then per sample, with KEY = ``s{sample_index:012d}``:

    KEY.hidden.blosc   frames of the [L, K, W] payload (bf16 or e4m3 bits, int4 records), C order
    KEY.scale.npy      float32 [L, K] (fp8 store only)
    KEY.ids.npy        int32 [L]
    KEY.mask.npy       uint8 [L]
    KEY.json           sample_index, position, codec, length, shape, dtype, store, frames,
                       crc32c of the payload, arrays_crc32c of the .npy members' bytes (ids,
                       mask, scale; none in older parts) (codec: "planes" or "blosc" for bf16,
                       see `shared.codec`; none before "planes" existed: Blosc; "int4" for
                       int4 records; position: the sample's number n in the part, as a zarr
                       part stores it; none in older parts)

Members of one sample are adjacent; samples are in order of completion, which differs from run
to run and which readers do not rely on: a reader numbers a part's samples by position
(`canonical_order`), so a part trains the same whatever its tar's order, and as its zarr twin.
Compression happens in the writing thread (numcodecs releases the GIL), only the tar append is
serialised.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

import numpy as np

from shared.checksum import HashedFile, crc32c_hex
from shared.codec import (
    FORMAT_VERSION,
    Bf16Planes,
    c_contiguous,
    hidden_codec,
    payload_dtype,
)
from shared.fsio import named
from shared.part import PartReader, PartWriter, Sample
from shared.planes import merge_planes
from shared.wds_frames import compress_payload, decompress_payload
from shared.writeback import DROP_BEHIND_BYTES, WritebackError, drop_written, start_writeback

PART_MEMBER = "__part__"
_BASE_EXTS = ("hidden.blosc", "ids.npy", "mask.npy", "json")


def sample_key(sample_index: int) -> str:
    """Member key of a sample: no dots, sorts by source row."""
    return f"s{sample_index:012d}"


def required_exts(store: str) -> frozenset[str]:
    """Member extensions every sample of a part with this store has."""
    return frozenset(_BASE_EXTS + (("scale.npy",) if store == "fp8" else ()))


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _npy_load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _arrays_crc(members: dict[str, bytes]) -> str:
    """crc32c of a sample's .npy members (ids, mask, and scale where stored), in that order."""
    return crc32c_hex(b"".join(members.get(ext, b"") for ext in _ARRAY_EXTS))


_ARRAY_EXTS = ("ids.npy", "mask.npy", "scale.npy")


class WdsPartWriter(PartWriter):
    """Appends each sample's members to ``part-XXXXXX.tar.tmp`` as soon as it is written."""

    def __init__(self, final: Path, **kw) -> None:
        super().__init__(final, **kw)
        self._tar_lock = threading.Lock()
        self._broken = False
        self._file = HashedFile(open(self.tmp, "xb"))  # noqa: SIM115 (closed by commit/abort)
        # The tar's bytes before these offsets: their writeback started; their pages dropped.
        self._submitted = self._dropped = 0
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        meta = dict(
            format_version=FORMAT_VERSION,
            store=self.store,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_samples=len(self.lengths),
            **self.store_attrs(),
        )
        self._add(PART_MEMBER, json.dumps(meta).encode())

    def _add(self, name: str, data: bytes) -> None:
        # Fixed metadata (mtime 0, root owner) so identical content gives identical bytes.
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), 0, 0o644
        self._tar.addfile(info, io.BytesIO(data))

    def _store(self, n, sample_index, ids, mask, payload, scale, first) -> None:  # noqa: ANN001
        key = sample_key(sample_index)
        if isinstance(payload, Bf16Planes):  # its frames and checksum are of the uint16 bits
            payload = merge_planes(payload)
        payload = c_contiguous(payload)  # the tar stores [L, K, H] in C order
        codec = hidden_codec(self.store)
        split = 0 if self.scheme is None else self.scheme.int4_bytes
        frames = compress_payload(payload, codec, split)  # outside the lock: the expensive part
        meta = dict(
            sample_index=sample_index,
            position=n,
            codec=codec,
            length=len(ids),
            shape=list(payload.shape),
            dtype=str(payload.dtype),
            store=self.store,
            frames=[len(f) for f in frames],
            crc32c=crc32c_hex(payload),
        )
        arrays = {"ids.npy": _npy_bytes(ids), "mask.npy": _npy_bytes(mask)}
        if scale is not None:
            arrays["scale.npy"] = _npy_bytes(scale)
        meta["arrays_crc32c"] = _arrays_crc(arrays)
        members = [(f"{key}.hidden.blosc", b"".join(frames) if len(frames) > 1 else frames[0])]
        order = ("scale.npy", "ids.npy", "mask.npy")  # as parts have always held them
        members += [(f"{key}.{ext}", arrays[ext]) for ext in order if ext in arrays]
        members.append((f"{key}.json", json.dumps(meta).encode()))
        with self._tar_lock:
            try:
                for name, data in members:
                    self._add(name, data)
                # The tar's writeback starts now, not all at once at the commit's fsync: of the
                # bytes appended since the last start (an earlier sample's pages are not dropped
                # on overlayfs).
                self._file.flush()
                start, end = self._submitted, self._file.tell()
                start_writeback(self._file.fileno(), start, end - start)
                self._submitted = end
                # The pages of bytes appended long enough ago leave the page cache, as a zarr
                # part's files do.
                upto = (end - DROP_BEHIND_BYTES) & ~4095
                if upto > self._dropped:
                    self._drop(upto)
            except OSError as e:
                self._broken = True  # a half-appended sample: the tar cannot be committed
                raise named(e, self.tmp) from None
            except BaseException:
                self._broken = True
                raise

    def _finish(self) -> None:
        with self._tar_lock:
            if self._broken:
                raise RuntimeError(f"{self.tmp}: an append failed, the tar is incomplete")
            try:
                self._tar.close()
                self._file.flush()
            except OSError as e:
                raise named(e, self.tmp) from None
            try:
                os.fsync(self._file.fileno())
            except OSError as e:  # the disk failed bytes written before (a full disk below)
                raise WritebackError(e.errno, e.strerror, str(self.tmp)) from None
            self._drop(None)  # the rest, on the disk now: no page of a committed part stays
            self._file.close()

    def _drop(self, upto: int | None) -> None:
        """Drop the tar's pages up to `upto` (None: its end): whole pages, from 2 MB before the
        last drop's end, so that a large folio across it (kept then) goes this time."""
        first = max(0, self._dropped - (2 << 20)) & ~((2 << 20) - 1)
        size = 0 if upto is None else upto - first
        drop_written(self._file.fileno(), first, size, name=str(self.tmp))
        if upto is not None:
            self._dropped = upto

    def _known_files(self) -> dict[str, tuple[int, int]]:
        return {"": (self._file.size, self._file.crc)}

    def _close_quietly(self) -> None:
        with self._tar_lock:
            try:
                self._tar.close()
            finally:
                self._file.close()


def _read_part_meta(tar: tarfile.TarFile, path: Path) -> dict:
    first = tar.next()
    if first is None or first.name != PART_MEMBER:
        raise ValueError(f"{path}: first member is not {PART_MEMBER}: not a cache part")
    meta = json.loads(tar.extractfile(first).read())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    return meta


def iter_records(path: Path, required: frozenset[str]) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Stream (key, {ext: bytes}) in order of completion, whatever the member order.

    Raises ValueError at the end if some key never got all of ``required``.
    """
    pending: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(path, "r|") as tar:
            for info in tar:
                if not info.isfile() or info.name == PART_MEMBER:
                    continue
                key, _, ext = info.name.partition(".")
                pending.setdefault(key, {})[ext] = tar.extractfile(info).read()
                if required <= pending[key].keys():
                    yield key, pending.pop(key)
    except tarfile.TarError as e:
        raise ValueError(f"{path}: not a readable tar ({e}): damaged or cut short") from None
    if pending:
        raise ValueError(f"incomplete samples: {sorted(pending)[:5]}")


def canonical_order(records: Sequence[dict]) -> list[int]:
    """The stored positions (in the tar) of a part's samples n = 0, 1, ... (their JSON records,
    in stored order): by `position`; in parts written before it was recorded, longest first,
    ties by sample_index, the order extraction gave their writer.

    >>> canonical_order([{"position": 2}, {"position": 0}, {"position": 1}])
    [1, 2, 0]
    >>> canonical_order([{"length": 3, "sample_index": 9}, {"length": 5, "sample_index": 4},
    ...                  {"length": 3, "sample_index": 2}])
    [1, 2, 0]
    """
    if all("position" in r for r in records):
        return sorted(range(len(records)), key=lambda s: records[s]["position"])
    return sorted(
        range(len(records)), key=lambda s: (-records[s]["length"], records[s]["sample_index"])
    )


def _scan_json(tar: tarfile.TarFile, required: frozenset[str]) -> list[dict]:
    """The JSON record of every complete sample, in the order iter_records yields them."""
    seen: dict[str, set[str]] = {}
    found: dict[str, dict] = {}
    records = []
    for info in tar:
        if not info.isfile() or info.name == PART_MEMBER:
            continue
        key, _, ext = info.name.partition(".")
        seen.setdefault(key, set()).add(ext)
        if ext == "json":
            found[key] = json.loads(tar.extractfile(info).read())
        if required <= seen[key]:
            records.append(found[key])
            del seen[key]
    return records


class WdsPartReader(PartReader):
    """Streaming reader of a ``.tar`` part (no random access). Its samples are numbered in
    `canonical_order` (lengths, sample_indices and `iter_indexed`'s numbers), not the tar's."""

    def __init__(self, path: Path) -> None:
        try:
            with tarfile.open(path, "r:") as tar:  # seeks over payloads: headers and JSON only
                meta = _read_part_meta(tar, path)
                records = _scan_json(tar, required_exts(meta["store"]))
        except tarfile.TarError as e:  # verify and readers name a damaged part: a ValueError
            raise ValueError(f"{path}: not a readable tar ({e}): damaged or cut short") from None
        if len(records) != meta["num_samples"]:
            raise ValueError(
                f"{path}: {len(records)} of {meta['num_samples']} samples (truncated?)"
            )
        order = canonical_order(records)
        super().__init__(
            path,
            store=meta["store"],
            num_layers=int(meta["num_layers"]),
            hidden_size=int(meta["hidden_size"]),
            lengths=np.asarray([records[s]["length"] for s in order], dtype=np.int64),
            sample_indices=np.asarray([records[s]["sample_index"] for s in order], dtype=np.int64),
            int4=meta.get("int4"),
        )
        self._number = np.empty(len(order), dtype=np.int64)  # by stored position
        self._number[order] = np.arange(len(order))

    def decode(self, rec: dict[str, bytes], layers: np.ndarray | None = None) -> Sample:
        """A Sample from one key's members; raises ValueError if the payload's crc32c differs."""
        meta = json.loads(rec["json"])
        shape = (meta["length"], self.num_layers, self.width)
        hidden = decompress_payload(
            rec["hidden.blosc"],
            meta["frames"],
            payload_dtype(self.store),
            shape,
            meta.get("codec", "blosc"),  # samples written before `planes` name no codec
        )
        if crc32c_hex(hidden) != meta["crc32c"]:
            raise ValueError(f"{self.path.name} sample {meta['sample_index']}: crc32c mismatch")
        saved = meta.get("arrays_crc32c")  # none in parts written before it was recorded
        if saved is not None and _arrays_crc(rec) != saved:
            raise ValueError(
                f"{self.path.name} sample {meta['sample_index']}: crc32c mismatch of its "
                "token ids, loss mask or scales"
            )
        ids, mask = _npy_load(rec["ids.npy"]), _npy_load(rec["mask.npy"])
        scale = _npy_load(rec["scale.npy"]) if "scale.npy" in rec else None
        if ids.shape != shape[:1] or mask.shape != shape[:1]:
            raise ValueError(f"{self.path.name} sample {meta['sample_index']}: ids/mask shape")
        if scale is not None and scale.shape != shape[:2]:
            raise ValueError(f"{self.path.name} sample {meta['sample_index']}: scale shape")
        if layers is not None:
            hidden = hidden[:, layers]
            scale = None if scale is None else scale[:, layers]
        return Sample(
            sample_index=int(meta["sample_index"]),
            input_ids=ids,
            loss_mask=mask,
            hidden=hidden,
            scale=scale,
            scheme=self.scheme,
        )

    def iter_samples(self, layers: Sequence[int] | None = None) -> Iterator[Sample]:
        """The samples in the tar's order (a stream)."""
        pos = self.layer_positions(layers)
        for _, rec in iter_records(self.path, required_exts(self.store)):
            yield self.decode(rec, pos)

    def iter_indexed(
        self, layers: Sequence[int] | None = None, only: Collection[int] | None = None
    ) -> Iterator[tuple[int, Sample]]:
        """(n, sample n) in the tar's order; n numbers them as `lengths` does. With `only`, the
        samples numbered there: the others are passed over undecoded, and the walk ends at the
        last of them."""
        pos, left = self.layer_positions(layers), None if only is None else set(only)
        if left is not None and not left:
            return
        records = iter_records(self.path, required_exts(self.store))
        for stored, (_, rec) in enumerate(records):
            n = int(self._number[stored])
            if left is None:
                yield n, self.decode(rec, pos)
            elif n in left:
                left.discard(n)
                yield n, self.decode(rec, pos)
                if not left:
                    return


def verify_wds(path: Path) -> list[str]:
    """Problems of a .tar part: missing members, bad payloads, counts (see verify_part)."""
    try:
        reader = WdsPartReader(path)
    except Exception as e:  # a verifier reports, whatever broke
        return [f"cannot open: {type(e).__name__}: {e}"]
    problems, count = [], 0
    try:
        for key, rec in iter_records(path, required_exts(reader.store)):
            count += 1
            try:
                sample = reader.decode(rec)
            except Exception as e:
                problems.append(f"{key}: {type(e).__name__}: {e}")
                continue
            if key != sample_key(sample.sample_index) or len(sample.input_ids) == 0:
                problems.append(f"{key}: key, sample_index or length inconsistent")
    except Exception as e:
        problems.append(f"unreadable after {count} samples: {type(e).__name__}: {e}")
    if count != reader.num_samples:
        problems.append(f"{count} complete samples, the part lists {reader.num_samples}")
    if not _has_end_marker(path):
        problems.append("no end-of-archive marker: truncated")
    return problems


def _has_end_marker(path: Path) -> bool:
    """Whether two zero blocks follow the last member, as tarfile writes on close."""
    with tarfile.open(path, "r:") as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    with open(path, "rb") as f:
        f.seek(end)
        marker = f.read(2 * tarfile.BLOCKSIZE)
    return len(marker) == 2 * tarfile.BLOCKSIZE and not any(marker)
