"""Progress counters across ranks, and the host staging buffers of extraction."""

from __future__ import annotations

import torch

from extract.sink import Staging
from shared.progress import RankCounters, read_counters


def test_counters_of_all_ranks_are_summed_after_close(tmp_path):
    ranks = [RankCounters(tmp_path, r, every=3600) for r in range(2)]
    ranks[0].add(rows=3, tokens=100)
    ranks[1].add(rows=2)
    ranks[0].add(rows=1)
    for c in ranks:
        c.close()
    assert read_counters(tmp_path) == {"rows": 6, "tokens": 100}
    assert all(c._thread is None or not c._thread.is_alive() for c in ranks)
    # Nothing but the counter files is left behind (no temporary files).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]


def test_flush_writes_the_current_counts(tmp_path):
    c = RankCounters(tmp_path, 0, every=3600)
    c.add(parts=1)
    c.flush()
    assert read_counters(tmp_path) == {"parts": 1}
    c.add(parts=2)
    c.flush()
    assert read_counters(tmp_path) == {"parts": 3}
    c.close()


def test_staging_copies_and_reuses_buffers_sized_for_the_budget():
    staging = Staging(1, pinned=False, rows=10)
    small = torch.arange(12, dtype=torch.float32).view(3, 4)
    views, release = staging.stage({"hidden": small}, tokens=3)
    assert views["_event"] is None
    assert torch.equal(views["hidden"], small)
    ptr = views["hidden"].data_ptr()
    release()
    large = torch.arange(40, dtype=torch.float32).view(10, 4)  # within the 10-row budget
    views, release = staging.stage({"hidden": large}, tokens=10)
    assert torch.equal(views["hidden"], large)
    assert views["hidden"].data_ptr() == ptr  # no new allocation
    release()
    over = torch.ones(11, 4)  # a single row longer than the budget still fits (grown)
    views, release = staging.stage({"hidden": over}, tokens=11)
    assert torch.equal(views["hidden"], over)
    release()


def test_reserved_buffers_take_every_batch_of_the_budget_without_allocating():
    staging = Staging(2, pinned=False, rows=10)
    one = {"q": torch.zeros(1, 3, 4, dtype=torch.uint8), "scale": torch.zeros(1, 3)}
    staging.reserve(one, tokens=1)
    assert staging.nbytes == 2 * (10 * 3 * 4 * 1 + 10 * 3 * 4)
    pointers = set()
    for tokens in (10, 7):
        batch = {"q": torch.ones(tokens, 3, 4, dtype=torch.uint8), "scale": torch.rand(tokens, 3)}
        views, release = staging.stage(batch, tokens=tokens)
        assert all(torch.equal(views[k], batch[k]) for k in batch)
        pointers.add(views["q"].data_ptr())
        release()
    assert staging.nbytes == 2 * (10 * 3 * 4 * 1 + 10 * 3 * 4) and len(pointers) <= 2
