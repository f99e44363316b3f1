"""Drafter config, batched forward vs a per-block reference, flex vs sdpa, checkpointing."""

import pytest
import torch

from tests.drafters import TINY_TARGET, drafter_masks, tiny_drafter, tiny_drafter_config
from train.drafters.anchors import block_positions
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.mask import flex_bwd_options, flex_kernel_options


def test_from_qwen3_config():
    cfg = DrafterConfig.from_target_config(
        {**TINY_TARGET, "vocab_size": 151936}, target_layer_ids=(1, 3, 5, 6, 7)
    )
    assert cfg.mask_token_id == 151669 and cfg.block_size == 16 and cfg.num_layers == 5
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (64, 2, 16)
    assert cfg.num_target_layers == 8 and cfg.num_context_layers == 5
    assert cfg.layer_types == ("full_attention",) * 5 and cfg.rope_scaling is None


def test_from_qwen35_nested_config():
    text = {k: v for k, v in TINY_TARGET.items() if k not in ("model_type", "rope_theta")}
    text.update(
        model_type="qwen3_5_text",
        vocab_size=248320,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
        },
    )
    target = {"model_type": "qwen3_5", "text_config": text}
    cfg = DrafterConfig.from_target_config(
        target,
        num_layers=3,
        target_layer_ids=(1, 4, 6),
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=64,
    )
    assert cfg.mask_token_id == 248070 and cfg.vocab_size == 248320
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None
    assert cfg.sliding_window == 64


def qwen35_text(**over) -> dict:
    """A Qwen3.5-shaped text config (attention 16 heads of 256, 4 kv heads), sizes overridable."""
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=248320,
    )
    return {k: v for k, v in {**text, **over}.items() if v is not None}


def shape(cfg: DrafterConfig) -> tuple:
    return (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)


def test_published_shapes_are_the_defaults():
    qwen3 = DrafterConfig.from_target_config(TINY_TARGET, target_layer_ids=(1,), mask_token_id=1)
    assert shape(qwen3) == (4, 2, 16, 128)  # Qwen3 dense: the target's own
    dense = DrafterConfig.from_target_config(
        {"model_type": "qwen3_5", "text_config": qwen35_text()}, target_layer_ids=(1, 9)
    )
    assert shape(dense) == (32, 8, 128, 9216)
    assert dense.layer_types == ("full_attention",) * 5 and dense.sliding_window is None
    moe = qwen35_text(
        model_type="qwen3_5_moe_text",
        hidden_size=2048,
        num_hidden_layers=40,
        num_key_value_heads=2,
        intermediate_size=None,  # MoE text configs have none
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    )
    a3b = DrafterConfig.from_target_config(
        {"model_type": "qwen3_5_moe", "text_config": moe}, target_layer_ids=(1, 13)
    )
    assert shape(a3b) == (32, 4, 128, 8 * 512 + 512)
    big = {
        "model_type": "qwen3_5",
        "text_config": qwen35_text(hidden_size=5120, num_hidden_layers=64),
    }
    b27 = DrafterConfig.from_target_config(big, target_layer_ids=(1, 16, 31, 46, 61))
    assert shape(b27)[:3] == (32, 8, 128)
    assert b27.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert b27.sliding_window == 2048


def test_options_override_the_published_shapes():
    big = {
        "model_type": "qwen3_5",
        "text_config": qwen35_text(hidden_size=5120, num_hidden_layers=64),
    }
    cfg = DrafterConfig.from_target_config(
        big,
        target_layer_ids=(1,),
        num_layers=2,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        sliding_window=512,
    )
    assert shape(cfg) == (16, 2, 64, 1024)
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 512
    full = DrafterConfig.from_target_config(
        big, target_layer_ids=(1,), layer_types=("full_attention",) * 5
    )
    assert full.layer_types == ("full_attention",) * 5 and full.sliding_window is None


def test_moe_target_without_mlp_sizes_asks_for_the_intermediate_size():
    text = qwen35_text(model_type="qwen3_5_moe_text", intermediate_size=None, num_experts=8)
    target = {"model_type": "qwen3_5_moe", "text_config": text}
    with pytest.raises(ValueError, match="--drafter-intermediate"):
        DrafterConfig.from_target_config(target, target_layer_ids=(1,))
    cfg = DrafterConfig.from_target_config(target, target_layer_ids=(1,), intermediate_size=512)
    assert shape(cfg) == (32, 4, 128, 512)


def test_mask_token_fallback_and_no_spare_row():
    other = {**TINY_TARGET, "model_type": "llama"}
    cfg = DrafterConfig.from_target_config(other, target_layer_ids=(1,), tokenizer_vocab_size=290)
    assert cfg.mask_token_id == 290
    with pytest.raises(ValueError, match="no spare row"):
        DrafterConfig.from_target_config(other, target_layer_ids=(1,), tokenizer_vocab_size=300)
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig.from_target_config(other, target_layer_ids=(1,))
    # A Qwen3-typed config whose embedding lacks row 151669 falls back to the tokenizer rule.
    small_qwen = DrafterConfig.from_target_config(
        TINY_TARGET, target_layer_ids=(1,), tokenizer_vocab_size=280
    )
    assert small_qwen.mask_token_id == 280


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"target_layer_ids": (1, 9)}, "target_layer_ids"),
        ({"layer_types": ("full_attention",)}, "layer_types"),
        ({"layer_types": ("full_attention", "sliding_attention")}, "sliding_window"),
        ({"mask_token_id": 300}, "mask_token_id"),
        ({"block_size": 1}, "block_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ],
)
def test_config_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        DrafterConfig(**{**tiny_drafter_config().to_dict(), **change})


