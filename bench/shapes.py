"""Real-shaped target configs for benchmarks (random weights: real speed, not real quality)."""

from __future__ import annotations

from typing import Any

QWEN3_8B: dict[str, Any] = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Qwen3.6-27B text model: 64 layers, 3 Gated DeltaNet layers per full-attention layer.
QWEN36_27B: dict[str, Any] = dict(
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    vocab_size=248320,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    linear_num_value_heads=48,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
)

SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3.6-27b": QWEN36_27B}


def hf_config(name: str):
    """A transformers config object for shape `name`."""
    from transformers import AutoConfig

    fields = dict(SHAPES[name])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def random_model(name: str, *, device: str = "cuda", dtype=None, last_layer: int | None = None):
    """A causal LM of shape `name` with random weights, built directly on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(name)
    if last_layer is not None:  # build only the layers a capture needs
        cfg.num_hidden_layers = last_layer + 1
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[: last_layer + 1]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16)
    return model.eval().requires_grad_(False)


# CPU checks of the benchmark scripts: the 8B shape's structure at toy size (8 target layers, so
# the default 5-layer capture rule gives distinct ids), and a hybrid one in Qwen3.6's 3:1 pattern.
TINY: dict[str, Any] = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=320,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

TINY_HYBRID: dict[str, Any] = dict(
    TINY,
    model_type="qwen3_5_text",
    architectures=["Qwen3_5ForCausalLM"],
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
del TINY_HYBRID["rope_theta"]

SHAPES["tiny"] = TINY
SHAPES["tiny-hybrid"] = TINY_HYBRID
