"""train.topk_triton.row_topk: the radix select equals torch.topk (the same values; among equal
values the lowest ids), as a custom op that torch.compile keeps whole. The kernel runs in
Triton's interpreter on a CPU where Triton is installed, and on CUDA in the gpu test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.topk_triton import row_topk

ROOT = Path(__file__).resolve().parents[1]


def cases() -> list[tuple[str, torch.Tensor, int]]:
    """(name, bf16 rows, k): random, ties across the K-th value, negatives and -inf, small rows."""
    g = torch.Generator().manual_seed(0)
    rand = (torch.randn(4, 1000, generator=g) * 4).to(torch.bfloat16)
    ties = rand.clone()
    ties[0, 50:90] = 9.0  # 40 equal values over the top 16
    ties[1, :] = 1.5  # the whole row equal: the first k ids
    ties[2, 7::3] = ties[2].max()  # a tie at the very top, spread over tiles
    negative = -rand.abs() - 1
    negative[:, ::5] = float("-inf")
    return [
        ("random", rand, 16),
        ("ties", ties, 16),
        ("negative", negative, 16),
        ("k=1", rand, 1),
        ("k=V", rand[:, :37], 37),
        ("short rows", rand[:, :20], 5),
    ]


def check(name: str, x: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
    expected = x.topk(k, dim=-1).values
    assert torch.equal(values, expected), name
    assert torch.equal(x.gather(1, ids), values), name
    assert all(len(set(r)) == k for r in ids.tolist()), name
    # among equal values the lowest ids, the largest values first
    for row, v, i in zip(x, values, ids, strict=True):
        for value in set(v.tolist()):
            chosen = sorted(i[v == value].tolist())
            everywhere = (row == value).nonzero()[:, 0].tolist()
            assert chosen == everywhere[: len(chosen)], name


def test_off_cuda_is_aten_topk_and_compiles_whole():
    """Without CUDA the op is torch.topk (values and ids); torch.compile(fullgraph) traces it
    through its fake implementation (shapes and dtypes of the real one)."""
    x = (torch.randn(6, 300) * 3).to(torch.bfloat16)
    values, ids = row_topk(x, 16)
    ref_values, ref_ids = x.topk(16, dim=-1)
    assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)

    def f(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v, i = row_topk(t * 2, 8)
        return v.float() + 1, i

    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    for got, want in zip(compiled(x), f(x), strict=True):
        assert torch.equal(got, want)


def test_kernel_in_triton_interpreter():
    """The Triton program itself, run by Triton's interpreter (tiles of 64 values, so every row
    spans several tiles and a partial last one)."""
    pytest.importorskip("triton")
    code = """
import json, torch
import train.topk_triton as t
from tests.test_topk_triton import cases, check
t.BLOCK = 64
for name, x, k in cases():
    assert t.available(x), name
    values, ids = t.row_topk(x, k)
    check(name, x, k, values, ids)
print(json.dumps("ok"))
"""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == "ok"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_equals_aten_topk():
    pytest.importorskip("triton")
    for name, x, k in cases():
        values, ids = row_topk(x.cuda(), k)
        check(name, x, k, values.cpu(), ids.cpu())
    x = torch.randn(2048, 151936, device="cuda").to(torch.bfloat16)  # a DFlash2 8B chunk
    values, ids = torch.compile(lambda t: row_topk(t, 16), fullgraph=True)(x)
    assert torch.equal(values, x.topk(16, dim=-1).values)
    assert torch.equal(x.gather(1, ids), values)
