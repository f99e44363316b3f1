"""DSpark's export: DeepSpec's dense format, what the released DSpark drafters use (DSPARK.md).

`config.json` is a Qwen3 config with `architectures: ["Qwen3DSparkModel"]` and, at the top level,
`num_hidden_layers` (the drafter's), `num_target_layers`, `block_size`, `target_layer_ids`
(0-based), `mask_token_id`, `layer_types` (all full_attention), `tie_word_embeddings: false`,
`num_anchors`, `markov_rank`, `markov_head_type: "vanilla"`, `enable_confidence_head` and
`confidence_head_with_markov`, written explicitly (vLLM reads a missing key as false, SGLang
refuses false). No `dflash_config`. `model.safetensors` holds the DFlash keys plus the target's
`embed_tokens.weight` and `lm_head.weight` (the released files ship both and SGLang reads them as
the drafter's own) and the heads: `markov_head.markov_w{1,2}.weight` [V, r] and
`confidence_head.proj.{weight [1, H (+ r)], bias [1]}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.drafters.config import DrafterConfig

ARCHITECTURE = "Qwen3DSparkModel"
HEAD_KEYS = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen: not parameters
_MARKOV_KEYS = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
_CONFIDENCE_KEYS = ("confidence_head.proj.weight", "confidence_head.proj.bias")
# The config keys this format adds to a Qwen3 config, besides the size fields.
_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors")


def is_dspark_config(data: dict[str, Any]) -> bool:
    return ARCHITECTURE in (data.get("architectures") or ())


def dspark_keys(cfg: DrafterConfig) -> tuple[str, ...]:
    """The weight names DSpark's export adds to the DFlash keys, in its order."""
    keys = HEAD_KEYS
    if cfg.markov_rank:
        keys += _MARKOV_KEYS
    if cfg.enable_confidence_head:
        keys += _CONFIDENCE_KEYS
    return keys


def dspark_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """The shapes of `dspark_keys(cfg)`."""
    v, h, r = cfg.vocab_size, cfg.hidden_size, cfg.markov_rank
    shapes = {key: (v, h) for key in HEAD_KEYS}
    if r:
        shapes.update({key: (v, r) for key in _MARKOV_KEYS})
    if cfg.enable_confidence_head:
        inputs = h + (r if cfg.confidence_head_with_markov else 0)
        shapes.update(dict(zip(_CONFIDENCE_KEYS, ((1, inputs), (1,)), strict=True)))
    return shapes


def dspark_hf_config(base: dict[str, Any], cfg: DrafterConfig) -> dict[str, Any]:
    """`base` (the DFlash config.json of the same shape) in DeepSpec's DSpark form."""
    out = {k: v for k, v in base.items() if k not in ("dflash_config", "is_causal")}
    out.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3",
        num_hidden_layers=cfg.num_layers,
        layer_types=["full_attention"] * cfg.num_layers,
        tie_word_embeddings=False,
        markov_rank=cfg.markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=cfg.enable_confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
    )
    out.update({name: getattr(cfg, name) for name in _FIELDS})
    out["target_layer_ids"] = list(cfg.target_layer_ids)
    return out


def dspark_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The DrafterConfig fields of a DSpark config.json (its top-level keys); a missing
    `confidence_head_with_markov` reads as false, as vLLM reads it."""
    if data.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(
            f"markov_head_type {data['markov_head_type']!r}: only the vanilla Markov head is "
            "released and served"
        )
    return {
        "drafter_type": "dspark",
        "markov_rank": int(data.get("markov_rank", 0)),
        "enable_confidence_head": bool(data.get("enable_confidence_head", False)),
        "confidence_head_with_markov": bool(data.get("confidence_head_with_markov", False)),
        "num_anchors": int(data.get("num_anchors", 512)),
    }


def export_heads(checkpoint: Path, cache: Path | None) -> tuple[Any, Any]:
    """The target's (embedding, lm_head) a DSpark export of `checkpoint` ships: from `cache`
    (--cache), else from the cache its run trained on, as its --data spelled it (relative to the
    folder the run was started in). ValueError, saying to give --cache, where they are unread."""
    from safetensors import SafetensorError

    from shared.target_files import load_heads
    from train.checkpoint import load_state

    given = cache is not None
    cache = cache if given else Path(load_state(checkpoint)["config"]["data"])
    try:
        return load_heads(cache)
    except (OSError, SafetensorError) as e:
        source = "--cache" if given else f"{checkpoint} was trained on --data {cache}, but"
        raise ValueError(
            f"{source} the target's embedding and lm_head, which a DSpark export ships, cannot "
            f"be read there ({e}): give the cache with --cache"
        ) from None
