"""The first pass over a cache still being written: its plan, the view of the manifest it reads,
and the loader over it (train/data/growing.py, train/data/follow.py)."""

from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch

from shared.manifest import read_manifest, write_manifest
from tests.cachegen import write_cache
from train.data.follow import CacheChanged, read_view
from train.data.growing import GrowingPlan, growing_holdout, interleaved_rows
from train.data.loader import PlanDataset, make_loader
from train.data.plan import PlanSpec, merge_round_robin, rank_schedule


def _lengths(num_parts: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(20, 300) for _ in range(rng.randint(0, 9))] for _ in range(num_parts)]


def _plan(window: int = 8) -> GrowingPlan:
    return GrowingPlan(seed=3, row_tokens=512, clip=512, window=window)


@pytest.mark.parametrize("seed", range(5))
def test_the_rows_do_not_depend_on_when_parts_are_committed(seed):
    """Grown one part at a time, several at once, or all at the end: the same rows, and rows
    already planned never change."""
    lengths = _lengths(30, seed)
    whole = _plan()
    whole.extend(lengths, complete=True)
    rng, grown, seen = random.Random(seed), _plan(), 0
    while seen < len(lengths):
        seen = min(len(lengths), seen + rng.choice([0, 1, 1, 2, 5]))
        before = [list(r) for r in grown.rows]
        grown.extend(lengths[:seen], complete=False)
        assert grown.rows[: len(before)] == before
        assert all(ref.part < seen for row in grown.rows for ref in row)  # committed parts only
    grown.extend(lengths, complete=True)
    assert grown.rows == whole.rows and grown.windows == whole.windows


def test_every_training_sample_is_placed_once_in_windows_of_at_least_the_buffer():
    lengths = _lengths(40, 7)
    lengths[3] = [0, 50, 0]  # held-out samples (length 0) are not placed
    plan = _plan(window=10)
    plan.extend(lengths, complete=True)
    placed = sorted((r.part, r.index) for row in plan.rows for r in row)
    assert placed == sorted((p, n) for p, ls in enumerate(lengths) for n, x in enumerate(ls) if x)
    assert all(sum(r.length for r in row) <= 512 for row in plan.rows)
    counts = [sum(1 for p in w for x in lengths[p] if x) for w in plan.windows]
    assert all(c >= 10 for c in counts[:-1]) and sum(counts) == len(placed)
    assert [w.start for w in plan.windows[1:]] == [w.stop for w in plan.windows[:-1]]
    # windows are shuffled: the first window's rows do not hold its samples in stored order
    first = [(r.part, r.index) for row in plan.rows for r in row][: counts[0]]
    assert first != sorted(first)


def test_rows_are_dealt_to_ranks_and_workers_once_each_in_order():
    world, workers, rows = 3, 2, 17
    dealt = []
    for rank in range(world):
        slices = interleaved_rows(rows, rank=rank, world_size=world, workers=workers)
        mine = merge_round_robin([list(s) for s in slices])
        assert mine == list(range(rank, rows - rows % world, world))  # the rank's, in order
        # what a rank's DataLoader yields, resumed after 2 rows: the same order from there
        _, items = rank_schedule([len(s) for s in slices], limit=len(mine), consumed=2)
        assert len([it for s in items for it in s if it.real]) == len(mine) - 2
        dealt += mine
    assert sorted(dealt) == list(range(rows - rows % world))


