"""Tiny random targets of several families, built in code and saved with save_pretrained, for
the distributed-layout tests: dense (Qwen3, hybrid Qwen3.5, Llama) and MoE (Qwen3-MoE,
DeepSeek-V3, gpt-oss). Sizes divide by 2 wherever a layout splits them (heads, kv heads,
experts), and every family has 6 decoder layers."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen3_5", "llama", "qwen3_moe", "deepseek_v3", "gpt_oss")
MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss")
LAYERS = 6


def _common(tokenizer) -> dict:  # noqa: ANN001
    return dict(
        vocab_size=(len(tokenizer) // 64 + 1) * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def family_model(kind: str, tokenizer):  # noqa: ANN001, ANN201
    """A randomly initialised causal LM of `kind` sized for `tokenizer`."""
    import transformers as tf

    common = _common(tokenizer)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if kind == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            **common,
            layer_types=(["linear_attention"] * 2 + ["full_attention"]) * (LAYERS // 3),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
        )
        return Qwen3_5ForCausalLM(config)
    if kind == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**common, **moe, num_experts=4, decoder_sparse_step=1)
        return tf.Qwen3MoeForCausalLM(config)
    if kind == "deepseek_v3":
        # MLA: one key and value head per query head.
        dense = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
        config = tf.DeepseekV3Config(
            **dense,
            num_key_value_heads=common["num_attention_heads"],
            **moe,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        return tf.DeepseekV3ForCausalLM(config)
    if kind == "gpt_oss":
        config = tf.GptOssConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"},
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        )
        return tf.GptOssForCausalLM(config)
    raise ValueError(f"unknown family {kind!r}; one of {FAMILIES}")


def build_family(folder: Path, kind: str, *, seed: int = 0) -> Path:
    """Save a tiny random `kind` target (weights, config, the demo tokenizer) into `folder`."""
    from extract.tiny import _demo_texts, build_tokenizer

    tokenizer = build_tokenizer(list(_demo_texts()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = family_model(kind, tokenizer).eval()
        # Random init leaves some norms at exactly one and biases at zero; scale everything a
        # little so that a wrong shard or a missing all-reduce cannot hide behind a symmetry.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
