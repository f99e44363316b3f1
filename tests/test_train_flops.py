"""The training bench's count of the target's lm_head rows (bench/train_flops.py): the distinct
rows each loss chunk reads, as the step computes them."""

import doctest
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import train_flops  # noqa: E402


def test_docstring_examples():
    assert doctest.testmod(train_flops).failed == 0


def test_blocks_of_one_read_one_row_each_and_longer_blocks_share_rows():
    mask = torch.ones(2, 64, dtype=torch.uint8)
    mask[:, :8] = 0  # a prompt: anchors only after it,
    mask[:, -10:] = 0  # and blocks that end before the row does (the step clamps rows past it)
    args = dict(anchors=20, chunk_rows=4096, shift=0)
    # anchors are drawn without replacement: blocks of one never share a row
    assert train_flops.mean_target_rows(mask, block_size=1, **args) == 2 * 20
    # blocks of 8 from 20 anchors among 45 candidates overlap: fewer rows than slots, at most
    # the 52 rows any blocks can read in a row
    shared = train_flops.mean_target_rows(mask, block_size=8, **args)
    assert 2 * 52 >= shared > 2 * 20
    assert shared < 2 * 20 * 8
    # chunks of one block each count their own rows again
    alone = train_flops.mean_target_rows(mask, block_size=8, anchors=20, chunk_rows=8, shift=0)
    assert alone == 2 * 20 * 8
