"""The decoder forward of `extract.capture.LayerCapture` gets premade masks: same states as the
masks the model builds itself, and (on CUDA) no read-back that would stall the launching thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from extract.capture import LayerCapture, premade_masks


def rows(vocab: int) -> list[np.ndarray]:
    """Rows of different lengths, longest first (batched with right padding)."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).astype(np.int64) for n in (37, 20, 6)]


def capture_states(target, layer_ids, *, attn: str, own_masks: bool = False) -> torch.Tensor:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, attn_implementation=attn
    )
    cap = LayerCapture(model.eval(), layer_ids, own_masks=own_masks)
    try:
        return cap.run(rows(model.config.vocab_size), device=torch.device("cpu")).float()
    finally:
        cap.close()


@pytest.mark.parametrize(
    ("kind", "attn"), [("qwen3", "sdpa"), ("qwen3_5", "sdpa"), ("qwen3", "eager")]
)
def test_premade_masks_give_the_states_of_the_models_own(kind, attn, request):
    """sdpa gets premade masks; eager reads a `None` mask as no mask, so it keeps its own."""
    target = request.getfixturevalue("tiny_qwen3" if kind == "qwen3" else "tiny_qwen35")
    config = AutoConfig.from_pretrained(str(target))
    config = getattr(config, "text_config", config)
    config._attn_implementation = attn
    assert (premade_masks(config) is not None) == (attn == "sdpa")
    premade = capture_states(target, [0, 1], attn=attn)
    own = capture_states(target, [0, 1], attn=attn, own_masks=True)
    assert premade.shape == own.shape == (37 + 20 + 6, 2, own.shape[-1])
    torch.testing.assert_close(premade, own, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_never_waits_for_the_device(tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    cap = LayerCapture(model, [0, 1])
    batch = rows(model.config.vocab_size)
    cap.run(batch, device=torch.device("cuda"))  # first batch: allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            cap.run(batch, device=torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        cap.close()
