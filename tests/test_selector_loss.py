"""DFlash2 loss: CE_base and the selector's K-way CE on a hand-computed example, the alpha
schedule, stop-gradient, and selected-token metrics beside the unary ones."""

import dataclasses
import doctest
import math

import pytest
import torch

import train.drafters.dflash2
import train.drafters.dflash2_fused
import train.drafters.dflash2_loss
import train.drafters.topk
from tests.drafters import tiny_drafter_config
from tests.inductor import compile_problem
from train.drafters.dflash2 import CandidateSelector, DFlash2Drafter, init_dflash2_weights
from train.drafters.dflash2_loss import (
    SelectorLoss,
    selector_alpha,
    selector_chunked_ce,
    selector_step_terms,
)


def lse(*xs):
    return math.log(sum(math.exp(x) for x in xs))


def hand_selector():
    """V 4, H 2, rank 1, top 2: W_hp = [1, 0], P[3] = 0.5, S[1] = 3, every other entry 0."""
    cfg = tiny_drafter_config(
        drafter_type="dflash2", selector_rank=1, selector_top_k=2, conv_group_size=16
    )
    cfg = dataclasses.replace(cfg, hidden_size=2, vocab_size=4, mask_token_id=3, conv_group_size=2)
    selector = CandidateSelector(cfg)
    with torch.no_grad():
        selector.hidden_projection.weight.copy_(torch.tensor([[1.0, 0.0]]))
        selector.predecessor_codebook.zero_()
        selector.predecessor_codebook[3, 0] = 0.5
        selector.successor_codebook.zero_()
        selector.successor_codebook[1, 0] = 3.0
    return selector, cfg


def test_doctests():
    for module in (
        train.drafters.dflash2_loss,
        train.drafters.dflash2,
        train.drafters.dflash2_fused,
    ):
        assert doctest.testmod(module).failed == 0


def test_selector_loss_against_hand_computed_example():
    selector, cfg = hand_selector()
    lm_head = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.2, 1.0]])
    targets, predecessors = torch.tensor([1, 2, 0]), torch.tensor([3, 0, 3])
    weights = torch.tensor([1.0, 0.5, 0.25])
    out = selector_chunked_ce(
        hidden, lm_head, targets, predecessors, weights, selector, cfg, chunk_rows=2
    )
    # Row 0: logits [2, 1, 0, -1], C = [0, 1]; scores [2, 1 + 0.5 * 1 * 3] pick token 1 (gold).
    # Row 1: gold 2 is not in C = [0, 1]: no selector term. Row 2: logits [.4, .2, 1, -.2],
    # C = [2, 0], the bilinear term is 0.5 * 0.2 * 0 = 0, scores [1, .4], gold index 1.
    expected_ce = (
        (lse(2, 1, 0, -1) - 1) + 0.5 * lse(2, 1, 0, -1) + 0.25 * (lse(0.4, 0.2, 1, -0.2) - 0.4)
    )
    expected_sel = (lse(2, 2.5) - 2.5) + 0.25 * (lse(1, 0.4) - 0.4)
    assert math.isclose(float(out.ce_sum.detach()), expected_ce, rel_tol=1e-6)
    assert math.isclose(float(out.selector_ce_sum.detach()), expected_sel, rel_tol=1e-6)
    assert math.isclose(float(out.selector_weight), 1.25) and float(out.weight_total) == 1.75
    assert out.correct_N.tolist() == [False, False, False]
    assert out.selected_correct_N.tolist() == [True, False, False]


def test_alpha_schedule():
    assert selector_alpha(0, 100) == 1.0 and selector_alpha(5, 100, alpha=0.5) == 0.5
    ramp = [selector_alpha(s, 100, warmup_fraction=0.1, ramp_fraction=0.2) for s in (9, 10, 20)]
    assert ramp == [0.0, 0.0, 0.5]
    assert selector_alpha(30, 100, warmup_fraction=0.1, ramp_fraction=0.2) == 1.0


def _step(drafter, hidden, options, targets, w, keep):
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    return selector_step_terms(
        hidden, lm_head, targets, w, keep, drafter.candidate_selector, drafter.cfg,
        chunk_rows=3, checkpoint=True, options=options,
    )  # fmt: skip


def _batch():
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 300, (2, 8), generator=gen)
    w = torch.rand(2, 8, generator=gen) * (torch.arange(8) % 4 > 0)
    return targets, w, torch.tensor([[True, True], [True, False]])


