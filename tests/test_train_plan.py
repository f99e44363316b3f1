"""The epoch plan's pure stages, on plain lists."""

import random

import pytest

from train.plan import (
    PlanSpec,
    SampleRef,
    WorkerItem,
    epoch_limit,
    merge_round_robin,
    mix_seed,
    order_parts,
    pack,
    padded_length,
    plan_epoch,
    rank_schedule,
    shuffle_buffer,
    split_by_tokens,
    stream_samples,
)


def test_padded_length():
    assert [padded_length(n) for n in (1, 127, 128, 129, 300)] == [128, 128, 128, 256, 384]
    assert padded_length(0) == 128
    assert padded_length(5, 4) == 8


def test_mix_seed_is_deterministic_and_sensitive():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    assert len({mix_seed(0, e, s) for e in range(5) for s in range(5)}) == 25
    assert 0 <= mix_seed(7) < 2**63


def test_order_parts_is_a_seeded_permutation():
    a = order_parts(20, seed=1, epoch=0)
    assert sorted(a) == list(range(20))
    assert a == order_parts(20, seed=1, epoch=0)
    assert a != order_parts(20, seed=1, epoch=1)
    assert a != order_parts(20, seed=2, epoch=0)
    assert order_parts(5, seed=1, epoch=3, shuffle=False) == [0, 1, 2, 3, 4]


def test_split_by_tokens_balances_and_keeps_order():
    parts = [3, 0, 4, 1, 2]
    tokens = [10, 10, 10, 10, 40]
    bins = split_by_tokens(parts, tokens, n=2)
    assert sorted(p for b in bins for p in b) == [0, 1, 2, 3, 4]
    assert sorted(sum(tokens[p] for p in b) for b in bins) == [40, 40]
    for b in bins:  # each bin keeps the input order
        assert b == [p for p in parts if p in b]


def test_split_by_tokens_more_bins_than_parts():
    bins = split_by_tokens([1, 0], [5, 5], n=4)
    assert bins == [[1], [0], [], []]
    with pytest.raises(ValueError, match="n must be"):
        split_by_tokens([0], [1], n=0)


def test_stream_samples_order_and_clipping():
    lengths = [[5, 300], [7], [9, 1]]
    got = list(stream_samples([2, 0], lengths, max_length=100))
    assert got == [SampleRef(2, 0, 9), SampleRef(2, 1, 1), SampleRef(0, 0, 5), SampleRef(0, 1, 100)]
    assert list(stream_samples([1], lengths)) == [SampleRef(1, 0, 7)]


def test_shuffle_buffer_is_a_permutation_and_bounded():
    items = list(range(100))
    out = list(shuffle_buffer(items, size=10, rng=random.Random(0)))
    assert sorted(out) == items and out != items
    assert out == list(shuffle_buffer(items, size=10, rng=random.Random(0)))

    read = []

    def source():
        for i in items:
            read.append(i)
            yield i

    emitted = []
    for item in shuffle_buffer(source(), size=10, rng=random.Random(1)):
        emitted.append(item)
        assert len(read) - len(emitted) <= 10  # never more than `size` items held
    assert sorted(emitted) == items


def test_shuffle_buffer_small_sizes_pass_through():
    assert list(shuffle_buffer([3, 1, 2], size=1, rng=random.Random(0))) == [3, 1, 2]
    assert list(shuffle_buffer([], size=8, rng=random.Random(0))) == []


def test_pack_budget_and_long_samples():
    samples = [SampleRef(0, i, n) for i, n in enumerate([100, 200, 120, 1000, 50, 60, 70])]
    batches = list(pack(samples, batch_tokens=512))
    assert [s for b in batches for s in b] == samples  # arrival order, nothing lost
    for b in batches:
        longest = max(padded_length(s.length) for s in b)
        assert longest * len(b) <= 512 or len(b) == 1
    assert [[s.index for s in b] for b in batches] == [[0, 1], [2], [3], [4, 5, 6]]


def test_pack_empty():
    assert list(pack([], batch_tokens=128)) == []


def _spec(num_parts=6, streams=2, **kw):
    rng = random.Random(42)
    lengths = tuple(
        tuple(rng.randint(20, 400) for _ in range(rng.randint(3, 9))) for _ in range(num_parts)
    )
    base = dict(lengths=lengths, seed=3, num_streams=streams, batch_tokens=768, shuffle_buffer=4)
    return PlanSpec(**{**base, **kw})


def test_plan_epoch_covers_every_sample_once_and_is_deterministic():
    spec = _spec()
    plan = plan_epoch(spec, epoch=0)
    assert plan == plan_epoch(spec, epoch=0)
    assert plan != plan_epoch(spec, epoch=1)
    refs = [(s.part, s.index) for stream in plan for b in stream for s in b]
    expect = [(p, n) for p, ls in enumerate(spec.lengths) for n in range(len(ls))]
    assert sorted(refs) == expect
    # a part belongs to exactly one stream
    owners = {s.part: i for i, stream in enumerate(plan) for b in stream for s in b}
    assert all(owners[s.part] == i for i, stream in enumerate(plan) for b in stream for s in b)


def test_epoch_limit_equal_steps_per_rank():
    assert epoch_limit([3, 4, 5, 1], workers=2, grad_accum=1) == 6
    assert epoch_limit([3, 4, 5, 1], workers=1, grad_accum=1) == 1
    assert epoch_limit([7], workers=1, grad_accum=3) == 6
    assert epoch_limit([], workers=1, grad_accum=1) == 0


def test_every_rank_gets_the_same_number_of_steps():
    for world in (1, 2, 3):
        for workers in (1, 2):
            spec = _spec(num_parts=7, streams=world * workers)
            plan = plan_epoch(spec, epoch=0)
            counts = [len(s) for s in plan]
            limit = epoch_limit(counts, workers=workers, grad_accum=2)
            assert limit % 2 == 0 and limit > 0
            for r in range(world):
                mine = counts[r * workers : (r + 1) * workers]
                _, items = rank_schedule(mine, limit=limit)
                assert sum(i.real for stream in items for i in stream) == limit


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
