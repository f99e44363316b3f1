"""train.drafters.topk.block_topk: the same values as one torch.topk over the row (ids pointing at
them, none twice), through the blocks with the largest maxima; ties across blocks, -inf, bf16 rows,
the fallback where no block width fits; eager and compiled."""

from __future__ import annotations

import doctest

import pytest
import torch

import train.drafters.topk
from tests.inductor import compile_problem
from train.drafters.topk import block_topk, block_width


def cases() -> list[tuple[str, torch.Tensor, int]]:
    """(name, rows, k) whose vocabularies take 128-wide blocks unless the name says not."""
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(6, 4096, generator=g) * 4
    bf16 = rand.to(torch.bfloat16)  # 8 bits of mantissa: many equal values near the top
    ties = rand.clone()
    ties[0, 100:4000:37] = 50.0  # equal values over the top 16 spread over many blocks
    ties[1, :] = 1.5  # the whole row equal
    ties[2, 127:129] = 60.0  # a tie straddling two blocks at the very top
    ties[3, ::128] = 40.0  # every block's first column: every block's maximum equal
    negative = -rand.abs() - 1
    negative[:, ::3] = float("-inf")
    concentrated = rand.clone()
    concentrated[4, 256:384] = torch.linspace(20, 30, 128)  # the whole top in one block
    return [
        ("random", rand, 16),
        ("bf16", bf16, 16),
        ("ties", ties, 16),
        ("negative and -inf", negative, 16),
        ("one block holds the top", concentrated, 16),
        ("k=1", rand, 1),
        ("64-wide blocks", rand[:, :2112], 16),  # 2112 = 64 x 33
        ("no width fits: plain topk", rand[:, :4095], 16),
        ("k blocks over half the row: plain topk", rand[:, :1024], 17),
    ]


@pytest.mark.parametrize("name, x, k", cases(), ids=[c[0] for c in cases()])
def test_same_values_as_topk(name, x, k):
    values, ids = block_topk(x, k)
    assert torch.equal(values, x.topk(k, dim=-1).values)
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(r)) == k for r in ids.tolist())


def test_block_width_choice():
    assert block_width(151_936, 16) == 128
    assert block_width(128_256, 16) == 128
    assert block_width(2112, 16) == 64
    assert block_width(4095, 16) is None
    assert block_width(1024, 4) == 128
    assert block_width(1024, 5) == 64  # 5 blocks of 128 are over half of 1024, of 64 not
    assert block_width(1024, 17) is None


def test_compiled_equals_eager(monkeypatch):
    if reason := compile_problem():
        pytest.skip(reason)
    monkeypatch.setattr(train.drafters.topk, "BLOCK_WIDTHS", (8,))
    x = torch.randn(5, 400, generator=torch.Generator().manual_seed(1))

    def f(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v, i = block_topk(t * 2, 6)
        return v + 1, i

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    for got, want in zip(compiled(x), f(x), strict=True):
        assert torch.equal(got, want)


def test_doctests():
    assert doctest.testmod(train.drafters.topk).failed == 0
