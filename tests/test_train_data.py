"""The streaming loader on a tiny synthetic cache: packed rows, contents, layer order, resume,
workers, damaged parts."""

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from shared.cache import open_part
from shared.codec import FORMATS
from shared.int4 import Int4Scheme, decode_int4, encode_int4
from shared.manifest import read_manifest
from tests.cachegen import write_cache
from train.data.catalog import load_catalog
from train.data.loader import (
    CacheReadError,
    LoaderState,
    PlanDataset,
    checked,
    collate_row,
    device_batch,
    layer_positions,
    make_loader,
)
from train.data.plan import PlanSpec, SampleRef, plan_rows, worker_rows

ROW = 640


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=4, samples_per_part=5)


def _spec(parts, **kw):
    base = dict(lengths=tuple(p.lengths for p in parts), seed=5, row_tokens=ROW, shuffle_buffer=3)
    return PlanSpec(**{**base, **kw})


def _catalog(cache):
    parts, problems = load_catalog(cache, read_manifest(cache))
    assert problems == []
    return parts


def _real(items):
    return [it for it in items if it["real"]]


def _dataset(parts, spec, *, world=1, rank=0, workers=1, epochs=1, **kw):
    limits = {e: len(plan_rows(spec, epoch=e)) // world for e in range(epochs)}
    return PlanDataset(
        parts, spec, rank=rank, world_size=world, workers=workers, limits=limits, **kw
    )


def test_layer_positions():
    assert layer_positions([1, 9, 17], [17, 1]) == (2, 0)


def test_loader_state_rolls_over_and_checks_the_world():
    s = LoaderState()
    for _ in range(3):
        s = s.advance([3, 5])
    assert s == LoaderState(1, 0)
    d = s.advance([3, 5]).to_dict(world_size=2, workers=1)
    assert LoaderState.from_dict(d, world_size=2, workers=1) == LoaderState(1, 1)
    with pytest.raises(ValueError, match="2 ranks x 1 workers"):
        LoaderState.from_dict(d, world_size=1, workers=1)
    with pytest.raises(ValueError, match="older version"):
        LoaderState.from_dict({**d, "version": 1}, world_size=2, workers=1)


def test_collate_row_packs_samples_back_to_back(cache):
    reader = open_part(cache / "part-000000")
    samples = [reader.read(0), reader.read(1)]
    n0 = int(reader.lengths[0])
    refs = [SampleRef(0, 0, n0), SampleRef(0, 1, 20)]  # the second clipped to 20 tokens
    out = collate_row(samples, refs, row_tokens=n0 + 30)
    assert out["ids"].shape == (1, n0 + 30) and int(out["tokens"]) == n0 + 20
    assert out["ids"][0, :n0].tolist() == samples[0].input_ids.tolist()
    assert out["ids"][0, n0 : n0 + 20].tolist() == samples[1].input_ids[:20].tolist()
    assert out["doc_ids"][0].tolist() == [0] * n0 + [1] * 20 + [-1] * 10
    assert out["positions"][0].tolist() == list(range(n0)) + list(range(20)) + [0] * 10
    assert torch.equal(out["hidden"][0, :n0], samples[0].hidden_tensor())
    assert (
        out["hidden"][0, n0 + 20 :].abs().sum() == 0 and out["loss_mask"][0, n0 + 20 :].sum() == 0
    )
    assert out["hidden"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exceeds"):
        collate_row(samples, refs, row_tokens=n0)


def test_one_epoch_yields_every_sample_once_with_its_content(cache):
    parts = _catalog(cache)
    spec = _spec(parts)
    rows = plan_rows(spec, epoch=0)
    items = _real(list(_dataset(parts, spec, layers=(2, 0))))
    assert len(items) == len(rows)
    seen = set()
    readers = {p.path: open_part(p.path) for p in parts}
    for item, refs in zip(items, rows, strict=True):
        assert item["ids"].shape == (1, ROW)  # one shape for every row
        start = 0
        for d, r in enumerate(refs):
            full = readers[parts[r.part].path].read(r.index)
            span = slice(start, start + r.length)
            assert item["ids"][0, span].tolist() == full.input_ids.tolist()
            assert (item["doc_ids"][0, span] == d).all()
            # layers (2, 0) of the stored axis, in that order
            assert torch.equal(item["hidden"][0, span], full.hidden_tensor()[:, [2, 0]])
            seen.add((r.part, r.index))
            start += r.length
    assert len(seen) == sum(len(p.lengths) for p in parts)


def test_resume_skips_consumed_rows_exactly(cache):
    parts = _catalog(cache)
    spec = _spec(parts)
    full = _real(list(_dataset(parts, spec, layers=(0,), epochs=2)))
    per_epoch = len(plan_rows(spec, epoch=0))
    for consumed in (1, per_epoch - 1):
        tail = _real(list(_dataset(parts, spec, layers=(0,), epochs=2, consumed=consumed)))
        assert len(tail) == len(full) - consumed
        for a, b in zip(tail, full[consumed:], strict=True):
            assert (a["epoch"], a["round"]) == (b["epoch"], b["round"])
            assert torch.equal(a["ids"], b["ids"]) and a["anchor_seed"] == b["anchor_seed"]


def test_ranks_run_the_same_number_of_rows_on_a_cache_with_few_parts(tmp_path):
    """Samples, not parts, are split: one part trains on three ranks with two workers each."""
    small = write_cache(tmp_path / "one", num_parts=1, samples_per_part=12, lengths=(40, 120))
    parts = _catalog(small)
    spec = _spec(parts, row_tokens=256)
    rows = plan_rows(spec, epoch=0)
    assert len(rows) >= 3
    got = []
    for rank in range(3):
        ds = _dataset(parts, spec, world=3, rank=rank, workers=2, layers=(0,))
        loader = make_loader(ds, workers=2, prefetch=1, pin_memory=False)
        got.append(len(_real(list(loader))))
    assert got == [len(rows) // 3] * 3


def test_dataloader_workers_follow_the_plan_and_resume(cache):
    """Two spawned workers give the plan's round-robin order, also when resuming mid-epoch."""
    parts = _catalog(cache)
    spec = _spec(parts)
    ref = _dataset(parts, spec, workers=2, epochs=2, layers=(1,))
    loader = make_loader(ref, workers=2, prefetch=2, pin_memory=False)
    got = [(i["epoch"], i["row"], i["ids"]) for i in _real(list(loader))]
    for e in (0, 1):
        rows = plan_rows(spec, epoch=e)
        slices = worker_rows(len(rows), rank=0, world_size=1, workers=2)
        merged = [
            rows[n]
            for t in range(max(map(len, slices)))
            for n in (s[t] for s in slices if t < len(s))
        ]
        mine = [g for g in got if g[0] == e]
        assert len(mine) == len(merged)
        assert [g[1] for g in mine] == [
            n for t in range(max(map(len, slices))) for n in (s[t] for s in slices if t < len(s))
        ]
        for (_, _, ids), refs in zip(mine, merged, strict=True):
            assert int((ids != 0).sum()) > 0 and ids.shape == (1, ROW)
            assert sum(r.length for r in refs) <= ROW
    resumed = _dataset(parts, spec, workers=2, epochs=2, layers=(1,), consumed=3)
    loader = make_loader(resumed, workers=2, prefetch=2, pin_memory=False)
    tail = [(i["epoch"], i["row"], i["ids"]) for i in _real(list(loader))]
    assert len(tail) == len(got) - 3
    for a, b in zip(tail, got[3:], strict=True):
        assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_a_damaged_part_stops_with_one_message_naming_it(tmp_path):
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=4)
    parts = _catalog(cache)
    shards = sorted((cache / "part-000001" / "hidden").glob("c.*"))
    assert shards
    for f in shards:  # flip bytes in every chunk of one part
        data = bytearray(f.read_bytes())
        for i in range(0, len(data), 50):  # every chunk of every layer, and the shard index
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
    spec = _spec(parts)
    loader = make_loader(
        _dataset(parts, spec, layers=(0,), workers=1), workers=1, prefetch=1, pin_memory=False
    )
    with pytest.raises(CacheReadError, match="part-000001.*extract.verify"):
        list(checked(iter(loader)))
    shutil.rmtree(cache / "part-000000")
    with pytest.raises(CacheReadError, match="part-000000"):
        list(checked(iter(_dataset(parts, spec, layers=(0,)))))


# A worker raising what the loader does not expect (here a read position past the plan): the
# error reaches the caller, whose traceback keeps the loader's iterator and its workers alive.
WORKER_ERROR = """
import sys
from pathlib import Path
from tests.cachegen import write_cache
from tests.test_train_data import _catalog, _dataset, _spec
from train.data.loader import checked, make_loader

parts = _catalog(write_cache(Path(sys.argv[1]), num_parts=2, samples_per_part=4))
ds = _dataset(parts, _spec(parts), layers=(0,), workers=1, consumed=10**6)
try:
    list(checked(iter(make_loader(ds, workers=1, prefetch=1, pin_memory=False))))
except ValueError as e:
    print("raised:", str(e).splitlines()[0], flush=True)
    kept = e
"""


def test_a_worker_error_stops_the_workers_so_the_process_can_end(tmp_path):
    """Workers ignore SIGTERM (their rank stops them), so a process ending with an error a
    worker raised waited for them forever unless the loader stops them as the error passes."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_ERROR, str(tmp_path / "c")],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "raised: Caught ValueError in DataLoader worker process 0" in proc.stdout


def test_a_damaged_tar_stops_with_one_message_naming_it_and_its_cache(tmp_path):
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=4, fmt="wds")
    tar = cache / "part-000001.tar"
    with tarfile.open(tar) as t:  # a payload's bytes flipped: its crc32c no longer matches
        hidden = next(m for m in t.getmembers() if m.name.endswith(".hidden.blosc"))
    data = bytearray(tar.read_bytes())
    data[hidden.offset_data + hidden.size // 2] ^= 0xFF
    tar.write_bytes(bytes(data))
    parts = _catalog(cache)
    with pytest.raises(CacheReadError) as e:
        list(checked(iter(_dataset(parts, _spec(parts), layers=(0,)))))
    assert f"cannot read {tar} (" in str(e.value)
    assert f"python -m extract.verify {cache} --repair" in str(e.value)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", ["bf16", "fp8", "int4"])
def test_formats_and_stores_give_the_same_batches(tmp_path, fmt, store):
    if fmt == "wds":
        pytest.importorskip("shared.wds")
    base = write_cache(tmp_path / "base", num_parts=2, samples_per_part=3, seed=1)
    other = write_cache(
        tmp_path / "other", num_parts=2, samples_per_part=3, seed=1, fmt=fmt, store=store
    )
    got = []
    for cache in (base, other):
        parts = _catalog(cache)
        ds = _dataset(parts, _spec(parts), layers=(1, 2))
        got.append([device_batch(i, torch.device("cpu")) for i in _real(list(ds))])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.ids_BS, b.ids_BS) and torch.equal(a.loss_mask_BS, b.loss_mask_BS)
        assert b.hidden_BSKH.dtype == torch.bfloat16
        if store == "bf16":
            assert torch.equal(a.hidden_BSKH, b.hidden_BSKH)
        elif store == "int4":  # decoded on the device as if never stored (padding: zeros)
            scheme = Int4Scheme(hidden=a.hidden_BSKH.shape[-1])
            assert torch.equal(
                b.hidden_BSKH, decode_int4(encode_int4(a.hidden_BSKH, scheme), scheme)
            )
        else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, then a bf16 rounding
            want, have = a.hidden_BSKH.float(), b.hidden_BSKH.float()
            amax = want.abs().amax(-1, keepdim=True)
            assert ((have - want).abs() <= want.abs() * 0.07 + amax * 1e-5).all()


def _reverse_samples(tar: Path) -> None:
    """Rewrite a part's tar with its samples (each one's members together) in reverse order:
    an order its writer threads may have finished them in."""
    with tarfile.open(tar) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    samples: dict[str, list] = {}
    for m, data in members[1:]:
        samples.setdefault(m.name.split(".")[0], []).append((m, data))
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for m, data in [members[0], *[x for key in reversed(samples) for x in samples[key]]]:
            t.addfile(m, io.BytesIO(data))


def test_a_tars_sample_order_changes_no_batch(tmp_path):
    """A webdataset part holds its samples in the order they were finished, which differs from
    run to run: the batches are those of the same samples in a zarr cache whatever that order."""
    base = write_cache(tmp_path / "zarr", num_parts=2, samples_per_part=5, seed=1)
    tars = write_cache(tmp_path / "wds", num_parts=2, samples_per_part=5, seed=1, fmt="wds")
    for tar in sorted(tars.glob("part-*.tar")):
        before = open_part(tar).sample_indices.tolist()
        _reverse_samples(tar)
        stored = [s.sample_index for s in open_part(tar).iter_samples()]
        assert stored == before[::-1] and open_part(tar).sample_indices.tolist() == before
    got = []
    for cache in (base, tars):
        parts = _catalog(cache)
        ds = _dataset(parts, _spec(parts), layers=(1, 2))
        got.append([device_batch(i, torch.device("cpu")) for i in _real(list(ds))])
    assert len(got[0]) == len(got[1]) > 1
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.ids_BS, b.ids_BS) and torch.equal(a.hidden_BSKH, b.hidden_BSKH)


def test_the_cli_reports_a_damaged_part_in_one_message_and_exits(tmp_path):
    """Through `python -m train` with loader processes: one message, exit 1, no traceback, and
    the process ends (its workers, which follow their rank, are stopped with it)."""
    import subprocess
    import sys

    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=6)
    shards = sorted((cache / "part-000001" / "hidden").glob("c.*"))
    assert shards
    for f in shards:
        data = bytearray(f.read_bytes())
        for i in range(0, len(data), 50):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
    args = [sys.executable, "-m", "train", "--data", str(cache), "--out", str(tmp_path / "run")]
    args += ["--gpus", "cpu", "--drafter-layers", "1", "--block-size", "4", "--workers", "2"]
    args += ["--batch-tokens", "512", "--epochs", "2", "--eval-fraction", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "part-000001" in done.stderr
    repair = f"run `python -m extract.verify {cache} --repair`, then `python -m extract --out"
    assert repair in done.stderr


def test_a_worker_the_kernel_killed_is_one_message_saying_what_to_change(tmp_path):
    """The out-of-memory killer often picks a loader worker (each holds a shuffle buffer of
    samples): the loader says so, that the same command resumes and which options take less
    memory (a StopRun: the user's message, not a rank's traceback), not torch's RuntimeError."""
    import signal

    from shared.stopping import StopRun

    parts = _catalog(write_cache(tmp_path / "c", num_parts=3, samples_per_part=8))
    loader = iter(make_loader(_dataset(parts, _spec(parts), layers=(0,), epochs=4),
                              workers=1, prefetch=1, pin_memory=False))  # fmt: skip
    items = checked(loader)
    next(items)
    os.kill(loader._workers[0].pid, signal.SIGKILL)
    with pytest.raises(
        StopRun, match=r"unexpectedly.*command resumes.*--workers.*--shuffle-buf"
    ) as e:
        for _ in items:
            pass
    from shared.oom import kernel_log

    if kernel_log() is not None:  # where the kernel's log is read, a kill -9 is told apart
        assert "not by the kernel's out-of-memory killer" in str(e.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_int4_part_whose_scheme_differs_from_the_manifests_is_refused(tmp_path, fmt):
    """A part's attributes are outside what the reader checks: a seed changed by one bit would
    decode other states without an error, so the catalog compares each part's scheme."""
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=2, fmt=fmt, store="int4")
    manifest = read_manifest(cache)
    assert load_catalog(cache, manifest)[1] == []
    name = manifest.parts[1].name
    if fmt == "zarr":
        attrs = cache / name / "zarr.json"
        attrs.write_text(attrs.read_text().replace('"seed": 0', '"seed": 1'))
    else:
        tar = (cache / name).read_bytes()
        (cache / name).write_bytes(tar.replace(b'"seed": 0', b'"seed": 1'))
    parts, problems = load_catalog(cache, manifest)
    assert [Path(p.path).name for p in parts] == [manifest.parts[0].name]
    (problem,) = problems
    assert problem.startswith(f"part {name}: its int4 scheme {{") and "'seed': 1" in problem
