"""Anchor sampling, block inputs/positions/targets and loss weights on literal tensors."""

import math

import pytest
import torch

from train.drafters.anchors import (
    anchor_candidates,
    block_inputs,
    block_positions,
    block_rows,
    block_targets,
    context_starts,
    default_gamma,
    loss_weights,
    sample_anchors,
)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _docs(lengths, seq: int) -> torch.Tensor:
    """Doc ids of rows holding one sample each: 0 inside its length, -1 after."""
    return torch.stack([torch.where(torch.arange(seq) < n, 0, -1) for n in lengths])


def test_candidates_need_two_supervised_tokens_inside_the_length():
    loss_mask = torch.tensor(
        [
            [0, 1, 1, 1, 0, 1, 1, 0],  # candidates 1, 2, 5
            [1, 1, 1, 1, 1, 1, 1, 1],  # length 4: candidates 0, 1, 2
        ]
    )
    anchors, keep = sample_anchors(loss_mask, _docs([8, 4], 8), num_anchors=5, generator=_gen(0))
    assert anchors.tolist() == [[1, 2, 5, 0, 0], [0, 1, 2, 0, 0]]
    assert keep.tolist() == [[True, True, True, False, False], [True, True, True, False, False]]


def test_last_position_is_never_an_anchor_and_blocks_are_capped_by_length():
    anchors, keep = sample_anchors(
        torch.ones(1, 4, dtype=torch.uint8), _docs([4], 4), num_anchors=6, generator=_gen(1)
    )
    assert anchors.shape == (1, 4)  # never more blocks than positions: N = min(anchors, S)
    assert anchors[keep].tolist() == [0, 1, 2]
    assert not keep[0, 3:].any() and (anchors[0, 3:] == 0).all()


def test_trim_keeps_the_anchors_and_drops_all_padding_columns():
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.uint8)
    lengths = _docs([8, 8], 8)
    full = sample_anchors(mask, lengths, num_anchors=6, generator=_gen(3))
    trimmed = sample_anchors(mask, lengths, num_anchors=6, generator=_gen(3), trim=True)
    assert full[0].shape == (2, 6) and trimmed[0].shape == (2, 3)
    assert torch.equal(full[0][:, :3], trimmed[0]) and torch.equal(full[1][:, :3], trimmed[1])
    assert not full[1][:, 3:].any()


def test_no_candidates_gives_only_dropped_blocks():
    anchors, keep = sample_anchors(
        torch.tensor([[1, 0, 1, 0]]), _docs([4], 4), num_anchors=2, generator=_gen(0)
    )
    assert not keep.any() and anchors.tolist() == [[0, 0]]


def test_draw_is_without_replacement_sorted_and_within_candidates():
    loss_mask = (torch.rand(3, 64, generator=_gen(5)) < 0.8).to(torch.uint8)
    lengths = torch.tensor([64, 50, 20])
    seen: set[int] = set()
    for seed in range(20):
        anchors, keep = sample_anchors(
            loss_mask, _docs(lengths, 64), num_anchors=8, generator=_gen(seed)
        )
        for b in range(3):
            row = anchors[b][keep[b]].tolist()
            assert row == sorted(set(row))  # unique and ascending
            for p in row:
                assert p + 1 < lengths[b] and loss_mask[b, p] and loss_mask[b, p + 1]
        seen.update(anchors[0][keep[0]].tolist())
    candidates = {p for p in range(63) if loss_mask[0, p] and loss_mask[0, p + 1]}
    assert seen == candidates  # 160 draws of 8 cover every candidate of row 0


def test_generator_alone_determines_the_draw():
    loss_mask, lengths = torch.ones(2, 40, dtype=torch.bool), _docs([40, 33], 40)
    gen = _gen(7)
    state = gen.get_state()
    first = sample_anchors(loss_mask, lengths, num_anchors=6, generator=gen)
    gen.set_state(state)
    replay = sample_anchors(loss_mask, lengths, num_anchors=6, generator=gen)
    other = sample_anchors(loss_mask, lengths, num_anchors=6, generator=_gen(8))
    assert torch.equal(first[0], replay[0]) and torch.equal(first[1], replay[1])
    assert not torch.equal(first[0], other[0])