def test_step_terms_alpha_stop_gradient_and_selected_stats():
    cfg = tiny_drafter_config(
        drafter_type="dflash2", selector_rank=8, selector_top_k=300, conv_group_size=16
    )  # top-K = V: the gold token is always a candidate, so the selector term never vanishes
    drafter = DFlash2Drafter(cfg)
    init_dflash2_weights(drafter, 0)
    targets, w, keep = _batch()
    base = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    # No-op start: the selector picks the unary argmax, so its metrics equal the unary ones.
    _, _, stats = _step(drafter, base, SelectorLoss(), targets, w, keep)
    assert torch.equal(stats["selected_correct_per_offset"], stats["correct_per_offset"])
    assert float(stats["selected_tau"]) == float(stats["tau"])
    assert math.isclose(float(stats["selector_weight"]), float(w.sum()), rel_tol=1e-6)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 1.0)
    grads = {}
    for name, options in (
        ("off", SelectorLoss(alpha=0.0)),
        ("stop", SelectorLoss(alpha=2.0, stop_gradient=True)),
        ("on", SelectorLoss(alpha=2.0)),
    ):
        hidden = base.clone().requires_grad_()
        drafter.zero_grad()
        total, norm, stats = _step(drafter, hidden, options, targets, w, keep)
        expected = stats["ce_base_sum"] + options.alpha * stats["selector_ce_sum"]
        torch.testing.assert_close(total.detach(), expected)
        assert float(norm) == float(w.sum())
        total.backward()
        selector_grad = drafter.candidate_selector.successor_codebook.grad
        grads[name] = (hidden.grad, None if selector_grad is None else selector_grad.abs().sum())
    torch.testing.assert_close(grads["stop"][0], grads["off"][0])  # backbone: CE_base only
    assert not torch.allclose(grads["on"][0], grads["off"][0])
    assert float(grads["stop"][1]) > 0 and float(grads["off"][1]) == 0


def test_stat_sums_carry_selected_metrics_only_for_dflash2():
    from train.metrics import SELECTOR_KEYS, StatSums

    cfg = tiny_drafter_config(
        drafter_type="dflash2", selector_rank=8, selector_top_k=5, conv_group_size=16
    )
    drafter = DFlash2Drafter(cfg)
    init_dflash2_weights(drafter, 0)
    targets, w, keep = _batch()
    hidden = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    total, norm, stats = _step(drafter, hidden, SelectorLoss(alpha=0.5), targets, w, keep)
    sums = StatSums(4, torch.device("cpu"))
    sums.add(total, norm, stats, torch.tensor(16))
    out = sums.reduce()
    assert set(SELECTOR_KEYS) <= set(out) and len(out["selected_acc"]) == 3
    assert out["selected_tau"] == float(stats["selected_tau"])
    wt = float(w.sum())
    assert math.isclose(out["ce_base"], float(stats["ce_base_sum"]) / wt, rel_tol=1e-9)
    assert math.isclose(out["selector_coverage"], float(stats["selector_weight"]) / wt)
    plain = {k: v for k, v in stats.items() if not k.startswith("selected_")}
    sums.add(total, norm, plain, torch.tensor(16))
    assert not set(SELECTOR_KEYS) & set(sums.reduce())


@pytest.mark.parametrize(
    "transform, compiled, blocks",
    [
        (None, False, False),
        ((0.5, 2.0), False, False),
        (None, True, False),
        ((0.5, 2.0), True, False),
        (None, False, True),
        (None, True, True),
    ],
    ids=[
        "eager",
        "eager-softcap",
        "compiled",
        "compiled-softcap",
        "eager-blocks",
        "compiled-blocks",
    ],
)
def test_fused_equals_checkpointed_loss_and_gradients(transform, compiled, blocks, monkeypatch):
    """The fused path (hand-derived [n, V] gradients, the selector's by local autograd) against
    autograd through the whole chunk; compiled, with a padded short last chunk (16 rows in
    chunks of 5); with a logit scale and softcap, whose slope both terms go through; with the
    fused path's top-K taken through the blocks' maxima (blocks of 2 of the 300 columns, the
    top 75: a quarter of the gold tokens are candidates; else the top 150, by one topk)."""
    if compiled and (reason := compile_problem()):
        pytest.skip(reason)
    monkeypatch.setattr(train.drafters.topk, "BLOCK_WIDTHS", (2,) if blocks else ())
    cfg = tiny_drafter_config(
        drafter_type="dflash2", selector_rank=8, selector_top_k=75 if blocks else 150,
        conv_group_size=16,
    )  # fmt: skip
    if transform is not None:
        cfg = dataclasses.replace(
            cfg, output_multiplier=transform[0], final_logit_softcapping=transform[1]
        )
    drafter = DFlash2Drafter(cfg)
    init_dflash2_weights(drafter, 0)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(0, 1.0)
    targets, w, keep = _batch()
    base = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    for stop in (False, True):
        results = []
        for fused in (False, True):
            hidden = base.clone().requires_grad_()
            drafter.zero_grad()
            lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
            total, _, stats = selector_step_terms(
                hidden, lm_head, targets, w, keep, drafter.candidate_selector, cfg,
                chunk_rows=5, checkpoint=True, fused=fused, compiled=compiled and fused,
                options=SelectorLoss(alpha=0.7, stop_gradient=stop),
            )  # fmt: skip
            (3.0 * total).backward()  # the upstream scale reaches every gradient
            grads = [hidden.grad] + [p.grad for p in drafter.candidate_selector.parameters()]
            results.append((total.detach(), stats, grads))
        (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = results
        torch.testing.assert_close(loss_b, loss_a)
        for key in ("ce_base_sum", "selector_ce_sum", "selected_tau", "tau"):
            torch.testing.assert_close(stats_b[key], stats_a[key])
        assert float(stats_a["selector_ce_sum"]) > 0
        for a, b in zip(grads_a, grads_b, strict=True):
            assert a is None or a.abs().sum() > 0
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
