"""The drafter's configuration: its shape, capture layers, RoPE and mask token, derived from the
target's Hugging Face config (`DrafterConfig.from_target_config`) and round-tripped through the
exported config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear")
# Mask token rows of the public DFlash drafters, keyed by target model family.
QWEN3_MASK_TOKEN_ID = 151669
QWEN35_MASK_TOKEN_ID = 248070
_QWEN3_TYPES = ("qwen3", "qwen3_moe")
_QWEN35_PREFIXES = ("qwen3_5", "qwen3_6")
_POSITIVE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "num_target_layers",
)


@dataclass(frozen=True)
class DrafterConfig:
    """Sizes of a DFlash drafter; `from_target_config` derives them from a target config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in _POSITIVE_FIELDS:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_scaling type {rope_type!r} unsupported: {SUPPORTED_ROPE_TYPES}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} not in [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        if any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must lie in "
                f"[0, num_target_layers={self.num_target_layers})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types needs {self.num_layers} entries: {self.layer_types}")
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types entries must be in {LAYER_TYPES}: {self.layer_types}")
        if "sliding_attention" in self.layer_types and (self.sliding_window or 0) <= 0:
            raise ValueError("sliding_window must be a positive int when a layer slides")

    @property
    def num_context_layers(self) -> int:
        """K: how many target layers are concatenated into the context input."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; `from_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["layer_types"] = list(self.layer_types)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        return cls(**data)

    @classmethod
    def from_target_config(
        cls,
        target_cfg: dict[str, Any],
        *,
        num_layers: int = 5,
        target_layer_ids: tuple[int, ...] | list[int],
        block_size: int = 16,
        mask_token_id: int | None = None,
        layer_types: tuple[str, ...] | list[str] | None = None,
        sliding_window: int | None = None,
        tokenizer_vocab_size: int | None = None,
        unused_token: int | None = None,
    ) -> DrafterConfig:
        """Build a drafter config from a Hugging Face target config.json dict.

        Qwen3.5/3.6 configs keep the size fields under `text_config`. The drafter copies hidden
        size, heads, head_dim, intermediate size, eps and the rope base from the target; it always
        rotates the full head_dim with 1-D positions (Qwen3 style), so a target's
        `partial_rotary_factor` and multimodal rope sections are not carried over.
        """
        text = target_cfg.get("text_config") or target_cfg
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        rope_theta, rope_scaling = rope_fields_from_hf(text)
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(target_cfg, tokenizer_vocab_size, unused_token)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            vocab_size=int(text["vocab_size"]),
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=tuple(target_layer_ids),
            num_target_layers=int(text["num_hidden_layers"]),
            layer_types=tuple(layer_types or ("full_attention",) * num_layers),
            sliding_window=sliding_window,
        )


def rope_fields_from_hf(text_cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the legacy or the transformers-5 rope fields.

    rope_scaling is None for plain RoPE; fields the drafter does not use (partial rotary,
    multimodal sections) are dropped.

    >>> rope_fields_from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    (1000000.0, None)
    """
    params = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", text_cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    dropped = ("rope_theta", "type", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
    scaling = {k: v for k, v in params.items() if k not in dropped}
    scaling["rope_type"] = rope_type
    return theta, scaling


def default_mask_token_id(
    target_cfg: dict[str, Any], tokenizer_vocab_size: int | None, unused_token: int | None = None
) -> int:
    """Mask row: Qwen3 151669, Qwen3.5/3.6 248070, else the first embedding row past the
    tokenizer, else (a tokenizer as large as the embedding) `unused_token`, an unused special
    token of the tokenizer (`shared.target_files.unused_special_token`).

    >>> default_mask_token_id({"model_type": "qwen3", "vocab_size": 151936}, None)
    151669
    >>> default_mask_token_id({"model_type": "llama", "vocab_size": 300}, 290)
    290
    >>> default_mask_token_id({"model_type": "llama", "vocab_size": 300}, 300, 16)
    16
    """
    text = target_cfg.get("text_config") or target_cfg
    vocab = int(text["vocab_size"])
    types = {str(target_cfg.get("model_type", "")), str(text.get("model_type", ""))}
    if types & set(_QWEN3_TYPES) and QWEN3_MASK_TOKEN_ID < vocab:
        return QWEN3_MASK_TOKEN_ID
    if any(t.startswith(_QWEN35_PREFIXES) for t in types) and QWEN35_MASK_TOKEN_ID < vocab:
        return QWEN35_MASK_TOKEN_ID
    if tokenizer_vocab_size is None:
        raise ValueError(
            f"mask_token_id: no default for model_type {sorted(types)}; pass mask_token_id or "
            "tokenizer_vocab_size (the mask is then the first embedding row past the tokenizer)"
        )
    if tokenizer_vocab_size >= vocab and unused_token is not None:
        return int(unused_token)
    if tokenizer_vocab_size >= vocab:
        raise ValueError(
            f"mask_token_id: the embedding has no spare row (vocab_size {vocab}, tokenizer "
            f"{tokenizer_vocab_size} tokens) and the tokenizer has no unused special token; pass "
            "an existing unused token id as mask_token_id"
        )
    return int(tokenizer_vocab_size)
