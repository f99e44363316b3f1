"""The decoder forward of `extract.capture.LayerCapture` gets premade masks: same states as the
masks the model builds itself, and (on CUDA) no read-back that would stall the launching thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import extract.capture as capture_mod
from extract.capture import LayerCapture, premade_masks


def rows(vocab: int) -> list[np.ndarray]:
    """Rows of different lengths, longest first (batched with right padding)."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).astype(np.int64) for n in (37, 20, 6)]


def capture_states(target, layer_ids, device: str = "cpu") -> torch.Tensor:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    model = model.to(device).eval()
    cap = LayerCapture(model, layer_ids)
    try:
        return cap.run(rows(model.config.vocab_size), device=torch.device(device)).float().cpu()
    finally:
        cap.close()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_premade_masks_give_the_states_of_the_models_own(kind, request, monkeypatch):
    target = request.getfixturevalue("tiny_qwen3" if kind == "qwen3" else "tiny_qwen35")
    config = AutoConfig.from_pretrained(str(target))
    assert premade_masks(getattr(config, "text_config", config)) is not None
    premade = capture_states(target, [0, 1])
    monkeypatch.setattr(capture_mod, "PREMADE_MASKS", False)
    own = capture_states(target, [0, 1])
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
