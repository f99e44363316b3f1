"""The streaming loader on a tiny synthetic cache: contents, layer order, resume, workers."""

import pytest
import torch

from shared.cache import open_part
from shared.codec import FORMATS
from shared.manifest import read_manifest
from tests.cachegen import write_cache
from train.data import (
    LoaderState,
    PlanDataset,
    collate,
    device_batch,
    epoch_limits,
    layer_positions,
    load_catalog,
    make_loader,
    split_eval,
)
from train.plan import PlanSpec, SampleRef, epoch_limit, plan_epoch


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=4, samples_per_part=5)


def _spec(parts, streams=1, **kw):
    base = dict(
        lengths=tuple(p.lengths for p in parts),
        seed=5,
        num_streams=streams,
        batch_tokens=640,
        shuffle_buffer=3,
    )
    return PlanSpec(**{**base, **kw})


def _catalog(cache):
    parts, problems = load_catalog(cache, read_manifest(cache))
    assert problems == []
    return parts


def _real(items):
    return [it for it in items if it["real"]]


def test_split_eval_and_layer_positions():
    assert split_eval(10, 0) == (list(range(10)), [])
    train, held = split_eval(5, 1)
    assert held == [2] and train == [0, 1, 3, 4]
    with pytest.raises(ValueError):
        split_eval(3, 3)
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


def test_collate_pads_to_128_and_keeps_values(cache):
    reader = open_part(cache / "part-000000")
    samples = [reader.read(0), reader.read(1)]
    refs = [SampleRef(0, 0, int(reader.lengths[0])), SampleRef(0, 1, 20)]
    out = collate(samples, refs)
    seq = out["ids"].shape[1]
    assert seq % 128 == 0 and seq >= refs[0].length
    assert out["lengths"].tolist() == [refs[0].length, 20]
    assert out["ids"][0, : refs[0].length].tolist() == samples[0].input_ids.tolist()
    assert out["ids"][1, 20:].abs().sum() == 0  # clipped to its planned length
    assert torch.equal(out["hidden"][0, : refs[0].length], samples[0].hidden_tensor())
    assert out["hidden"].dtype == torch.bfloat16


def test_one_epoch_yields_every_sample_once_with_its_content(cache):
    parts = _catalog(cache)
    spec = _spec(parts)
    limit = sum(len(s) for s in plan_epoch(spec, epoch=0))
    ds = PlanDataset(parts, spec, layers=(2, 0), rank=0, workers=0, limits={0: limit})
    items = _real(list(ds))
    assert len(items) == limit
    seen = set()
    readers = {p.path: open_part(p.path) for p in parts}
    plan = plan_epoch(spec, epoch=0)[0]
    for item, refs in zip(items, plan, strict=True):
        assert item["ids"].shape[1] % 128 == 0
        for b, r in enumerate(refs):
            full = readers[parts[r.part].path].read(r.index)
            assert item["ids"][b, : r.length].tolist() == full.input_ids.tolist()
            # layers (2, 0) of the stored axis, in that order
            want = full.hidden_tensor()[:, [2, 0]]
            assert torch.equal(item["hidden"][b, : r.length], want)
            seen.add((r.part, r.index))
    assert len(seen) == sum(len(p.lengths) for p in parts)


def test_resume_skips_consumed_batches_exactly(cache):
    parts = _catalog(cache)
    spec = _spec(parts)
    limit = sum(len(s) for s in plan_epoch(spec, epoch=0))
    limits = {0: limit, 1: limit}
    full = _real(list(PlanDataset(parts, spec, layers=(0,), rank=0, workers=0, limits=limits)))
    for consumed in (1, limit - 1):
        ds = PlanDataset(
            parts, spec, layers=(0,), rank=0, workers=0, limits=limits, consumed=consumed
        )
        tail = _real(list(ds))
        assert len(tail) == 2 * limit - consumed
        for a, b in zip(tail, full[consumed:], strict=True):
            assert (a["epoch"], a["stream"], a["round"]) == (b["epoch"], b["stream"], b["round"])
            assert torch.equal(a["ids"], b["ids"]) and a["anchor_seed"] == b["anchor_seed"]


