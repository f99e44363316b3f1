"""`train.data.feed.DeviceFeed`: real items in order, each read ahead at most once."""

from __future__ import annotations

import pytest
import torch

from train.data.feed import DeviceFeed


def item(n: int, *, real: bool = True) -> dict:
    ids = torch.full((1, 4), n)
    return {
        "real": real,
        "n": n,
        "ids": ids,
        "loss_mask": torch.ones_like(ids, dtype=torch.uint8),
        "doc_ids": torch.zeros_like(ids, dtype=torch.int32),
        "positions": torch.arange(4, dtype=torch.int32)[None],
        "tokens": torch.tensor(4),
        "hidden": torch.full((1, 4, 2, 3), float(n), dtype=torch.bfloat16),
    }


def test_real_items_in_order_and_read_ahead_once():
    read = []

    def source():
        for n, real in [(0, True), (1, False), (2, True), (3, True)]:
            read.append(n)
            yield item(n, real=real)

    feed = DeviceFeed(source(), torch.device("cpu"))
    feed.ahead()
    feed.ahead()  # already one waiting: reads nothing more
    assert read == [0]
    first, batch = feed.take()
    assert first["n"] == 0 and torch.equal(batch.ids_BS, first["ids"])
    assert read == [0]
    feed.ahead()  # skips the placeholder
    assert read == [0, 1, 2]
    assert [feed.take()[0]["n"] for _ in range(2)] == [2, 3]
    feed.ahead()  # the source is done: nothing raised until a take
    with pytest.raises(RuntimeError, match="ran out of batches"):
        feed.take()