def test_block_inputs_positions_targets():
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    anchors = torch.tensor([[1, 3]])
    assert block_inputs(ids, anchors, block_size=3, mask_token_id=99).tolist() == [
        [11, 99, 99, 13, 99, 99]
    ]
    assert block_rows(anchors, block_size=3).tolist() == [[1, 2, 3, 3, 4, 5]]
    positions = torch.arange(5)[None]
    assert block_positions(anchors, positions, block_size=3).tolist() == [[1, 2, 3, 3, 4, 5]]
    # Same position, no shift; position 5 is past the end and gets a valid id (weight 0).
    targets = block_targets(ids, anchors, block_size=3)
    assert targets.tolist()[0][:5] == [11, 12, 13, 13, 14]
    assert 0 <= targets[0, 5] < 100


def test_loss_weights_on_literal_tensors():
    loss_mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 0]])
    anchors = torch.tensor([[1, 4, 0]])
    keep = torch.tensor([[True, True, False]])
    w = loss_weights(loss_mask, _docs([7], 8), anchors, keep, block_size=4, gamma=2.0)
    e = [math.exp(-(k - 1) / 2.0) for k in range(4)]
    expected = [
        [0.0, e[1], 0.0, e[3]],  # anchor 1: positions 1..4, position 3 unsupervised
        [0.0, e[1], e[2], 0.0],  # anchor 4: positions 4..7, 7 is past the length
        [0.0, 0.0, 0.0, 0.0],  # dropped block
    ]
    assert w.dtype == torch.float32 and w.shape == (1, 12)
    torch.testing.assert_close(w.view(3, 4), torch.tensor(expected))


# Packed rows: samples back to back (doc ids 0, 1, 2, then padding -1).
PACKED_DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1]])
PACKED_POS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 0]])


def test_candidates_and_targets_never_cross_a_sample():
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    cand = anchor_candidates(mask, PACKED_DOCS)
    # p and p + 1 in one sample: not 2 (its successor starts sample 1), not 8 (padding next)
    assert cand[0].nonzero().flatten().tolist() == [0, 1, 3, 4, 5, 7]
    for seed in range(10):
        anchors, keep = sample_anchors(mask, PACKED_DOCS, num_anchors=10, generator=_gen(seed))
        assert set(anchors[keep].tolist()) == {0, 1, 3, 4, 5, 7}  # all six, never padding


def test_packed_positions_starts_and_weights_restart_per_sample():
    anchors = torch.tensor([[1, 4, 7]])
    keep = torch.ones(1, 3, dtype=torch.bool)
    assert block_positions(anchors, PACKED_POS, block_size=3).tolist() == [
        [1, 2, 3, 1, 2, 3, 0, 1, 2]
    ]
    assert context_starts(anchors, PACKED_POS).tolist() == [[0, 3, 7]]
    mask = torch.ones(1, 10, dtype=torch.uint8)
    w = loss_weights(mask, PACKED_DOCS, anchors, keep, block_size=3, gamma=1.0)
    e1, e2 = 1.0, math.exp(-1.0)
    # anchor 1: row 2 is in sample 0, row 3 is not; anchor 4: rows 5, 6 in sample 1;
    # anchor 7: row 8 in sample 2, row 9 is padding
    expected = [[0, e1, 0], [0, e1, e2], [0, e1, 0]]
    torch.testing.assert_close(w.view(3, 3), torch.tensor(expected))


def test_default_gamma():
    assert default_gamma(16) == 7 and default_gamma(8) == 4
    assert default_gamma(2) == 1 and default_gamma(32) == 14
    with pytest.raises(ValueError, match="block_size"):
        default_gamma(1)
