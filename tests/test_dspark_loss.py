"""DSpark's objective against a straightforward per-slot reference on literal tensors: the loss
and its gradients (checkpointed, fused and plain chunks), the cumulative slot weights, the
confidence term, and the per-slot metrics (acceptance probability, tau_prob, ECE, AUC)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tests.drafters import tiny_drafter_config
from tests.inductor import compile_problem
from train.drafters.anchors import block_targets, loss_weights
from train.drafters.dspark import DSparkDrafter, init_dspark_weights
from train.drafters.dspark_loss import DSparkLoss, chunked_terms, dspark_step_terms
from train.drafters.dspark_metrics import AUC_BINS, auc, calibration_sums, ece
from train.drafters.target_rows import TargetRows

pytestmark = pytest.mark.usefixtures("one_thread")

# V 3, H 2, r 2: the lm_head, W2 and W1 of the literal examples.
LM_HEAD = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]])
W2 = torch.tensor([[0.5, 0.0], [0.0, -1.0], [0.2, 0.3]])
W1 = torch.tensor([[1.0, 2.0], [0.0, 0.5], [-1.0, 0.0]])


def reference_terms(hidden, prev, lm_head, w1, w2, labels, last, weights):
    """sum w CE and sum w L1, one row at a time over full logits, by the formulas of DSPARK.md."""
    ce = l1 = torch.zeros(())
    for n in range(hidden.shape[0]):
        logits = lm_head @ hidden[n] + (0 if w1 is None else w2 @ w1[prev[n]])
        ce = ce + weights[n] * -torch.log_softmax(logits, -1)[labels[n]]
        if last is not None:
            target = torch.softmax(lm_head @ last[n], -1)
            l1 = l1 + weights[n] * (torch.softmax(logits, -1) - target).abs().sum()
    return ce, l1


def literal_rows():
    hidden = torch.tensor([[1.0, 0.5], [-0.5, 2.0], [0.3, -1.0], [2.0, 2.0], [0.0, 0.1]])
    last = torch.tensor([[0.5, 0.5], [1.0, -2.0], [0.0, 0.0], [2.0, 1.0], [-1.0, 1.0]])
    prev, labels = torch.tensor([0, 2, 1, 1, 0]), torch.tensor([1, 1, 0, 2, 2])
    weights = torch.tensor([1.0, 0.7788, 0.0, 0.5, 0.25])
    return hidden, prev, labels, last, weights


@pytest.mark.parametrize("mode", ["plain", "checkpoint", "fused"])
@pytest.mark.parametrize("markov", [True, False])
def test_chunked_terms_and_gradients_equal_the_reference(mode, markov):
    hidden, prev, labels, last, weights = literal_rows()
    coef = (0.1, 0.9)
    ref_h = hidden.clone().requires_grad_()
    ref_w1, ref_w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    ce, l1 = reference_terms(
        ref_h, prev, LM_HEAD, ref_w1 if markov else None, ref_w2, labels, last, weights
    )
    (coef[0] * ce + coef[1] * l1).backward()
    h = hidden.clone().requires_grad_()
    w1, w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    emb = F.embedding(prev, w1) if markov else None
    out = chunked_terms(
        h, emb, LM_HEAD, w2 if markov else None, labels, TargetRows.each(last), weights,
        chunk_rows=2, coef=coef,
        checkpoint=mode == "checkpoint", fused=mode == "fused",
    )  # fmt: skip
    torch.testing.assert_close(out.ce_sum, ce.detach())
    torch.testing.assert_close(out.l1_sum, l1.detach())
    torch.testing.assert_close(out.loss.detach(), (coef[0] * ce + coef[1] * l1).detach())
    assert out.correct_N.tolist() == [
        int((LM_HEAD @ hidden[n] + (W2 @ W1[prev[n]] if markov else 0)).argmax()) == labels[n]
        for n in range(5)
    ]
    out.loss.backward()
    torch.testing.assert_close(h.grad, ref_h.grad)
    if markov:
        torch.testing.assert_close(w1.grad, ref_w1.grad)
        torch.testing.assert_close(w2.grad, ref_w2.grad)


def test_l1_per_row_is_the_full_l1_and_zero_without_the_target():
    hidden, prev, labels, last, weights = literal_rows()
    emb = F.embedding(prev, W1)
    target = TargetRows.each(last)
    out = chunked_terms(
        hidden, emb, LM_HEAD, W2, labels, target, weights, chunk_rows=3, coef=(1, 1)
    )
    for n in range(5):
        q = torch.softmax(LM_HEAD @ hidden[n] + W2 @ W1[prev[n]], -1)
        p = torch.softmax(LM_HEAD @ last[n], -1)
        assert math.isclose(float(out.l1_N[n]), float((q - p).abs().sum()), rel_tol=1e-5)
        assert 0 <= float(out.l1_N[n]) <= 2
    no_target = chunked_terms(
        hidden, emb, LM_HEAD, W2, labels, None, weights, chunk_rows=3, coef=(1.0, 0.0)
    )
    assert float(no_target.l1_N.abs().sum()) == 0 and float(no_target.l1_sum) == 0


@pytest.mark.parametrize("mode", ["plain", "checkpoint", "fused"])
def test_rows_reading_one_state_get_its_distribution_across_chunk_edges(mode):
    # Blocks overlap: rows read states 1, 2, 2, 3, 3, 3, 0, 2 of 4, chunks of 3 rows split the
    # repeats; each row's L1 and the gradients equal those of the states gathered row by row.
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(8, 2, generator=gen)
    states = torch.randn(4, 2, generator=gen) * 2
    index = torch.tensor([1, 2, 2, 3, 3, 3, 0, 2])
    labels, prev = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]), torch.tensor([2, 1, 0, 0, 1, 2, 1, 0])
    weights = torch.rand(8, generator=gen)
    outs = []
    for target in (TargetRows(states, index), TargetRows.each(states[index])):
        h = hidden.clone().requires_grad_()
        w2 = W2.clone().requires_grad_()
        out = chunked_terms(
            h, F.embedding(prev, W1), LM_HEAD, w2, labels, target, weights, chunk_rows=3,
            coef=(0.1, 0.9), checkpoint=mode == "checkpoint", fused=mode == "fused",
        )  # fmt: skip
        out.loss.backward()
        outs.append((out.l1_N.detach(), out.loss.detach(), h.grad, w2.grad))
    for shared, gathered in zip(*outs, strict=True):
        torch.testing.assert_close(shared, gathered, rtol=0, atol=0)
    assert float(outs[0][0].min()) > 0


def test_the_targets_lm_head_runs_once_per_distinct_state_of_a_chunk():
    # rows read states 1, 2, 2 | 3, 3, 3 | 0, 2 (chunks of 3): 5 lm_head rows, not 8
    gen = torch.Generator().manual_seed(13)
    hidden, states = torch.randn(8, 2, generator=gen), torch.randn(4, 2, generator=gen)
    index, labels = torch.tensor([1, 2, 2, 3, 3, 3, 0, 2]), torch.zeros(8, dtype=torch.long)
    flops = []
    for target in (TargetRows(states, index), TargetRows.each(states[index])):
        with FlopCounterMode(display=False) as counter:
            chunked_terms(
                hidden, None, LM_HEAD, None, labels, target, torch.ones(8), chunk_rows=3,
                coef=(1.0, 1.0), checkpoint=False,
            )  # fmt: skip
        flops.append(counter.get_total_flops())
    vocab, width = LM_HEAD.shape
    assert flops[1] - flops[0] == (8 - 5) * 2 * width * vocab


def test_compiled_chunks_equal_eager_ones_with_shared_reads_and_a_short_last_chunk():
    reason = compile_problem()
    if reason:
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(12)
    hidden, states = torch.randn(11, 2, generator=gen), torch.randn(5, 2, generator=gen)
    index = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4])
    labels, prev = torch.randint(0, 3, (2, 11), generator=gen)
    weights = torch.rand(11, generator=gen)
    outs = []
    for compiled in (False, True):
        h, w2 = hidden.clone().requires_grad_(), W2.clone().requires_grad_()
        out = chunked_terms(
            h, F.embedding(prev, W1), LM_HEAD, w2, labels, TargetRows(states, index), weights,
            chunk_rows=4, coef=(0.1, 0.9), fused=True, compiled=compiled,
        )  # fmt: skip
        out.loss.backward()
        outs.append((out.loss.detach(), out.l1_N, out.correct_N, h.grad, w2.grad))
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dspark_weights_shift_and_stop_at_the_first_uncounted_slot():
    # Two samples packed in one row; anchor 1 of sample 0 and anchor 6 of sample 1.
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    docs = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    anchors, keep = torch.tensor([[1, 6]]), torch.tensor([[True, True]])
    w = loss_weights(
        mask, docs, anchors, keep, block_size=4, gamma=4.0, shift=1, cumulative=True
    ).view(2, 4)
    # block at 1: targets at rows 2, 3, 4 (unsupervised: stops), 5 (counted alone, not after 4)
    assert w[0].tolist() == pytest.approx([1.0, math.exp(-0.25), 0.0, 0.0])
    # block at 6: targets 7, 8, 9, then row 10 is past the row's end
    assert w[1].tolist() == pytest.approx([1.0, math.exp(-0.25), math.exp(-0.5), 0.0])
    ids = torch.arange(10, 20)[None]
    assert block_targets(ids, anchors, block_size=4, shift=1).tolist() == [
        [12, 13, 14, 15, 17, 18, 19, 19]
    ]


def dspark_drafter(**kwargs):
    cfg = tiny_drafter_config(drafter_type="dspark", markov_rank=4, **kwargs)
    drafter = DSparkDrafter(cfg)
    init_dspark_weights(drafter, 0)
    with torch.no_grad():  # a Markov bias that is not zero, and a confidence bias too
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator())
        drafter.confidence_head.proj.bias.fill_(0.3)
    return drafter


def step_inputs(block=4):
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 2 * block, 64, generator=gen)
    labels, prev = torch.randint(0, 300, (2, 2, block), generator=gen).unbind(1)
    last = torch.randn(2, 2 * block, 64, generator=gen)
    w = torch.rand(2, 2 * block, generator=gen).round()
    return hidden, labels.repeat(1, 2), prev.repeat(1, 2), last, w


@pytest.mark.parametrize("fused", [False, True])
def test_step_loss_is_ce_l1_and_confidence_bce_with_gradients(fused):
    drafter = dspark_drafter()
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)) * 0.2
    hidden, labels, prev, last, w = step_inputs()
    keep = torch.ones(2, 2, dtype=torch.bool)
    h = hidden.clone().requires_grad_()
    loss, total, stats = dspark_step_terms(
        drafter, h, lm_head, labels, prev, TargetRows.each(last.flatten(0, 1)), w, keep,
        chunk_rows=5, checkpoint=True,
        fused=fused, options=DSparkLoss(),
    )  # fmt: skip
    loss.backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    # The reference: every slot by the formulas, through plain autograd.
    drafter.zero_grad()
    ref_h = hidden.clone().requires_grad_()
    head, conf = drafter.markov_head, drafter.confidence_head
    ref = torch.zeros(())
    for b in range(2):
        for q in range(8):
            emb = head.markov_w1.weight[prev[b, q]]
            logits = lm_head @ ref_h[b, q] + head.markov_w2.weight @ emb
            ce = -torch.log_softmax(logits, -1)[labels[b, q]]
            l1 = (torch.softmax(logits, -1) - torch.softmax(lm_head @ last[b, q], -1)).abs().sum()
            c_hat = conf.proj.weight[0] @ torch.cat([ref_h[b, q], emb]) + conf.proj.bias[0]
            target = (1 - 0.5 * l1.detach()).clamp(0, 1)
            bce = -(target * F.logsigmoid(c_hat) + (1 - target) * F.logsigmoid(-c_hat))
            ref = ref + w[b, q] * (0.1 * ce + 0.9 * l1 + bce)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach())
    assert float(total) == float(w.sum())
    torch.testing.assert_close(h.grad, ref_h.grad)
    for name, param in drafter.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(got[name], param.grad, msg=name)
    assert {n for n in got if n.startswith(("markov", "confidence"))} == {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    expected = stats["ce_sum"] * 0.1 + stats["l1_sum"] * 0.9 + stats["conf_sum"]
    torch.testing.assert_close(loss.detach(), expected)


def test_ce_mode_trains_ce_alone_and_needs_no_target_state():
    drafter = DSparkDrafter(
        tiny_drafter_config(drafter_type="dspark", markov_rank=4, enable_confidence_head=False)
    )
    init_dspark_weights(drafter, 0)
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    hidden, labels, prev, last, w = step_inputs()
    keep = torch.ones(2, 2, dtype=torch.bool)
    args = (drafter, hidden, lm_head, labels, prev)
    loss, _, stats = dspark_step_terms(
        *args, None, w, keep, chunk_rows=4, checkpoint=False, options=DSparkLoss(mode="ce")
    )
    torch.testing.assert_close(loss, stats["ce_sum"])
    assert float(stats["has_target"]) == 0 and float(stats["calibration"].sum()) == 0
    with pytest.raises(ValueError, match="last hidden state"):
        dspark_step_terms(
            *args, None, w, keep, chunk_rows=4, checkpoint=False, options=DSparkLoss()
        )


def test_slot_metrics_against_their_definitions():
    drafter = dspark_drafter()
    lm_head = torch.randn(300, 64, generator=torch.Generator().manual_seed(1))
    hidden, labels, prev, last, _ = step_inputs()
    w = torch.tensor(
        [[1.0, 0.7, 0.6, 0.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.7, 0.6, 0.4, 0.0] + [0.0] * 3]
    )
    keep = torch.tensor([[True, True], [True, False]])
    _, _, stats = dspark_step_terms(
        drafter, hidden, lm_head, labels, prev, TargetRows.at(last, torch.arange(8).repeat(2, 1)),
        w, keep, chunk_rows=16, checkpoint=False, options=DSparkLoss(),
    )  # fmt: skip
    emb = drafter.prev_embeddings(prev)
    logits = hidden @ lm_head.T + drafter.markov_bias(emb)
    l1 = (torch.softmax(logits, -1) - torch.softmax(last @ lm_head.T, -1)).abs().sum(-1)
    accept = ((1 - l1 / 2) * (w > 0)).detach()
    expected = 0.0
    for b, j in ((0, 0), (0, 1), (1, 0)):  # the kept blocks
        run = 1.0
        for k in range(4):
            run *= float(accept[b, 4 * j + k])
            expected += run
    assert math.isclose(float(stats["accepted_prob_sum"]), expected, rel_tol=1e-5)
    per_slot = (l1 * (w > 0)).view(2, 2, 4).sum((0, 1))
    torch.testing.assert_close(stats["l1_per_slot"], per_slot)
    assert int(stats["calibration"][:10].sum()) == int((w > 0).sum())


def test_ece_and_auc_against_brute_force():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(200, generator=gen) * 2
    target = torch.rand(200, generator=gen)
    accepted = torch.rand(200, generator=gen) < torch.sigmoid(logits)
    counted = torch.rand(200, generator=gen) < 0.8
    sums = calibration_sums(logits, target, accepted, counted).tolist()
    prob = torch.sigmoid(logits)[counted]
    t, a = target[counted], accepted[counted]
    bins = (prob * 10).long().clamp(max=9)
    want = sum(
        float((bins == i).sum()) * abs(float(prob[bins == i].mean() - t[bins == i].mean()))
        for i in range(10)
        if (bins == i).any()
    ) / len(prob)
    assert math.isclose(ece(sums), want, rel_tol=1e-5)
    # AUC: over all (accepted, rejected) pairs, bins of width 1/AUC_BINS, a tie counting half
    fine = (prob * AUC_BINS).long().clamp(max=AUC_BINS - 1)
    pos, neg = fine[a], fine[~a]
    pairs = (pos[:, None] > neg[None]).float() + 0.5 * (pos[:, None] == neg[None]).float()
    assert math.isclose(auc(sums), float(pairs.mean()), rel_tol=1e-6)
