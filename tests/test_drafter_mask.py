"""Mask function vs hand-written visibility matrices; flex mask equals the dense mask."""

import pytest
import torch
import torch.nn.functional as F

from train.drafters.mask import build_masks, dense_mask, make_mask_mod

# Context S = 6, block size 3, two blocks -> Q = 6 queries, S + Q = 12 keys.
# Key columns: context 0..5 | block 0 keys 6..8 | block 1 keys 9..11.
ANCHORS = torch.tensor([[1, 4]])
KEEP = torch.tensor([[True, True]])

FULL_EXPECTED = [
    # block 0, anchor 1: context 0 only, all of its own block
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    # block 1, anchor 4: context 0..3, all of its own block
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1],
]

# Window 2: query at position a + k sees keys at positions a + k - 1 and a + k only.
SLIDING_EXPECTED = [
    [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # pos 1: context 0, block key 0
    [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # pos 2: block keys 0, 1
    [0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0],  # pos 3: block keys 1, 2
    [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0],  # pos 4: context 3, block key 0
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0],  # pos 5
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],  # pos 6
]

DROPPED_EXPECTED = [
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],
    # dropped block: only the query's own key (an empty softmax row would be NaN)
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
    [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
]


def _dense(anchors, keep, layer_type, window=None):
    return dense_mask(
        anchors,
        keep,
        context_len=6,
        block_size=3,
        layer_type=layer_type,
        sliding_window=window,
    )


def test_full_layer_mask_matches_hand_written_matrix():
    mask = _dense(ANCHORS, KEEP, "full_attention")
    assert mask.shape == (1, 1, 6, 12) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == FULL_EXPECTED


def test_sliding_layer_mask_is_causal_and_windowed():
    mask = _dense(ANCHORS, KEEP, "sliding_attention", window=2)
    assert mask[0, 0].int().tolist() == SLIDING_EXPECTED


def test_sliding_window_wider_than_block_reaches_back_into_context():
    mask = _dense(ANCHORS, KEEP, "sliding_attention", window=4)
    # block 1 (anchor 4), offset 2 = position 6: context positions 3 (= 6 - 3) .. 3 (< anchor).
    assert mask[0, 0, 5].int().tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    # offset 0 = position 4: context 1..3.
    assert mask[0, 0, 3].int().tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]


def test_context_is_strictly_before_the_anchor():
    anchors = torch.tensor([[0, 5]])
    mask = _dense(anchors, KEEP, "full_attention")
    assert not mask[0, 0, :3, :6].any()  # anchor 0 sees no context
    assert mask[0, 0, 3:, :5].all() and not mask[0, 0, 3:, 5].any()


def test_dropped_blocks_see_only_their_own_key():
    anchors, keep = torch.tensor([[1, 0]]), torch.tensor([[True, False]])
    for layer_type in ("full_attention", "sliding_attention"):
        mask = _dense(anchors, keep, layer_type, window=8)
        assert mask[0, 0, 3:].int().tolist() == DROPPED_EXPECTED[3:]


def test_batch_rows_use_their_own_anchors():
    anchors, keep = torch.tensor([[1, 4], [2, 0]]), torch.tensor([[True, True], [True, False]])
    mask = _dense(anchors, keep, "full_attention")
    assert mask[0, 0].int().tolist() == FULL_EXPECTED
    assert mask[1, 0, 0].int().tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]


def test_no_nan_in_sdpa_with_dropped_blocks_forward_and_backward():
    anchors, keep = torch.tensor([[1, 0]]), torch.tensor([[False, False]])
    mask = _dense(anchors, keep, "sliding_attention", window=2)
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    kv = torch.randn(1, 2, 12, 8, requires_grad=True)
    out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="sliding_window"):
        _dense(ANCHORS, KEEP, "sliding_attention", window=None)
    with pytest.raises(ValueError, match="layer_type"):
        _dense(ANCHORS, KEEP, "local")
    with pytest.raises(ValueError, match="attention"):
        build_masks(
            ANCHORS,
            KEEP,
            context_len=6,
            block_size=3,
            layer_types=["full_attention"],
            sliding_window=None,
            attention="eager",
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_mask_is_the_same_function():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    anchors, keep = torch.tensor([[1, 4], [2, 0]]), torch.tensor([[True, True], [True, False]])
    for layer_type in ("full_attention", "sliding_attention"):
        mod = make_mask_mod(
            anchors,
            keep,
            context_len=6,
            block_size=3,
            layer_type=layer_type,
            sliding_window=2,
        )
        via_vmap = flex.create_mask(mod, 2, 1, 6, 12, device="cpu")
        assert torch.equal(via_vmap, _dense(anchors, keep, layer_type, window=2))


def test_build_masks_gives_one_mask_per_layer_type():
    masks = build_masks(
        ANCHORS,
        KEEP,
        context_len=6,
        block_size=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=2,
        attention="sdpa",
    )
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert masks["full_attention"][0, 0].int().tolist() == FULL_EXPECTED
    assert masks["sliding_attention"][0, 0].int().tolist() == SLIDING_EXPECTED
