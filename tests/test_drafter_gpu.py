"""GPU only: compiled flex attention matches sdpa (forward and backward) without recompiles."""

import pytest
import torch

from train.data.batch import Batch
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.mask import SM90_FLEX_BWD, flex_bwd_options
from train.step import forward_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

TARGET = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 8,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
}


def _setup(head_dim: int = 64):
    cfg = DrafterConfig.from_target_config(
        TARGET | {"head_dim": head_dim},
        num_layers=2,
        target_layer_ids=(2, 5),
        block_size=16,
        mask_token_id=511,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=64,
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(512, 256, generator=gen).cuda()
    lm_head = (torch.randn(512, 256, generator=gen) / 16).cuda()
    return cfg, drafter.cuda(), embed, lm_head


def _batch(seq: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([seq, seq - 37])
    return Batch.one_per_row(
        lengths,
        ids_BS=torch.randint(0, 511, (2, seq), generator=gen),
        loss_mask_BS=(torch.rand(2, seq, generator=gen) < 0.9).to(torch.uint8),
        hidden_BSKH=torch.randn(2, seq, 2, 256, generator=gen).bfloat16(),
    ).to("cuda")


def _step(cfg, drafter, embed, lm_head, batch, attention, **kwargs):
    drafter.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = forward_loss(
            drafter,
            embed,
            lm_head,
            batch,
            num_anchors=32,
            block_size=16,
            gamma=7.0,
            mask_token_id=511,
            attention=attention,
            generator=torch.Generator().manual_seed(1),
            **kwargs,
        )
    loss = out.weighted_sum / out.weight_total
    loss.backward()
    return loss.detach(), [p.grad.float().clone() for p in drafter.parameters()]


def test_compiled_flex_matches_sdpa_forward_and_backward():
    cfg, drafter, embed, lm_head = _setup()
    batch = _batch(256, 0)
    sdpa_loss, sdpa_grads = _step(cfg, drafter, embed, lm_head, batch, "sdpa")
    flex_loss, flex_grads = _step(cfg, drafter, embed, lm_head, batch, "flex")
    assert torch.isfinite(flex_loss)
    torch.testing.assert_close(flex_loss, sdpa_loss, atol=2e-2, rtol=2e-2)
    for a, b in zip(flex_grads, sdpa_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos > 0.99


# The product's tuned backward blocks (train.drafters.mask.SM90_FLEX_BWD), and one fixed set so the
# kernel_options path is covered whatever the table holds.
TUNED = sorted(SM90_FLEX_BWD.items()) + [(256, (32, 64, 64, 32, 4, 2))]


@pytest.mark.parametrize(("head_dim", "blocks"), TUNED)
def test_flex_with_backward_block_options_matches_sdpa(head_dim, blocks):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block options are tuned for sm90 (their shared memory may not fit)")
    cfg, drafter, embed, lm_head = _setup(head_dim)
    batch = _batch(256, 0)
    sdpa_loss, sdpa_grads = _step(cfg, drafter, embed, lm_head, batch, "sdpa")
    drafter.use_flex_options(flex_bwd_options(blocks))
    flex_loss, flex_grads = _step(cfg, drafter, embed, lm_head, batch, "flex")
    torch.testing.assert_close(flex_loss, sdpa_loss, atol=2e-2, rtol=2e-2)
    for a, b in zip(flex_grads, sdpa_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos > 0.99


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_a_training_step_never_waits_for_the_device(attention):
    """A wait would stop the host from queueing the step ahead of the device (it then idles
    while the host catches up); the trainer reads values back once per logging window only."""
    cfg, drafter, embed, lm_head = _setup()
    batch = _batch(256, 0)
    _step(cfg, drafter, embed, lm_head, batch, attention)  # compilation, first allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _ = _step(cfg, drafter, embed, lm_head, batch, attention)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)


def test_padded_lengths_do_not_hit_the_recompile_limit():
    cfg, drafter, embed, lm_head = _setup()
    # More distinct lengths than dynamo's default recompile limit (8); mask.py makes a hit fatal.
    for i, seq in enumerate(range(128, 128 * 12, 128)):
        loss, _ = _step(cfg, drafter, embed, lm_head, _batch(seq, i), "flex")
        assert torch.isfinite(loss)


def test_compiled_fused_ce_matches_autograd_ce_under_autocast():
    cfg, drafter, embed, lm_head = _setup()
    batch = _batch(384, 3)  # 2 x 32 blocks of 16 = 1024 rows: a short last chunk of 3 blocks
    ref_loss, ref_grads = _step(cfg, drafter, embed, lm_head, batch, "sdpa", ce="autograd",
                                ce_chunk_blocks=61)  # fmt: skip
    loss, grads = _step(cfg, drafter, embed, lm_head, batch, "sdpa", ce="fused", compile_ce=True,
                        ce_chunk_blocks=61)  # fmt: skip
    torch.testing.assert_close(loss, ref_loss, atol=1e-3, rtol=1e-3)
    for a, b in zip(grads, ref_grads, strict=True):
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
        assert cos > 0.999
