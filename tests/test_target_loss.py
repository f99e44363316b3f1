"""The DFlash losses against the target's distribution (kl, tv, mix) and the slot weights
(exp, uniform, dpace), on tiny fp32 shapes: chunked (fused and autograd) equal to a dense
reference built from torch's own functions, in value and in the gradient of the hidden states."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.inductor import compile_problem
from train.drafters.anchors import loss_weights
from train.drafters.objective import Objective
from train.drafters.target_loss import chunked_target_loss, dpace_weights
from train.drafters.target_rows import TargetRows

N, H, V, BLOCK = 12, 8, 13, 3


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    last = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g) * (torch.arange(N) % BLOCK != 0)  # offset 0: weight 0
    return hidden, lm_head, last, labels, weights


def dense(hidden, lm_head, last, labels, weights, objective):
    """sum_n w_n * loss_n over the whole [N, V] logits, from torch's own losses."""
    logits = hidden @ lm_head.T
    logq = torch.log_softmax(logits, dim=-1)
    p = torch.softmax(last @ lm_head.T, dim=-1)
    ce = F.cross_entropy(logits, labels, reduction="none")
    kl = F.kl_div(logq, p, reduction="none").sum(-1)
    tv = 0.5 * (logq.exp() - p).abs().sum(-1)
    c_ce, c_kl, c_tv = objective.coefficients
    return ((c_ce * ce + c_kl * kl + c_tv * tv) * weights).sum()


def chunked(hidden, lm_head, last, labels, weights, objective, **kw):
    h = hidden.clone().requires_grad_(True)
    target = TargetRows.each(last) if objective.needs_target else None
    out = chunked_target_loss(
        h, lm_head, labels, target, weights, objective=objective, block_size=BLOCK,
        chunk_rows=2 * BLOCK, **kw,
    )  # fmt: skip
    out.loss.backward()
    return out, h.grad


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("loss", ["kl", "tv", "mix", "ce"])
def test_chunked_equals_dense_in_value_and_gradient(tensors, loss, fused):
    objective = Objective(loss, kl_weight=0.3)
    h = tensors[0].clone().requires_grad_(True)
    reference = dense(h, *tensors[1:], objective)
    reference.backward()
    # 12 rows in chunks of 6, and in chunks of 9 (a shorter last chunk)
    for rows in (2, 3):
        x = tensors[0].clone().requires_grad_(True)
        target = TargetRows.each(tensors[2]) if objective.needs_target else None
        out = chunked_target_loss(
            x, tensors[1], tensors[3], target, tensors[4], objective=objective,
            block_size=BLOCK, chunk_rows=rows * BLOCK, fused=fused,
        )  # fmt: skip
        out.loss.backward()
        assert out.loss.item() == pytest.approx(reference.item(), rel=1e-5)
        torch.testing.assert_close(x.grad, h.grad, rtol=1e-4, atol=1e-6)
        assert out.weight_total.item() == pytest.approx(tensors[4].sum().item())


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_identical_distributions_cost_nothing(tensors, loss):
    hidden, lm_head, _, labels, weights = tensors
    for fused in (True, False):
        out, grad = chunked(hidden, lm_head, hidden, labels, weights, Objective(loss), fused=fused)
        assert abs(out.loss.item()) < 1e-5 and grad.abs().max().item() < 1e-5
        assert out.terms[2].abs().item() < 1e-5 and out.terms[3].abs().item() < 1e-5
    # and a different target costs something
    out, _ = chunked(hidden, lm_head, tensors[2], labels, weights, Objective(loss))
    assert out.loss.item() > 0.01


def test_mix_is_the_weighted_sum_of_ce_and_kl(tensors):
    hidden, lm_head, last, labels, weights = tensors
    lam = 0.3
    mix, mix_grad = chunked(hidden, lm_head, last, labels, weights, Objective("mix", kl_weight=lam))
    ce, ce_grad = chunked(hidden, lm_head, last, labels, weights, Objective("ce"))
    kl, kl_grad = chunked(hidden, lm_head, last, labels, weights, Objective("kl"))
    expected = (1 - lam) * ce.loss + lam * kl.loss
    assert mix.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(mix_grad, (1 - lam) * ce_grad + lam * kl_grad)
    # the terms record both, whatever the mix: sum w, sum w ce, sum w kl
    torch.testing.assert_close(mix.terms[:3], torch.stack([weights.sum(), ce.loss, kl.loss]))


