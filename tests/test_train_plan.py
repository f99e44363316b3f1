"""The epoch plan's pure stages, on plain lists."""

import random

import pytest

from train.data.plan import (
    PlanSpec,
    SampleRef,
    WorkerItem,
    contiguous_slices,
    epoch_lengths,
    epoch_samples,
    evenly_spaced,
    holdout_lengths,
    merge_round_robin,
    mix_seed,
    order_parts,
    pack_rows,
    plan_rows,
    rank_rows,
    rank_schedule,
    shuffle_buffer,
    worker_rows,
)


def test_mix_seed_is_deterministic_and_sensitive():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert len({mix_seed(1, 2, 3), mix_seed(1, 3, 2), mix_seed(2, 2, 3)}) == 3


def test_order_parts_is_a_seeded_permutation():
    a = order_parts(10, seed=1, epoch=0)
    assert sorted(a) == list(range(10)) and a == order_parts(10, seed=1, epoch=0)
    assert a != order_parts(10, seed=1, epoch=1)
    assert order_parts(4, seed=1, epoch=0, shuffle=False) == [0, 1, 2, 3]


def test_epoch_samples_order_clipping_and_holdout_zeros():
    got = list(epoch_samples([1, 0], [[5, 0, 7], [9, 2]], clip=6))
    assert got == [SampleRef(1, 0, 6), SampleRef(1, 1, 2), SampleRef(0, 0, 5), SampleRef(0, 2, 6)]


def test_shuffle_buffer_is_a_permutation_and_bounded():
    items = list(range(100))
    out = list(shuffle_buffer(iter(items), size=8, rng=random.Random(0)))
    assert sorted(out) == items and out != items
    # an item is emitted at most `size` arrivals after it came in... and never before
    for pos, item in enumerate(out):
        assert item <= pos + 8


def test_shuffle_buffer_small_sizes_pass_through():
    assert list(shuffle_buffer(range(5), size=1, rng=random.Random(0))) == list(range(5))
    assert list(shuffle_buffer(range(5), size=0, rng=random.Random(0))) == list(range(5))


def _refs(lengths):
    return [SampleRef(0, i, n) for i, n in enumerate(lengths)]


def test_pack_rows_places_every_sample_once_within_the_row():
    rng = random.Random(7)
    # long-tailed like chat data: many short samples, some at the limit
    lengths = [min(512, max(1, int(rng.lognormvariate(4.5, 1.0)))) for _ in range(600)]
    assert lengths.count(512) > 10
    rows = list(pack_rows(_refs(lengths), row_tokens=512))
    placed = sorted(r.index for row in rows for r in row)
    assert placed == list(range(len(lengths)))
    assert all(0 < sum(r.length for r in row) <= 512 for row in rows)
    # best fit from the pool wastes little; arrival order alone (pool 1) wastes far more
    assert sum(lengths) / (len(rows) * 512) > 0.98
    naive = list(pack_rows(_refs(lengths), row_tokens=512, pool=1))
    assert len(naive) > 1.1 * len(rows)


def test_pack_rows_fills_the_tail_with_the_longest_that_fits():
    rows = list(pack_rows(_refs([5, 3, 4, 2, 1]), row_tokens=7))
    assert [[r.length for r in row] for row in rows] == [[5, 2], [4, 3], [1]]
    assert list(pack_rows([], row_tokens=8)) == []
    with pytest.raises(ValueError, match="not in"):
        list(pack_rows(_refs([9]), row_tokens=8))


def test_pack_rows_with_a_pool_of_one_keeps_arrival_order():
    rows = list(pack_rows(_refs([3, 3, 5, 1]), row_tokens=6, pool=1))
    assert [[r.index for r in row] for row in rows] == [[0, 1], [2, 3]]


def test_contiguous_and_rank_slices():
    assert contiguous_slices(5, 2) == [range(0, 3), range(3, 5)]
    assert contiguous_slices(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    assert [rank_rows(7, rank=r, world_size=3) for r in range(3)] == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
    ]


def _spec(num_parts=6, **kw):
    rng = random.Random(42)
    lengths = tuple(
        tuple(rng.randint(20, 400) for _ in range(rng.randint(3, 9))) for _ in range(num_parts)
    )
    base = dict(lengths=lengths, seed=3, row_tokens=768, shuffle_buffer=4)
    return PlanSpec(**{**base, **kw})


def test_plan_rows_cover_every_sample_once_and_are_deterministic():
    spec = _spec()
    rows = plan_rows(spec, epoch=0)
    assert rows == plan_rows(spec, epoch=0)
    assert rows != plan_rows(spec, epoch=1)
    refs = sorted((s.part, s.index) for row in rows for s in row)
    assert refs == [(p, n) for p, ls in enumerate(spec.lengths) for n in range(len(ls))]
    assert all(sum(s.length for s in row) <= spec.row_tokens for row in rows)


def test_long_samples_are_clipped_to_the_row_and_max_length():
    spec = _spec(row_tokens=128, max_length=100)
    assert spec.clip == 100
    assert max(s.length for row in plan_rows(spec, epoch=0) for s in row) == 100
    assert _spec(row_tokens=128).clip == 128


