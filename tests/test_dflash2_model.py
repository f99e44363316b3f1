"""DFlash2 drafter: no-op start equals DFlash, convolution taps stay in their block, and the
forward and selector walk equal z-lab's reference `DFlash2DraftModel` on our export."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.drafters import tiny_drafter_config
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.dflash2 import (
    DFlash2Drafter,
    grouped_dynamic_conv,
    init_dflash2_weights,
    is_added_parameter,
)
from train.drafters.mask import build_masks
from train.drafters.registry import build_drafter
from train.export import export_drafter, export_keys, export_shapes
from train.export_load import load_export

pytestmark = pytest.mark.usefixtures("one_thread")


def dflash2_config(**over):
    kwargs = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=5, conv_group_size=16)
    return tiny_drafter_config(**{**kwargs, **over})


def trained_like(cfg, seed: int = 0) -> DFlash2Drafter:
    """A no-op-initialised DFlash2 drafter with every addition perturbed, so each one shows."""
    drafter = DFlash2Drafter(cfg)
    init_dflash2_weights(drafter, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if is_added_parameter(name):
                # Large codebooks: the selector then overturns the unary argmax now and then.
                scale = 1.5 if name.endswith("codebook") else 0.3
                p.add_(scale * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
    return drafter.eval()


def masks_for(cfg, anchors, keep, ctx):
    return build_masks(
        anchors,
        keep,
        context_len=ctx,
        block_size=cfg.block_size,
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
        attention="sdpa",
        causal=cfg.is_causal,
    )


def single_block(drafter, context, noise):
    """Our forward of one block whose anchor is the position right after the context."""
    ctx, q_len = context.shape[1], noise.shape[1]
    masks = masks_for(drafter.cfg, torch.tensor([[ctx]]), torch.tensor([[True]]), ctx)
    pos = torch.arange(ctx + q_len)[None]
    return drafter(context, noise, pos[:, :ctx], pos[:, ctx:], masks)


def inputs(cfg, ctx=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    context = torch.randn(1, ctx, cfg.num_context_layers * cfg.hidden_size, generator=gen)
    return context, torch.randn(1, cfg.block_size, cfg.hidden_size, generator=gen)


def test_published_defaults_and_config_checks():
    cfg = dflash2_config()
    assert cfg.layer_types == ("sliding_attention",) * 2 and cfg.sliding_window == 2048
    assert cfg.is_causal is False
    assert (cfg.conv_kernel_size, tiny_drafter_config().drafter_type) == (2, "dflash")
    with pytest.raises(ValueError, match="conv_group_size"):
        dflash2_config(conv_group_size=24)
    with pytest.raises(ValueError, match="drafter_type"):
        tiny_drafter_config(drafter_type="eagle")


def test_parameter_names_are_the_export_keys():
    cfg = dflash2_config()
    drafter = build_drafter(cfg)
    shapes = {name: tuple(p.shape) for name, p in drafter.named_parameters()}
    assert shapes == export_shapes(cfg) and set(shapes) == set(export_keys(cfg))
    assert len(export_keys(cfg)) == 3 + 15 * 2 + 3
    assert shapes["candidate_selector.predecessor_codebook"] == (300, 8)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, 64)


@pytest.mark.parametrize("layer_types", [None, ("full_attention", "sliding_attention")])
def test_no_op_init_equals_dflash_exactly(layer_types):
    window = None if layer_types is None else 3
    cfg = dflash2_config(layer_types=layer_types, sliding_window=window, is_causal=True)
    ours, base = DFlash2Drafter(cfg), DFlashDrafter(cfg)
    init_dflash2_weights(ours, seed=3)
    init_drafter_weights(base, seed=3)
    state = ours.state_dict()
    for name, p in base.named_parameters():  # DFlash's init stream, untouched by the additions
        assert torch.equal(state[name], p), name
    with torch.no_grad():  # norms off one, the same in both, so a misplaced norm would show
        for name, p in base.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
                state[name].copy_(p)
    context, noise = inputs(cfg)
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden = single_block(ours.eval(), context, noise)
        expected = single_block(base.eval(), context, noise)
        assert torch.equal(hidden, expected)
        first = torch.tensor([7])
        drafts = ours.propose(hidden[:, 1:], lm_head, first)
        assert torch.equal(drafts, base.propose(expected[:, 1:], lm_head, first))


def test_taps_stay_inside_each_block():
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(2, 12, 32, generator=gen)
    dyn = torch.randn(2, 12, 3, 2, generator=gen)
    base = torch.randn(3, 32, generator=gen)
    slots = torch.arange(12) % 4
    packed = grouped_dynamic_conv(y, dyn, base, group_size=16, slot_Q=slots)
    for j in range(3):
        cols = slice(4 * j, 4 * j + 4)
        alone = grouped_dynamic_conv(
            y[:, cols], dyn[:, cols], base, group_size=16, slot_Q=torch.arange(4)
        )
        torch.testing.assert_close(packed[:, cols], alone, rtol=0, atol=0)
    # By hand, slot 1 of a block: (b0 + d0) * y1 + (b1 + d1) * y0, group of channel 20 is 1.
    t, ch = 5, 20
    by_hand = (base[0, ch] + dyn[0, t, 0, 1]) * y[0, t, ch]
    by_hand = by_hand + (base[1, ch] + dyn[0, t, 1, 1]) * y[0, t - 1, ch]
    torch.testing.assert_close(packed[0, t, ch], by_hand)


def test_packed_blocks_equal_blocks_alone():
    cfg = dflash2_config(layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    drafter = trained_like(cfg)
    context, _ = inputs(cfg, ctx=10)
    anchors = torch.tensor([[3, 6, 9]])
    gen = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 3 * cfg.block_size, 64, generator=gen)
    block_pos = (anchors[..., None] + torch.arange(cfg.block_size)).flatten(1)
    ctx_pos = torch.arange(10)[None]
    with torch.no_grad():
        masks = masks_for(cfg, anchors, torch.ones_like(anchors, dtype=torch.bool), 10)
        packed = drafter(context, noise, ctx_pos, block_pos, masks)
        for j, a in enumerate(anchors[0].tolist()):
            cols = slice(j * cfg.block_size, (j + 1) * cfg.block_size)
            one = masks_for(cfg, torch.tensor([[a]]), torch.tensor([[True]]), 10)
            alone = drafter(context, noise[:, cols], ctx_pos, block_pos[:, cols], one)
            torch.testing.assert_close(packed[:, cols], alone, rtol=1e-6, atol=1e-6)


def reference_model(export_dir):
    dflash_model = pytest.importorskip("dflash.model")
    ref = dflash_model.DFlash2DraftModel.from_pretrained(export_dir, dtype=torch.float32)
    return ref.eval()


@pytest.mark.parametrize(
    ("layer_types", "window", "causal"),
    [
        (None, 3, False),  # the published attention: all sliding, non-causal
        (None, 3, True),
        (("sliding_attention", "full_attention"), 3, True),
        (("full_attention", "full_attention"), None, False),
    ],
)
def test_forward_and_selector_equal_reference(tmp_path, layer_types, window, causal):
    cfg = dflash2_config(layer_types=layer_types, sliding_window=window, is_causal=causal)
    export_drafter(trained_like(cfg), cfg, tmp_path / "export")
    ref = reference_model(tmp_path / "export")
    ours, loaded_cfg = load_export(tmp_path / "export")  # the same bf16-rounded weights
    assert loaded_cfg == cfg and isinstance(ours, DFlash2Drafter)
    for layer in ref.layers:
        assert layer.self_attn.is_causal is causal
        assert layer.attention_conv is not None and layer.mlp_conv is not None
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    head = nn.Linear(64, 300, bias=False)
    head.weight.data.copy_(lm_head)
    overturned = 0
    for seed in range(6):
        context, noise = inputs(cfg, seed=seed)
        with torch.no_grad():
            expected = ref(
                target_hidden=context,
                noise_embedding=noise,
                position_ids=torch.arange(context.shape[1] + cfg.block_size)[None],
            )
            got = single_block(ours.eval(), context, noise)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            first = torch.tensor([11 + seed])
            ref_path, _, _ = ref.propose(expected[:, 1:], first, head, 0.0)
            path = ours.propose(got[:, 1:], lm_head, first)
            assert path.tolist() == ref_path.tolist()
            overturned += int((path != (got[:, 1:] @ lm_head.T).argmax(-1)).sum())
    assert overturned > 0  # the selector walk is exercised, not just the argmax
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dflash_config"]["selector_top_k"] == 5


def test_mask_causality_parameter():
    from train.drafters.mask import dense_mask

    def rows(layer_type, window, causal):
        mask = dense_mask(
            torch.tensor([[5]]),
            torch.tensor([[True]]),
            context_len=6,
            block_size=3,
            layer_type=layer_type,
            sliding_window=window,
            causal=causal,
        )
        return mask[0, 0].int().tolist()

    # Context keys 0..5 (anchor 5: keys 0..4 before it), then the block's keys 6..8.
    assert rows("full_attention", None, True) == [
        [1, 1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 1, 1, 1],
    ]
    # Non-causal sliding, window 2: slot i sees context [5 + i - 1, 5) and slots within 1 of it.
    assert rows("sliding_attention", 2, False) == [
        [0, 0, 0, 0, 1, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert rows("sliding_attention", 2, None) == rows("sliding_attention", 2, True)
    assert rows("full_attention", None, None) == rows("full_attention", None, False)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("causal", [False, True])
def test_flex_forward_equals_sdpa_forward(causal):
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = dflash2_config(sliding_window=3, is_causal=causal)
    drafter = trained_like(cfg)
    anchors = torch.tensor([[0, 2, 7, 0], [1, 5, 6, 10]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    gen = torch.Generator().manual_seed(3)
    context = torch.randn(2, 12, 3 * 64, generator=gen)
    noise = torch.randn(2, 4 * cfg.block_size, 64, generator=gen)
    ctx_pos = torch.arange(12).expand(2, 12)
    block_pos = (anchors[..., None] + torch.arange(cfg.block_size)).flatten(1)
    outs = {}
    with torch.no_grad():
        for attention in ("sdpa", "flex"):
            masks = build_masks(
                anchors, keep, context_len=12, block_size=cfg.block_size,
                layer_types=cfg.layer_types, sliding_window=cfg.sliding_window,
                attention=attention, causal=cfg.is_causal,
            )  # fmt: skip
            outs[attention] = drafter(
                context, noise, ctx_pos, block_pos, masks, attention=attention
            )
    torch.testing.assert_close(outs["flex"], outs["sdpa"], atol=1e-5, rtol=1e-5)


def test_target_logit_transform_is_carried_and_decodes_as_the_reference(tmp_path):
    """A target that scales and softcaps its logits (Granite, Gemma 2): DFlash2 takes both from
    its config, DFlash does not, and the selector walk on the export equals the reference's."""
    from tests.drafters import TINY_TARGET

    target = {**TINY_TARGET, "logits_scaling": 4.0, "final_logit_softcapping": 3.0}
    base = dict(num_layers=2, target_layer_ids=(1, 4, 6), block_size=4, mask_token_id=299)
    dflash = DrafterConfig.from_target_config(target, **base)
    assert (dflash.output_multiplier, dflash.final_logit_softcapping) == (None, None)
    extra = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=5)
    cfg = DrafterConfig.from_target_config(target, **base, **extra)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping) == (0.25, 3.0)
    given = DrafterConfig.from_target_config(target, **base, **extra, output_multiplier=0.5)
    assert given.output_multiplier == 0.5
    export_drafter(trained_like(cfg), cfg, tmp_path / "export")
    dflash_config = json.loads((tmp_path / "export" / "config.json").read_text())["dflash_config"]
    assert (dflash_config["output_multiplier"], dflash_config["final_logit_softcapping"]) == (
        0.25,
        3.0,
    )
    ref = reference_model(tmp_path / "export")
    ours, loaded_cfg = load_export(tmp_path / "export")
    assert loaded_cfg == cfg
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(2))
    head = nn.Linear(64, 300, bias=False)
    head.weight.data.copy_(lm_head)
    plain = DFlash2Drafter(
        dataclasses.replace(cfg, output_multiplier=None, final_logit_softcapping=None)
    )
    plain.load_state_dict(ours.state_dict())
    differs = 0
    for seed in range(6):
        context, noise = inputs(cfg, seed=seed)
        with torch.no_grad():
            hidden = single_block(ours.eval(), context, noise)[:, 1:]
            first = torch.tensor([11 + seed])
            ref_path, _, _ = ref.propose(hidden, first, head, 0.0)
            path = ours.propose(hidden, lm_head, first)
            assert path.tolist() == ref_path.tolist()
            differs += int((path != plain.eval().propose(hidden, lm_head, first)).sum())
    assert differs > 0  # the transform changes what the selector picks


def test_logit_options_are_for_dflash2_only():
    from train.config import TrainConfig

    with pytest.raises(
        ValueError, match="final_logit_softcapping: applies to --drafter-type dflash2"
    ):
        TrainConfig(data=Path("d"), out=Path("o"), final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="output_multiplier: must be > 0"):
        TrainConfig(data=Path("d"), out=Path("o"), drafter_type="dflash2", output_multiplier=0.0)