def test_each_row_counts_with_its_own_weight(tensors):
    """Weight one row at a time: the loss is that row's term times its weight, and nothing of
    the other rows (the slot weights are applied per position)."""
    hidden, lm_head, last, labels, _ = tensors
    per_row = []
    for n in range(N):
        w = torch.zeros(N)
        w[n] = 2.5
        out, grad = chunked(hidden, lm_head, last, labels, w, Objective("tv"))
        assert grad[torch.arange(N) != n].abs().max().item() == 0.0
        per_row.append(out.loss.item() / 2.5)
    p = torch.softmax(last @ lm_head.T, -1)
    tv = 0.5 * (torch.softmax(hidden @ lm_head.T, -1) - p).abs().sum(-1)
    assert per_row == pytest.approx(tv.tolist(), rel=1e-5)


def test_slot_weights_exp_and_uniform_per_offset():
    mask, docs = torch.ones(1, 8, dtype=torch.long), torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1]])
    anchors, keep = torch.tensor([[0, 4]]), torch.tensor([[True, True]])
    args = (mask, docs, anchors, keep)
    exp = loss_weights(*args, block_size=4, gamma=2.0)
    uniform = loss_weights(*args, block_size=4, gamma=None, decay="uniform")
    decay = [0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]
    assert exp[0].tolist() == pytest.approx(decay + [0.0, 1.0, math.exp(-0.5), 0.0])
    assert uniform[0].tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # row 7: another sample
    with pytest.raises(ValueError, match="needs gamma"):
        loss_weights(*args, block_size=4, gamma=None)


def test_dpace_weights_are_speculators():
    losses = pytest.importorskip("speculators.losses")
    g = torch.Generator().manual_seed(1)
    ce = torch.rand(5 * 4, generator=g) * 3
    counts = (torch.rand(5 * 4, generator=g) > 0.3).float()
    counts[::4] = 0  # offset 0 never counts
    ours = dpace_weights(ce, counts, block_size=4, alpha=0.3)
    masked = (ce * counts)[None]  # speculators hands it the masked CE
    theirs = losses.dpace_loss_decay(
        torch.arange(20) % 4, loss_mask=counts[None], block_size=4, dpace_alpha=0.3,
        elementwise_loss=masked,
    )  # fmt: skip
    torch.testing.assert_close(ours, theirs.flatten())


@pytest.mark.parametrize("fused", [True, False])
def test_dpace_loss_is_the_ce_with_detached_dpace_weights(tensors, fused):
    hidden, lm_head, _, labels, weights = tensors
    counts = (weights > 0).float()
    objective = Objective("ce", slot_weights="dpace", dpace_alpha=0.5)
    out, grad = chunked(hidden, lm_head, None, labels, counts, objective, fused=fused)
    h = hidden.clone().requires_grad_(True)
    ce = F.cross_entropy(h @ lm_head.T, labels, reduction="none")
    w = dpace_weights(ce.detach(), counts, block_size=BLOCK, alpha=0.5)
    reference = (ce * w).sum()
    reference.backward()
    assert out.loss.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-6)
    assert out.weight_total.item() == counts.sum().item()  # divided by the counted slots
    assert out.terms[0].item() == pytest.approx(w.sum().item(), rel=1e-6)


def test_the_target_state_must_match_the_loss(tensors):
    hidden, lm_head, last, labels, weights = tensors
    with pytest.raises(ValueError, match="'kl': the target's last hidden state is missing"):
        chunked_target_loss(hidden, lm_head, labels, None, weights, objective=Objective("kl"),
                            block_size=BLOCK, chunk_rows=BLOCK)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 3"):
        chunked_target_loss(hidden, lm_head, labels, TargetRows.each(last), weights,
                            objective=Objective("kl"), block_size=BLOCK, chunk_rows=4)  # fmt: skip