def test_ranks_run_the_same_number_of_batches(cache):
    parts = _catalog(cache)
    spec = _spec(parts, streams=2)
    limit = epoch_limit([len(s) for s in plan_epoch(spec, epoch=0)], workers=1, grad_accum=1)
    got = []
    for rank in (0, 1):
        ds = PlanDataset(parts, spec, layers=(0,), rank=rank, workers=1, limits={0: limit})
        items = _real(list(ds))
        assert {it["stream"] for it in items} == {rank}
        got.append(len(items))
    assert got == [limit, limit]


def test_epoch_limits_for_steps_and_epochs(cache):
    spec = _spec(_catalog(cache))
    by_epochs = epoch_limits(spec, workers=1, grad_accum=2, epochs=3, steps=None)
    assert len(by_epochs) == 3 and all(n % 2 == 0 for n in by_epochs)
    by_steps = epoch_limits(spec, workers=1, grad_accum=2, epochs=None, steps=by_epochs[0] // 2 + 1)
    assert len(by_steps) == 2
    with pytest.raises(ValueError, match="too little data"):
        epoch_limits(spec, workers=1, grad_accum=10_000, epochs=1, steps=None)


def test_dataloader_workers_follow_the_plan_and_resume(cache):
    """Two spawned workers give the plan's round-robin order, also when resuming mid-epoch."""
    parts = _catalog(cache)
    spec = _spec(parts, streams=2)
    counts = [len(s) for s in plan_epoch(spec, epoch=0)]
    limit = epoch_limit(counts, workers=2, grad_accum=1)
    limits = {
        0: limit,
        1: epoch_limit([len(s) for s in plan_epoch(spec, epoch=1)], workers=2, grad_accum=1),
    }
    ref = PlanDataset(parts, spec, layers=(1,), rank=0, workers=2, limits=limits)
    loader = make_loader(ref, workers=2, prefetch=2, pin_memory=False)
    got = [(i["epoch"], i["stream"], i["round"]) for i in _real(list(loader))]
    assert len(got) == limits[0] + limits[1]
    for e in (0, 1):
        streams = [
            [(e, s, t) for t in range(n)]
            for s, n in enumerate([len(p) for p in plan_epoch(spec, epoch=e)])
        ]
        merged = [
            x for t in range(max(map(len, streams))) for x in (s[t] for s in streams if t < len(s))
        ]
        assert [g for g in got if g[0] == e] == merged[: limits[e]]
    resumed = PlanDataset(parts, spec, layers=(1,), rank=0, workers=2, limits=limits, consumed=3)
    loader = make_loader(resumed, workers=2, prefetch=2, pin_memory=False)
    tail = [(i["epoch"], i["stream"], i["round"]) for i in _real(list(loader))]
    assert tail == got[3:]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("store", ["bf16", "fp8"])
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
        spec = _spec(parts)
        limit = sum(len(s) for s in plan_epoch(spec, epoch=0))
        ds = PlanDataset(parts, spec, layers=(1, 2), rank=0, workers=0, limits={0: limit})
        got.append([device_batch(i, torch.device("cpu")) for i in _real(list(ds))])
    for a, b in zip(*got, strict=True):
        assert torch.equal(a.ids_BS, b.ids_BS) and torch.equal(a.loss_mask_BS, b.loss_mask_BS)
        assert b.hidden_BSKH.dtype == torch.bfloat16
        if store == "bf16":
            assert torch.equal(a.hidden_BSKH, b.hidden_BSKH)
        else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, then a bf16 rounding
            want, have = a.hidden_BSKH.float(), b.hidden_BSKH.float()
            amax = want.abs().amax(-1, keepdim=True)
            assert ((have - want).abs() <= want.abs() * 0.07 + amax * 1e-5).all()
