"""The drafter's configuration: its shape, capture layers, RoPE and mask token, derived from the
target's Hugging Face config (`DrafterConfig.from_target_config`) and round-tripped through the
exported config.json."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")
DRAFTER_TYPES = ("dflash", "dflash2", "dspark")
# Published DFlash2 drafters: every layer slides over 2048 keys, non-causal inside the block.
DFLASH2_SLIDING_WINDOW = 2048
SUPPORTED_ROPE_TYPES = ("default", "linear")
# Mask token rows of the public DFlash drafters, keyed by target model family.
QWEN3_MASK_TOKEN_ID = 151669
QWEN35_MASK_TOKEN_ID = 248070
# The Qwen3.6-27B target (layers, hidden size), whose published drafter slides with this window.
QWEN36_27B_LAYERS_HIDDEN = (64, 5120)
QWEN36_27B_WINDOW = 2048
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


# The DFlash2 fields of a drafter config, and its logit transform (set only when used).
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
LOGIT_FIELDS = ("output_multiplier", "final_logit_softcapping")
# The DSpark fields (DSPARK.md): Markov head rank (0: none), the confidence head and its input.
DSPARK_FIELDS = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
# DSpark's released block (B drafts per block, the anchor slot predicting).
DSPARK_BLOCK_SIZE = 7
DSPARK_LOSSES = ("full", "ce")  # the whole objective, or its CE term alone


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
    # None: causality from the layer type (sliding causal, full bidirectional inside the block).
    is_causal: bool | None = None
    drafter_type: str = "dflash"
    # DFlash2 only (DFLASH2.md): convolution taps and groups, selector rank and candidates.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # Set only when the target transforms its own logits (scale, then tanh softcap).
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    # DSpark only (DSPARK.md): the Markov head's rank (0: no head), the confidence head, and
    # whether it reads the Markov embedding of the previous token beside the hidden state.
    markov_rank: int = 256
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    # Anchors per sequence the drafter was trained with: DSpark's export records it.
    num_anchors: int = 512

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
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"drafter_type must be one of {DRAFTER_TYPES}: {self.drafter_type!r}")
        for name in DFLASH2_FIELDS:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size ({self.conv_group_size}) must divide hidden_size "
                f"({self.hidden_size})"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} exceeds the vocabulary")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError("final_logit_softcapping must be positive when set")
        if self.drafter_type == "dspark" and (
            set(self.layer_types) != {"full_attention"} or self.is_causal
        ):
            raise ValueError(
                "layer_types: DSpark's layers are all full_attention, non-causal inside the block "
                f"(its export has no window nor causality field), got {self.layer_types}, "
                f"is_causal {self.is_causal}"
            )
        if self.markov_rank < 0 or self.num_anchors < 1:
            raise ValueError("markov_rank must be >= 0 and num_anchors >= 1")
        if (
            self.drafter_type == "dspark"
            and self.enable_confidence_head
            and self.confidence_head_with_markov
            and not self.markov_rank
        ):
            raise ValueError(
                "confidence_head_with_markov needs a Markov head (markov_rank > 0): give "
                "markov_rank > 0, no confidence head, or confidence_head_with_markov false"
            )

    @property
    def anchor_predicts(self) -> bool:
        """Whether block slot 0 (the anchor's) predicts the next token (DSpark: slot k predicts
        token p + k + 1, B drafts per block) or only holds the known token (DFlash, DFlash2)."""
        return self.drafter_type == "dspark"

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
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        unused_token: int | None = None,
        drafter_type: str = "dflash",
        is_causal: bool | None = None,
        **family_fields: Any,
    ) -> DrafterConfig:
        """Build a drafter config from a Hugging Face target config.json dict.

        Qwen3.5/3.6 configs keep the size fields under `text_config`. The hidden size, eps and
        rope base are the target's; heads, head_dim, intermediate size, layer types and window
        default to the published DFlash drafters' choice for the target (`published_shape`), and
        any argument given here overrides its default. The drafter always rotates the full
        head_dim with 1-D positions (Qwen3 style), so a target's `partial_rotary_factor` and
        multimodal rope sections are not carried over.
        A DFlash2 drafter without explicit layer types takes the published DFlash2 attention:
        every layer sliding (window 2048 unless given), non-causal unless `is_causal` says
        otherwise; its logit transform is the target's (`target_logit_transform`) unless
        `family_fields` set it. `family_fields` are the family's own fields (DFLASH2_FIELDS,
        LOGIT_FIELDS, DSPARK_FIELDS, num_anchors).
        """
        if drafter_type == "dspark" and layer_types is None:  # all full, whatever the target
            layer_types = ("full_attention",) * num_layers
        if drafter_type == "dflash2":
            family_fields = {**target_logit_transform(target_cfg), **family_fields}
            if layer_types is None:
                layer_types = ("sliding_attention",) * num_layers
                sliding_window = sliding_window or DFLASH2_SLIDING_WINDOW
            is_causal = False if is_causal is None else is_causal
        text = target_cfg.get("text_config") or target_cfg
        hidden = int(text["hidden_size"])
        rope_theta, rope_scaling = rope_fields_from_hf(text)
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(target_cfg, tokenizer_vocab_size, unused_token)
        given = {
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads,
            "head_dim": head_dim,
            "intermediate_size": intermediate_size,
        }
        shape = published_shape(target_cfg, num_layers)
        shape.update({k: v for k, v in given.items() if v is not None})
        if shape["intermediate_size"] is None:
            raise ValueError(
                "intermediate_size: the target config has no `intermediate_size` nor the MoE "
                "fields `moe_intermediate_size` and `num_experts_per_tok`; give "
                "--drafter-intermediate"
            )
        if layer_types is None and "layer_types" in shape:
            layer_types = shape["layer_types"]
            sliding_window = sliding_window or shape["sliding_window"]
        return cls(
            hidden_size=hidden,
            intermediate_size=int(shape["intermediate_size"]),
            num_layers=num_layers,
            num_attention_heads=int(shape["num_attention_heads"]),
            num_key_value_heads=int(shape["num_key_value_heads"]),
            head_dim=int(shape["head_dim"]),
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
            is_causal=is_causal,
            drafter_type=drafter_type,
            **family_fields,
        )


def target_logit_transform(target_cfg: dict[str, Any]) -> dict[str, float]:
    """The target's own transform of its logits, as DFlash2's fields: `output_multiplier` from
    a logit scale (Cohere's `logit_scale` multiplies, Granite's `logits_scaling` divides) and
    `final_logit_softcapping` (Gemma 2). Empty for Qwen3, Qwen3.5/3.6 and Llama.

    >>> target_logit_transform({"final_logit_softcapping": 30.0, "logits_scaling": 8.0})
    {'output_multiplier': 0.125, 'final_logit_softcapping': 30.0}
    """
    text = target_cfg.get("text_config") or target_cfg
    out: dict[str, float] = {}
    if text.get("logit_scale") not in (None, 1, 1.0):
        out["output_multiplier"] = float(text["logit_scale"])
    if text.get("logits_scaling") not in (None, 1, 1.0):
        out["output_multiplier"] = 1.0 / float(text["logits_scaling"])
    if text.get("final_logit_softcapping") is not None:
        out["final_logit_softcapping"] = float(text["final_logit_softcapping"])
    return out


def is_qwen35(target_cfg: dict[str, Any]) -> bool:
    """Qwen3.5 or Qwen3.6 (hybrid Gated DeltaNet), dense or MoE, text-only or multimodal."""
    text = target_cfg.get("text_config") or target_cfg
    types = (str(target_cfg.get("model_type", "")), str(text.get("model_type", "")))
    return any(t.startswith(_QWEN35_PREFIXES) for t in types)


def is_moe(text_cfg: dict[str, Any]) -> bool:
    return bool(text_cfg.get("num_experts") or text_cfg.get("moe_intermediate_size"))


def moe_intermediate(text_cfg: dict[str, Any]) -> int | None:
    """The MLP width a MoE target applies per token: routed experts x their width, plus the
    shared expert's (Qwen3.5-35B-A3B: 8 x 512 + 512 = 4608); None without the MoE fields."""
    width, per_token = text_cfg.get("moe_intermediate_size"), text_cfg.get("num_experts_per_tok")
    if not width or not per_token:
        return None
    return int(width) * int(per_token) + int(text_cfg.get("shared_expert_intermediate_size") or 0)