# Blocks overlap: rows read states 1, 2, 2 | 3, 3, 3 | 0, 2, 2 | 4, 4, 1 of 5 (chunks of one
# block of 3 rows), so the repeats lie within chunks and across their edges.
SHARED_INDEX = torch.tensor([1, 2, 2, 3, 3, 3, 0, 2, 2, 4, 4, 1])


def _shared_reads(seed):
    g = torch.Generator().manual_seed(seed)
    hidden, lm_head = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    states = torch.randn(5, H, generator=g) * 2
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, lm_head, states, labels, torch.rand(N, generator=g)


@pytest.mark.parametrize("mode", ["plain", "checkpoint", "fused"])
@pytest.mark.parametrize("loss", ["kl", "tv", "mix"])
def test_rows_reading_one_state_get_its_distribution_across_chunk_edges(mode, loss):
    hidden, lm_head, states, labels, weights = _shared_reads(5)
    outs = []
    for target in (TargetRows(states, SHARED_INDEX), TargetRows.each(states[SHARED_INDEX])):
        h = hidden.clone().requires_grad_()
        out = chunked_target_loss(
            h, lm_head, labels, target, weights, objective=Objective(loss, kl_weight=0.4),
            block_size=BLOCK, chunk_rows=BLOCK, fused=mode == "fused",
            checkpoint=mode == "checkpoint",
        )  # fmt: skip
        out.loss.backward()
        outs.append((out.loss.detach(), out.terms, out.correct_N, h.grad))
    # the same values, up to the rounding of a matmul over fewer rows
    for shared, gathered in zip(*outs, strict=True):
        torch.testing.assert_close(shared, gathered, rtol=1e-5, atol=1e-6)
    assert float(outs[0][1][2]) > 0  # the kl term was measured


@pytest.mark.parametrize("fused", [True, False])
def test_the_targets_lm_head_runs_once_per_distinct_state_of_a_chunk(fused):
    # 2 + 1 + 2 + 2 = 7 distinct states over the 4 chunks, not 12 rows
    hidden, lm_head, states, labels, weights = _shared_reads(6)
    flops = []
    for target in (TargetRows(states, SHARED_INDEX), TargetRows.each(states[SHARED_INDEX])):
        with FlopCounterMode(display=False) as counter:
            chunked_target_loss(
                hidden, lm_head, labels, target, weights, objective=Objective("kl"),
                block_size=BLOCK, chunk_rows=BLOCK, fused=fused, checkpoint=False,
            )  # fmt: skip
        flops.append(counter.get_total_flops())
    assert flops[1] - flops[0] == (N - 7) * 2 * H * V


def test_a_read_outside_the_states_is_refused():
    hidden, lm_head, states, labels, weights = _shared_reads(7)
    index = SHARED_INDEX.clone()
    index[4] = 5
    with pytest.raises(ValueError, match="rows read states 0..5, there are 5"):
        chunked_target_loss(
            hidden, lm_head, labels, TargetRows(states, index), weights,
            objective=Objective("kl"), block_size=BLOCK, chunk_rows=BLOCK,
        )  # fmt: skip


@pytest.mark.parametrize("loss", ["kl", "mix"])
def test_compiled_chunks_equal_eager_ones_with_shared_reads_and_a_short_last_chunk(loss):
    reason = compile_problem()
    if reason:
        pytest.skip(reason)
    hidden, lm_head, states, labels, weights = _shared_reads(8)
    outs = []
    for compiled in (False, True):
        h = hidden.clone().requires_grad_()
        out = chunked_target_loss(
            h, lm_head, labels, TargetRows(states, SHARED_INDEX), weights,
            objective=Objective(loss, kl_weight=0.4), block_size=BLOCK, chunk_rows=3 * BLOCK,
            fused=True, compiled=compiled,
        )  # fmt: skip
        out.loss.backward()
        outs.append((out.loss.detach(), out.terms, out.correct_N, h.grad))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
