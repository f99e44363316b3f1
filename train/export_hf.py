"""The `config.json` of an exported drafter, both ways: `hf_config` writes it from a
`DrafterConfig` (DFlash, DFlash2 inside `dflash_config`, DSpark in DeepSpec's format), and
`config_from_hf` reads ours or a public DFlash config back."""

from __future__ import annotations

from typing import Any

from shared.manifest import TargetInfo
from train.drafters.config import DFLASH2_FIELDS, LOGIT_FIELDS, DrafterConfig, rope_fields_from_hf
from train.export_dspark import dspark_fields, dspark_hf_config, is_dspark_config

# The target whose cache trained the drafter, as the cache's manifest names it: the proof
# commands compare their --target with it. SGLang, vLLM and transformers ignore the key.
TARGET_KEY = "target_identity"
TARGET_FIELDS = ("path", "revision", "weights_sample", "model_type")


def target_record(target: TargetInfo) -> dict[str, Any]:
    """What an export records of its cache's target under TARGET_KEY."""
    return {name: getattr(target, name) for name in TARGET_FIELDS}


def hf_config(cfg: DrafterConfig, *, target: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json dict of an exported drafter; `target`, its cache's `target_record`, is
    written under TARGET_KEY where given."""
    rope_parameters = {"rope_type": "default", **(cfg.rope_scaling or {})}
    rope_parameters["rope_theta"] = cfg.rope_theta
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_parameters,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": "sliding_attention" in cfg.layer_types,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
    }
    if cfg.is_causal is not None or cfg.drafter_type == "dflash2":
        # Overrides the per-layer-type default in the loaders; DFlash2's is written explicitly.
        layer_default = "sliding_attention" in cfg.layer_types
        out["is_causal"] = layer_default if cfg.is_causal is None else cfg.is_causal
    if cfg.drafter_type == "dflash2":
        # vLLM raises without these inside dflash_config; SGLang silently builds no convolution.
        out["architectures"] = ["DFlash2DraftModel"]
        del out["block_size"]
        out["dflash_config"] = {"block_size": cfg.block_size, **out["dflash_config"]}
        out["dflash_config"].update({name: getattr(cfg, name) for name in DFLASH2_FIELDS})
        for name in LOGIT_FIELDS:
            if getattr(cfg, name) is not None:
                out["dflash_config"][name] = getattr(cfg, name)
    if target is not None:
        out[TARGET_KEY] = dict(target)
    return dspark_hf_config(out, cfg) if cfg.drafter_type == "dspark" else out


# What `config_from_hf` cannot default: top-level fields, and the DFlash ones it also reads
# inside `dflash_config` (a target model's config has none of these two).
_TOP_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_target_layers",
)
DFLASH_FIELDS = ("mask_token_id", "target_layer_ids")


def missing_fields(data: dict[str, Any]) -> list[str]:
    """The fields `config_from_hf` needs that `data` lacks or holds as null.

    >>> missing_fields({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
    ...                 "num_attention_heads": 2, "vocab_size": 512, "dflash_config": {}})
    ['num_target_layers', 'mask_token_id', 'target_layer_ids']
    """
    dflash = data.get("dflash_config") or {}
    missing = [name for name in _TOP_FIELDS if data.get(name) is None]
    return missing + [name for name in DFLASH_FIELDS if dflash.get(name, data.get(name)) is None]


def config_from_hf(data: dict[str, Any]) -> DrafterConfig:
    """Inverse of `hf_config` (also reads public DFlash configs with the same fields)."""
    dflash = data.get("dflash_config", {})
    dflash2 = "DFlash2DraftModel" in (data.get("architectures") or ())
    extra: dict[str, Any] = {"drafter_type": "dflash2" if dflash2 else "dflash"}
    if is_dspark_config(data):
        extra = dspark_fields(data)
    if dflash2:
        extra.update({name: int(dflash[name]) for name in DFLASH2_FIELDS if name in dflash})
        extra.update({name: float(dflash[name]) for name in LOGIT_FIELDS if name in dflash})
    heads = int(data["num_attention_heads"])
    num_layers = int(data["num_hidden_layers"])
    rope_theta, rope_scaling = rope_fields_from_hf(data)
    return DrafterConfig(
        hidden_size=int(data["hidden_size"]),
        intermediate_size=int(data["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
        vocab_size=int(data["vocab_size"]),
        block_size=int(dflash.get("block_size", data.get("block_size", 16))),
        mask_token_id=int(dflash.get("mask_token_id", data.get("mask_token_id"))),
        target_layer_ids=tuple(dflash.get("target_layer_ids", data.get("target_layer_ids"))),
        num_target_layers=int(data["num_target_layers"]),
        layer_types=tuple(data.get("layer_types") or ("full_attention",) * num_layers),
        sliding_window=data.get("sliding_window"),
        is_causal=data.get("is_causal"),
        **extra,
    )