def test_the_holdout_of_a_prefix_is_the_prefix_of_the_holdout():
    lengths = _lengths(20, 1)
    total = sum(map(len, lengths))
    held_parts = [3, 10, 16]  # evenly_spaced(20, 3)
    cases = [
        (dict(fraction=0.1, parts=0), -(-total // 10)),  # every 10th sample from the first
        (dict(fraction=0.3, parts=0), -(-total * 3 // 10)),  # the fraction, not 1 in round(1/f)
        (dict(fraction=0.7, parts=0), -(-total * 7 // 10)),  # not every sample (round(1/f) = 1)
        (dict(fraction=0.0, parts=3), sum(len(lengths[p]) for p in held_parts)),
        (dict(fraction=0.0, parts=0), 0),
    ]
    for kw, held in cases:
        train, evals = growing_holdout(lengths, num_units=20, **kw)
        assert sum(1 for ls in evals for x in ls if x) == held
        for k in (0, 5, 13):
            assert growing_holdout(lengths[:k], num_units=20, **kw) == (train[:k], evals[:k])
        for ls, tr, ev in zip(lengths, train, evals, strict=True):
            assert [a + b for a, b in zip(tr, ev, strict=True)] == ls  # a split, nothing lost


@pytest.fixture()
def partial(tmp_path):
    """A cache of 6 parts whose manifest records units 0, 1 and 3: part 2 is committed on disk
    but not recorded, and unit 4's part is being written."""
    cache = write_cache(tmp_path / "c", num_parts=6, samples_per_part=5, complete=False)
    full = read_manifest(cache)
    keep = [p for p in full.parts if p.unit in (0, 1, 3)]
    write_manifest(cache, dataclasses.replace(full, parts=tuple(keep)))
    shutil.copytree(cache / "part-000004", cache / "part-000004.tmp")
    return cache, full


def test_a_view_holds_only_the_parts_the_manifest_records_from_unit_0_on(partial):
    cache, full = partial
    view = read_view(cache, read_manifest(cache))
    assert [r.name for r in view.records] == ["part-000000", "part-000001"]
    assert [p.path for p in view.parts] == [str(cache / "part-000000"), str(cache / "part-000001")]
    assert not view.complete and view.num_units == 6
    # part 2 recorded: the view grows past it to part 3, keeping what it had
    write_manifest(cache, dataclasses.replace(full, parts=full.parts[:4]))
    grown = read_view(cache, read_manifest(cache), view)
    assert [r.unit for r in grown.records] == [0, 1, 2, 3] and grown.parts[:2] == view.parts
    # part 1 dropped (verify --repair): the view keeps what it has until it is back
    write_manifest(cache, dataclasses.replace(full, parts=full.parts[:1] + full.parts[2:4]))
    assert read_view(cache, read_manifest(cache), grown) is grown
    # recorded again with other counts: the run read it otherwise, it cannot go on
    other = dataclasses.replace(full.parts[1], rows_kept=4)
    write_manifest(cache, dataclasses.replace(full, parts=(full.parts[0], other, *full.parts[2:])))
    with pytest.raises(CacheChanged, match="part-000001: 5 rows"):
        read_view(cache, read_manifest(cache), grown)


def test_the_loader_reads_the_growing_pass_in_order_and_resumes(partial):
    cache, full = partial
    write_manifest(cache, full)
    view = read_view(cache, read_manifest(cache))
    plan = _plan(window=6)
    plan.extend([p.lengths for p in view.parts], complete=True)
    spec = PlanSpec(lengths=view.lengths, seed=3, row_tokens=512, shuffle_buffer=6)

    def items(start: int, workers: int) -> list[dict]:
        share = plan.share(rank=1, world_size=2, start=start)
        limit = plan.rank_rows(world_size=2)
        dataset = PlanDataset(
            view.parts, spec, layers=(0,), rank=1, world_size=2, workers=workers,
            limits={0: limit}, consumed=start, growing=share,
        )  # fmt: skip
        loader = make_loader(dataset, workers=workers, prefetch=2, pin_memory=False)
        return [it for it in loader if it["real"]]

    got = items(0, workers=2)
    assert [it["row"] for it in got] == list(range(1, len(plan.rows) - len(plan.rows) % 2, 2))
    for it in got:
        refs = plan.rows[it["row"]]
        assert int(it["tokens"]) == sum(r.length for r in refs)
        assert int((it["doc_ids"] >= 0).sum()) == sum(r.length for r in refs)
    tail = items(3, workers=2)
    assert [it["row"] for it in tail] == [it["row"] for it in got[3:]]
    assert all(torch.equal(a["hidden"], b["hidden"]) for a, b in zip(tail, got[3:], strict=True))
