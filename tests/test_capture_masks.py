"""The capture forward gets premade masks (`extract.masks`) only where they give the states of
the model's own masks, and (on CUDA) it then never waits for the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from extract.capture import LayerCapture
from extract.masks import choose_masks, premade_masks


def rows(vocab: int) -> list[np.ndarray]:
    """Rows of different lengths, longest first (batched with right padding)."""
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, size=n).astype(np.int64) for n in (37, 20, 6)]


def load(target, attn: str = "sdpa"):  # noqa: ANN001, ANN201
    model = AutoModelForCausalLM.from_pretrained(
        str(target), dtype=torch.float32, attn_implementation=attn
    )
    return model.eval()


def capture_states(model, layer_ids, *, own_masks: bool = False) -> torch.Tensor:  # noqa: ANN001
    cap = LayerCapture(model, layer_ids, own_masks=own_masks)
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
    model = load(target, attn)
    assert (choose_masks(model.get_decoder()) is not None) == (attn == "sdpa")
    premade = capture_states(model, [0, 1])
    own = capture_states(model, [0, 1], own_masks=True)
    assert premade.shape == own.shape == (37 + 20 + 6, 2, own.shape[-1])
    torch.testing.assert_close(premade, own, rtol=1e-5, atol=1e-5)


def test_config_rules(tiny_qwen3):
    config = AutoConfig.from_pretrained(str(tiny_qwen3))
    config._attn_implementation = "sdpa"
    assert premade_masks(config) == {"full_attention": None}
    config.layer_types = ["full_attention", "sliding_attention"] * (config.num_hidden_layers // 2)
    assert premade_masks(config) is None  # a window needs a real mask
    config.layer_types, config._attn_implementation = ["full_attention"], "flex_attention"
    assert premade_masks(config) is None  # flex reads None as no mask


def test_a_forward_that_does_not_take_the_mapping_keeps_its_own_masks():
    """Llama's forward builds its mask from whatever it is given: the probe sees it fail."""
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    config.layer_types = ["full_attention"] * 2  # as if its config listed them
    model = LlamaForCausalLM(config).eval()
    assert premade_masks(model.get_decoder().config) is not None
    assert choose_masks(model.get_decoder()) is None
    states = capture_states(model, [0, 1])  # and extraction works with its own masks
    assert states.shape == (63, 2, 32) and torch.isfinite(states).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_never_waits_for_the_device(tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    cap = LayerCapture(model, [0, 1])
    assert cap.layout.masks is not None
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
