"""fused_chunked_ce equals chunked_ce: value, correct flags and hidden-gradient."""

import pytest
import torch

from tests.inductor import compile_problem
from train.drafters.loss import chunked_ce, fused_chunked_ce

ROWS, HIDDEN, VOCAB, CHUNK = 37, 16, 50, 8  # 37 = 4 * 8 + 5: the last chunk is short


def _inputs(seed: int = 0, zero_every: int = 4):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    weights = torch.rand(ROWS, generator=gen) * (torch.arange(ROWS) % zero_every != 0)
    return hidden, head, targets, weights


def _grad(fn, hidden, head, targets, weights, scale=1.0, **kwargs):
    total, norm, correct = fn(hidden, head, targets, weights, chunk_rows=CHUNK, **kwargs)
    (total / scale).backward()
    grad, hidden.grad = hidden.grad, None
    return total.detach(), norm, correct, grad


def test_forward_equals_chunked_ce():
    hidden, head, targets, weights = _inputs()
    ref = chunked_ce(hidden, head, targets, weights, chunk_rows=CHUNK, checkpoint=False)
    out = fused_chunked_ce(hidden, head, targets, weights, chunk_rows=CHUNK)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(out[1], ref[1])
    assert torch.equal(out[2], ref[2])
    assert out[2].dtype == torch.bool and out[2].shape == (ROWS,)


@pytest.mark.parametrize("scale", [1.0, 3.7])
@pytest.mark.parametrize("zero_every", [4, 1])  # 1: every row has zero weight
def test_hidden_grad_equals_autograd_through_chunked_ce(scale, zero_every):
    hidden, head, targets, weights = _inputs(zero_every=zero_every)
    ref = _grad(chunked_ce, hidden, head, targets, weights, scale, checkpoint=False)
    out = _grad(fused_chunked_ce, hidden, head, targets, weights, scale)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[3], ref[3], rtol=1e-5, atol=1e-5)
    assert zero_every != 1 or torch.count_nonzero(out[3]) == 0


def test_bf16_cpu_autocast_matches_chunked_ce():
    hidden, head, targets, weights = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _grad(chunked_ce, hidden, head, targets, weights, 3.7, checkpoint=False)
        out = _grad(fused_chunked_ce, hidden, head, targets, weights, 3.7)
    assert out[3].dtype == hidden.dtype == torch.float32
    torch.testing.assert_close(out[0], ref[0])
    assert torch.equal(out[2], ref[2])
    torch.testing.assert_close(out[3], ref[3], rtol=2e-2, atol=2e-2)


def test_bf16_hidden_gets_a_bf16_grad():
    hidden, head, targets, weights = _inputs()
    hidden = hidden.detach().bfloat16().requires_grad_()
    ref = _grad(chunked_ce, hidden, head.bfloat16(), targets, weights, checkpoint=False)
    out = _grad(fused_chunked_ce, hidden, head.bfloat16(), targets, weights)
    assert out[3].dtype == torch.bfloat16
    torch.testing.assert_close(out[3], ref[3], rtol=2e-2, atol=2e-2)


def test_eval_path_gives_the_same_results():
    hidden, head, targets, weights = _inputs()
    total, norm, correct = fused_chunked_ce(hidden, head, targets, weights, chunk_rows=CHUNK)
    with torch.no_grad():
        eval_total, eval_norm, eval_correct = fused_chunked_ce(
            hidden, head, targets, weights, chunk_rows=CHUNK
        )
    assert not eval_total.requires_grad
    torch.testing.assert_close(eval_total, total.detach(), rtol=0, atol=0)
    assert torch.equal(eval_norm, norm) and torch.equal(eval_correct, correct)


def test_trainable_lm_head_is_refused():
    hidden, head, targets, weights = _inputs()
    with pytest.raises(ValueError, match="frozen lm_head"):
        fused_chunked_ce(hidden, head.requires_grad_(), targets, weights, chunk_rows=CHUNK)


def test_non_leaf_hidden_passes_its_grad_on():
    _, head, targets, weights = _inputs()
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grads = []
    for fn, kwargs in ((chunked_ce, {"checkpoint": False}), (fused_chunked_ce, {})):
        total, _, _ = fn(x * 2, head, targets, weights, chunk_rows=CHUNK, **kwargs)
        grads.append(torch.autograd.grad(total, x)[0])
    assert grads[1].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-5)


def test_compiled_equals_eager_including_the_short_last_chunk():
    reason = compile_problem()
    if reason:
        pytest.skip(reason)
    hidden, head, targets, weights = _inputs()
    eager = _grad(fused_chunked_ce, hidden, head, targets, weights, 3.7)
    fused = _grad(fused_chunked_ce, hidden, head, targets, weights, 3.7, compiled=True)
    torch.testing.assert_close(fused[0], eager[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[1], eager[1]) and torch.equal(fused[2], eager[2])
    torch.testing.assert_close(fused[3], eager[3], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        total, _, correct = fused_chunked_ce(
            hidden, head, targets, weights, chunk_rows=CHUNK, compiled=True
        )
    torch.testing.assert_close(total, eager[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, eager[2])