def published_shape(target_cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The drafter shape the public DFlash checkpoints use for this target (DESIGN.md section 5).

    Qwen3 and others: the target's attention shape and intermediate size. Qwen3.5/3.6: 32 heads
    of 128 with 8 kv heads (4 for the MoE targets, as for 35B-A3B). Qwen3.6-27B (64 layers,
    hidden 5120): every layer but the last slides with a window of 2048, the last is full (its
    5-layer drafter: 4 sliding + 1 full); `layer_types` and `sliding_window` are keys only then.
    A target without `intermediate_size` (a MoE text config) gets `moe_intermediate`, or None.

    >>> shape = published_shape({"model_type": "qwen3_5_text", "hidden_size": 5120,
    ...     "num_hidden_layers": 64, "num_attention_heads": 24, "intermediate_size": 17408}, 5)
    >>> [shape[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")]
    [32, 8, 128]
    >>> [t[:4] for t in shape["layer_types"]], shape["sliding_window"]
    (['slid', 'slid', 'slid', 'slid', 'full'], 2048)
    """
    text = target_cfg.get("text_config") or target_cfg
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    intermediate = text.get("intermediate_size") or moe_intermediate(text)
    if not is_qwen35(target_cfg):
        return {
            "num_attention_heads": heads,
            "num_key_value_heads": int(text.get("num_key_value_heads") or heads),
            "head_dim": int(text.get("head_dim") or hidden // heads),
            "intermediate_size": intermediate,
        }
    shape: dict[str, Any] = {
        "num_attention_heads": 32,
        "num_key_value_heads": 4 if is_moe(text) else 8,
        "head_dim": 128,
        "intermediate_size": intermediate,
    }
    if (int(text.get("num_hidden_layers", 0)), hidden) == QWEN36_27B_LAYERS_HIDDEN:
        shape["layer_types"] = ("sliding_attention",) * (num_layers - 1) + ("full_attention",)
        shape["sliding_window"] = QWEN36_27B_WINDOW
    return shape


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