def test_config_dict_round_trip():
    cfg = tiny_drafter_config(layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def _inputs(cfg: DrafterConfig, anchors, keep, seq: int = 12):
    gen = torch.Generator().manual_seed(3)
    batch, n_blocks = anchors.shape
    q_len = n_blocks * cfg.block_size
    context = torch.randn(batch, seq, cfg.num_context_layers * cfg.hidden_size, generator=gen)
    block_emb = torch.randn(batch, q_len, cfg.hidden_size, generator=gen)
    ctx_pos = torch.arange(seq).expand(batch, seq)
    return context, block_emb, ctx_pos, block_positions(anchors, ctx_pos, block_size=cfg.block_size)


def _reference_block(model, cfg, context_SC, emb_BH, anchor):
    """One block alone: context truncated to positions < anchor, its own tokens only."""
    bs = cfg.block_size
    pos = torch.arange(anchor + bs)
    # Visibility among [context ; block] by absolute position: full = all, sliding = causal window.
    q_pos, k_pos = pos[anchor:, None], pos[None, :]
    sliding = (k_pos <= q_pos) & (q_pos - k_pos < (cfg.sliding_window or 1))
    masks = {
        "full_attention": torch.ones(1, 1, bs, anchor + bs, dtype=torch.bool),
        "sliding_attention": sliding[None, None],
    }
    ctx, emb = context_SC[None, :anchor], emb_BH[None]
    return model(ctx, emb, pos[None, :anchor], pos[None, anchor:], masks)[0]


@pytest.mark.parametrize(
    "layer_types", [("full_attention", "full_attention"), ("sliding_attention", "full_attention")]
)
def test_batched_forward_equals_each_block_alone(layer_types):
    cfg = tiny_drafter_config(layer_types=layer_types, sliding_window=3)
    model = tiny_drafter(cfg)
    anchors = torch.tensor([[0, 2, 7, 0], [1, 5, 6, 10]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    context, block_emb, ctx_pos, block_pos = _inputs(cfg, anchors, keep)
    with torch.no_grad():
        out = model(context, block_emb, ctx_pos, block_pos, drafter_masks(cfg, anchors, keep, 12))
        assert out.shape == block_emb.shape and torch.isfinite(out).all()
        bs = cfg.block_size
        for b in range(2):
            for j in range(4):
                if not keep[b, j]:
                    continue
                cols = slice(j * bs, (j + 1) * bs)
                ref = _reference_block(
                    model, cfg, context[b], block_emb[b, cols], int(anchors[b, j])
                )
                torch.testing.assert_close(out[b, cols], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_forward_equals_sdpa_forward():
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = tiny_drafter_config(layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    model = tiny_drafter(cfg)
    anchors = torch.tensor([[0, 2, 7, 0], [1, 5, 6, 10]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    args = _inputs(cfg, anchors, keep)
    with torch.no_grad():
        sdpa = model(*args, drafter_masks(cfg, anchors, keep, 12), attention="sdpa")
        flex = model(*args, drafter_masks(cfg, anchors, keep, 12, "flex"), attention="flex")
        # Backward block sizes (the trainer sets them per device) reach flex_attention and leave
        # the forward as it was.
        model.use_flex_options(flex_bwd_options((32, 64, 64, 32, 4, 2)))
        assert all(layer.self_attn.flex_options for layer in model.layers)
        tuned = model(*args, drafter_masks(cfg, anchors, keep, 12, "flex"), attention="flex")
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tuned, flex)
    assert flex_kernel_options(cfg.head_dim, torch.device("cpu")) is None


def test_layer_checkpointing_gives_the_same_gradients():
    cfg = tiny_drafter_config(layer_types=("sliding_attention", "full_attention"), sliding_window=3)
    model = tiny_drafter(cfg).train()
    anchors, keep = torch.tensor([[2, 7]]), torch.tensor([[True, False]])
    args = _inputs(cfg, anchors, keep)
    masks = drafter_masks(cfg, anchors, keep, 12)
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        model(*args, masks, checkpoint_layers=ckpt).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, ckpt in zip(*grads, strict=True):
        torch.testing.assert_close(plain, ckpt)


def test_init_is_deterministic():
    cfg = tiny_drafter_config()
    a, b, c = DFlashDrafter(cfg), DFlashDrafter(cfg), DFlashDrafter(cfg)
    init_drafter_weights(a, 1)
    init_drafter_weights(b, 1)
    init_drafter_weights(c, 2)
    for (name, pa), pb, pc in zip(
        a.named_parameters(), b.parameters(), c.parameters(), strict=True
    ):
        assert torch.equal(pa, pb)
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc)
            assert 0.01 < pa.std().item() < 0.03