def test_ranks_get_equal_rows_and_workers_split_them_contiguously():
    rows = len(plan_rows(_spec(num_parts=9), epoch=0))
    for world in (1, 2, 3):
        for workers in (1, 2, 4):
            shares = [
                worker_rows(rows, rank=r, world_size=world, workers=workers) for r in range(world)
            ]
            assert [sum(map(len, s)) for s in shares] == [rows // world] * world
            flat = [n for s in shares for w in s for n in w]
            assert flat == list(range(len(flat)))  # contiguous, in order
            assert rows - len(flat) < world  # at most one row per rank dropped
    # uneven shares for evaluation keep every row
    shares = [worker_rows(rows, rank=r, world_size=4, workers=1, even=False) for r in range(4)]
    assert [n for s in shares for w in s for n in w] == list(range(rows))


def test_two_ranks_and_one_rank_with_two_workers_see_the_same_rows():
    for rows in (10, 11):
        two = [worker_rows(rows, rank=r, world_size=2, workers=1)[0] for r in range(2)]
        one = worker_rows(rows - rows % 2, rank=0, world_size=1, workers=2)
        assert two == one


def test_epoch_lengths_for_epochs_and_steps_and_too_small_caches():
    spec = _spec()
    per_epoch = [len(plan_rows(spec, epoch=e)) // 2 for e in range(3)]
    assert epoch_lengths(spec, world_size=2, epochs=3, steps=None, grad_accum=1) == per_epoch
    # steps may span epochs: just enough epochs for steps x grad_accum rows per rank
    need = per_epoch[0] + 1
    got = epoch_lengths(spec, world_size=2, epochs=None, steps=need, grad_accum=1)
    assert got == per_epoch[:2]
    with pytest.raises(ValueError, match="one optimizer step needs"):
        epoch_lengths(_spec(num_parts=1), world_size=64, epochs=1, steps=None, grad_accum=1)


def test_holdout_by_samples_and_by_parts():
    lengths = [[5, 6, 7], [8, 9]]
    train, evals = holdout_lengths(lengths, num_samples=2)
    assert train == ((5, 0, 7), (0, 9)) and evals == ((0, 6, 0), (8, 0))  # samples 1 and 3
    train, evals = holdout_lengths(lengths, num_parts=1)
    assert train == ((5, 6, 7), (0, 0)) and evals == ((0, 0, 0), (8, 9))
    assert holdout_lengths(lengths)[0] == ((5, 6, 7), (8, 9))
    assert evenly_spaced(10, 2) == [2, 7]
    with pytest.raises(ValueError):
        evenly_spaced(3, 3)


def _consumed_order(counts, limit, consumed):
    """Simulate DataLoader: workers yield their items, merged round robin, placeholders dropped."""
    rotation, items = rank_schedule(counts, limit=limit, consumed=consumed)
    w = len(counts)
    physical = [[(s, it) for it in items[s]] for s in ((i + rotation) % w for i in range(w))]
    return [(s, it.round) for s, it in merge_round_robin(physical) if it.real], rotation


@pytest.mark.parametrize("counts", [[3, 3], [5, 1, 2], [0, 4], [2, 2, 2, 2], [1]])
def test_rank_schedule_matches_round_robin_and_resumes_exactly(counts):
    full = merge_round_robin([[(s, t) for t in range(n)] for s, n in enumerate(counts)])
    for limit in range(len(full) + 1):
        order, rotation = _consumed_order(counts, limit, 0)
        assert order == full[:limit] and rotation == 0
        for consumed in range(limit + 1):
            order, _ = _consumed_order(counts, limit, consumed)
            assert order == full[consumed:limit], (limit, consumed)


def test_rank_schedule_workers_yield_equal_counts_when_not_resuming():
    _, items = rank_schedule([5, 1, 2], limit=7)
    assert len({len(i) for i in items}) == 1
    assert items[1][1] == WorkerItem(1, False)


def test_rotation_carries_over_into_the_next_epoch():
    """A resumed loader keeps its worker rotation; the next epoch must still start at stream 0."""
    w = 3
    e0, e1 = [4, 2, 3], [2, 3, 3]
    lim0, lim1 = 8, 7
    for consumed in range(lim0):
        rotation, first = rank_schedule(e0, limit=lim0, consumed=consumed)
        _, second = rank_schedule(e1, limit=lim1)
        physical = []
        for i in range(w):
            s = (i + rotation) % w
            physical.append([(0, s, it) for it in first[s]] + [(1, s, it) for it in second[s]])
        got = [(e, s, it.round) for e, s, it in merge_round_robin(physical) if it.real]
        want0 = merge_round_robin([[(0, s, t) for t in range(n)] for s, n in enumerate(e0)])
        want1 = merge_round_robin([[(1, s, t) for t in range(n)] for s, n in enumerate(e1)])
        assert got == want0[consumed:lim0] + want1[:lim1]


def test_rank_schedule_rejects_bad_positions():
    with pytest.raises(ValueError):
        rank_schedule([2, 2], limit=5)
    with pytest.raises(ValueError):
        rank_schedule([2, 2], limit=2, consumed=3)
