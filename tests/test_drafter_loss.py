"""Chunked CE equals plain CE (value and gradient); acceptance stats; the training forward."""

import pytest
import torch
import torch.nn.functional as F

from tests.drafters import tiny_drafter_config
from train.data.batch import Batch
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.loss import acceptance_stats, chunked_ce
from train.step import forward_loss


@pytest.mark.parametrize(("chunk_rows", "checkpoint"), [(7, True), (7, False), (100, True)])
def test_chunked_ce_equals_plain_ce_and_its_gradient(chunk_rows, checkpoint):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(30, 16, generator=gen, requires_grad=True)
    head = torch.randn(50, 16, generator=gen)
    targets = torch.randint(0, 50, (30,), generator=gen)
    weights = torch.rand(30, generator=gen) * (torch.arange(30) % 4 != 0)

    logits = hidden @ head.T
    plain = (F.cross_entropy(logits, targets, reduction="none") * weights).sum()
    (plain_grad,) = torch.autograd.grad(plain, hidden)

    total, norm, correct = chunked_ce(
        hidden, head, targets, weights, chunk_rows=chunk_rows, checkpoint=checkpoint
    )
    (grad,) = torch.autograd.grad(total, hidden)
    torch.testing.assert_close(total, plain)
    torch.testing.assert_close(norm, weights.sum())
    torch.testing.assert_close(grad, plain_grad)
    assert torch.equal(correct, logits.argmax(-1) == targets)


def test_acceptance_stats_on_literal_tensors():
    # Two blocks of 4 (offset 0 never counts). Block 0: offsets 1, 2 correct, 3 wrong -> 2.
    # Block 1: offset 1 correct, offset 2 has no valid target (ends the run) -> 1.
    correct = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1]]).bool()
    w = torch.tensor([[0, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0]]).float()
    keep = torch.tensor([[True, True, False]])
    stats = acceptance_stats(correct, w, keep, block_size=4)
    assert stats["correct_per_offset"].tolist() == [0, 2, 1, 1]
    assert stats["count_per_offset"].tolist() == [0, 2, 1, 2]
    assert stats["accepted_sum"].item() == 3 and stats["num_blocks"].item() == 2
    assert stats["tau"].item() == pytest.approx(1 + 3 / 2)


def _setup(layer_types=("full_attention", "full_attention"), sliding_window=None):
    cfg = tiny_drafter_config(
        target_layer_ids=(2, 5), layer_types=layer_types, sliding_window=sliding_window
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    gen = torch.Generator().manual_seed(1)
    embed = torch.randn(300, 64, generator=gen)
    lm_head = torch.randn(300, 64, generator=gen) / 8
    ids = torch.randint(0, 299, (2, 24), generator=gen)
    loss_mask = torch.ones(2, 24, dtype=torch.uint8)
    loss_mask[:, :4] = 0
    batch = Batch.one_per_row(
        torch.tensor([24, 17]),
        ids_BS=ids,
        loss_mask_BS=loss_mask,
        hidden_BSKH=torch.randn(2, 24, 2, 64, generator=gen).bfloat16(),
    )
    return cfg, drafter, embed, lm_head, batch


def _loss(cfg, drafter, embed, lm_head, batch, seed=0, **kwargs):
    return forward_loss(
        drafter,
        embed,
        lm_head,
        batch,
        num_anchors=8,
        block_size=cfg.block_size,
        gamma=2.0,
        mask_token_id=cfg.mask_token_id,
        attention="sdpa",
        generator=torch.Generator().manual_seed(seed),
        ce_chunk_blocks=3,
        **kwargs,
    )


def test_loss_decreases_over_optimizer_steps():
    cfg, drafter, embed, lm_head, batch = _setup(("sliding_attention", "full_attention"), 3)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    losses, taus = [], []
    for step in range(30):
        out = _loss(cfg, drafter, embed, lm_head, batch, seed=step % 3)
        loss = out.weighted_sum / out.weight_total
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        taus.append(out.stats["tau"].item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    assert taus[-1] > taus[0]
    assert not embed.requires_grad and not lm_head.requires_grad


@pytest.mark.parametrize("mode", ["none", "layers"])
def test_checkpoint_modes_give_the_same_loss_and_gradients(mode):
    cfg, drafter, embed, lm_head, batch = _setup(("sliding_attention", "full_attention"), 3)
    results = []
    for grad_ckpt in ("loss", mode):
        drafter.zero_grad()
        out = _loss(cfg, drafter, embed, lm_head, batch, grad_ckpt=grad_ckpt)
        out.weighted_sum.backward()
        results.append((out.weighted_sum.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("grad_ckpt", ["loss", "none", "layers"])
def test_fused_ce_gives_the_loss_and_gradients_of_autograd_ce(grad_ckpt):
    cfg, drafter, embed, lm_head, batch = _setup(("sliding_attention", "full_attention"), 3)
    results = []
    for ce in ("autograd", "fused"):
        drafter.zero_grad()
        out = _loss(cfg, drafter, embed, lm_head, batch, grad_ckpt=grad_ckpt, ce=ce)
        (out.weighted_sum / 3.0).backward()
        grads = [p.grad.clone() for p in drafter.parameters()]
        results.append((out.weighted_sum.detach(), out.stats["tau"], grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_forward_loss_counts_only_valid_targets():
    cfg, drafter, embed, lm_head, batch = _setup()
    with torch.no_grad():
        out = _loss(cfg, drafter, embed, lm_head, batch)
    # Row 1 has length 17: anchors <= 15; at most 8 kept blocks per row, offsets 1..3 weighted.
    assert out.stats["num_blocks"].item() == 16
    assert 0 < out.weight_total.item() <= 16 * 3
    assert out.stats["count_per_offset"][0].item() == 0
    assert torch.isfinite(out.weighted_sum)


def test_batch_and_argument_validation():
    cfg, drafter, embed, lm_head, batch = _setup()
    with pytest.raises(ValueError, match="exactly one"):
        Batch(
            ids_BS=batch.ids_BS,
            loss_mask_BS=batch.loss_mask_BS,
            doc_ids_BS=batch.doc_ids_BS,
            positions_BS=batch.positions_BS,
        )
    with pytest.raises(ValueError, match="grad_ckpt"):
        _loss(cfg, drafter, embed, lm_head, batch, grad_ckpt="all")
    with pytest.raises(ValueError, match="ce must be"):
        _loss(cfg, drafter, embed, lm_head, batch, ce="triton")
    flat = Batch(
        ids_BS=batch.ids_BS,
        loss_mask_BS=batch.loss_mask_BS,
        doc_ids_BS=batch.doc_ids_BS,
        positions_BS=batch.positions_BS,
        context_BSC=batch.hidden_BSKH.flatten(2),
    )
    with torch.no_grad():
        a = _loss(cfg, drafter, embed, lm_head, batch)
        b = _loss(cfg, drafter, embed, lm_head, flat)
    torch.testing.assert_close(a.weighted_sum, b.weighted_sum)
