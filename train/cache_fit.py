"""What a run reads of its cache: the taps, the last layer a loss or family needs, the drafter
config resolved against the cache's target, and every way the cache cannot serve them."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

from safetensors import safe_open

from shared.manifest import (
    LAST_LAYER_WARNING,
    CacheMismatch,
    Manifest,
    repair_commands,
)
from shared.manifest_checks import check_compatible
from shared.target_files import (
    EMBED_FILE,
    EMBED_KEY,
    read_target_config,
    target_dir,
    target_problems,
    unused_special_token,
)
from train.config import TrainConfig
from train.drafters.config import DFLASH2_FIELDS, LOGIT_FIELDS, DrafterConfig
from train.drafters.objective import TARGET_LOSSES

log = logging.getLogger(__name__)


def ascending_layers(ids: tuple[int, ...]) -> tuple[int, ...]:
    """`ids` sorted: SGLang and vLLM feed a drafter its target states in layer order whatever
    `target_layer_ids` says, so a drafter trained on another order would get permuted features
    there. The cache's order does not matter (`layer_positions` picks the stored layers)."""
    if list(ids) != sorted(ids):
        log.info(
            "--target-layers %s: trained in ascending order %s (the order serving engines use)",
            ",".join(map(str, ids)),
            ",".join(map(str, sorted(ids))),
        )
    return tuple(sorted(ids))


def fit_cache(
    cfg: TrainConfig, manifest: Manifest, *, complete: bool = True, target_files: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...], DrafterConfig | None, list[str]]:
    """What `cfg` reads of the cache and its drafter: (taps, layers read, drafter config or
    None, problems: every way the cache cannot serve it, with the repair where one helps).
    `target_files`: also checksum the cache's target/ files (the embedding: GBs at 8B)."""
    repair = repair_commands(cfg.data, manifest)
    damaged = target_problems(cfg.data, manifest.target_files) if target_files else []
    problems = [*damaged, f"to repair them: {repair}"] if damaged else []
    wanted = ascending_layers(cfg.target_layer_ids or default_taps(cfg, manifest))
    if manifest.target.num_layers - 1 in wanted:
        log.warning(LAST_LAYER_WARNING, manifest.target.num_layers - 1)
    read = wanted + last_layer(cfg, manifest, problems)
    problems += max_length_problems(cfg, manifest)
    drafter, hidden = _drafter_config(cfg, manifest, wanted, problems)
    embed_rows = _embedding_rows(cfg.data, manifest, problems)
    try:
        check_compatible(
            manifest,
            cache=cfg.data,
            layer_ids=wanted,
            hidden_size=hidden,
            vocab_size=embed_rows,
            require_complete=complete,
        )
    except CacheMismatch as e:
        problems = e.problems + problems
    return wanted, read, drafter, problems


def default_taps(cfg: TrainConfig, manifest: Manifest) -> tuple[int, ...]:
    """Without --target-layers: every cached layer; for DSpark every one but the target's last,
    which it reads as the target's own distribution (and engines cannot feed as a tap)."""
    cached, last = tuple(manifest.layer_ids), manifest.target.num_layers - 1
    taps = tuple(i for i in cached if i != last)
    if cfg.drafter_type != "dspark" or not taps or taps == cached:
        return cached
    log.info("dspark: taps %s (the cached layers but the last, %d)", list(taps), last)
    return taps


def max_length_problems(cfg: TrainConfig, manifest: Manifest) -> list[str]:
    """--max-length past what a sample can hold here has no effect: the cache's samples were cut
    to its extraction's --max-length, and a micro-batch row holds --batch-tokens."""
    if cfg.max_length is None or cfg.max_length <= min(manifest.max_length, cfg.batch_tokens):
        return []
    if cfg.batch_tokens < manifest.max_length:
        limit, why = cfg.batch_tokens, f"a micro-batch row holds --batch-tokens {cfg.batch_tokens}"
    else:
        limit = manifest.max_length
        why = (
            f"the cache was extracted with --max-length {limit}; extract again with a larger "
            "one for longer samples"
        )
    return [
        f"{MAX_LENGTH_PROBLEM}{cfg.max_length} has no effect: samples are at most {limit} "
        f"tokens here ({why}); drop it, or give --max-length {limit} or less"
    ]


def last_layer(cfg: TrainConfig, manifest: Manifest, problems: list[str]) -> tuple[int, ...]:
    """(the target's last layer,) when the run reads the target's distribution (DSpark's
    `--dspark-loss full`, a DFlash `--loss` in TARGET_LOSSES), else (); a cache without it is a
    problem naming the extract option that adds it."""
    if cfg.drafter_type == "dspark" and cfg.dspark_loss == "full":
        needs = "--drafter-type dspark trains its L1 and confidence terms on"
        instead = "`--dspark-loss ce` (CE alone, no confidence head)"
    elif cfg.loss in TARGET_LOSSES:
        needs = f"--loss {cfg.loss} compares the drafter's distribution with the one of"
        instead = "`--loss ce` (CE on the data tokens)"
    else:
        return ()
    last, cached = manifest.target.num_layers - 1, list(manifest.layer_ids)
    if last in cached:
        return (last,)
    problems.append(
        f"{needs} the target's last hidden state (layer {last}, after the final norm), which "
        f"this cache lacks (cached layers {cached}): extract it again adding layer {last}, "
        f"`python -m extract --layers {','.join(map(str, sorted({*cached, last})))} ...`, or "
        f"train with {instead}"
    )
    return ()


def _drafter_config(
    cfg: TrainConfig, manifest: Manifest, wanted: tuple[int, ...], problems: list[str]
) -> tuple[DrafterConfig | None, int | None]:
    """(the drafter's config, the hidden size it needs), None where the target config fails."""
    try:
        target_cfg = read_target_config(cfg.data)
        text = target_cfg.get("text_config") or target_cfg
        hidden = int(text["hidden_size"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        problems.append(f"target config unreadable: {e}")
        return None, None
    try:
        drafter = DrafterConfig.from_target_config(
            target_cfg,
            num_layers=cfg.drafter_layers,
            target_layer_ids=wanted,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            # None: the published drafters' layer types for this target (all full for most;
            # DFlash2: all sliding)
            layer_types=None if cfg.layer_types is None else cfg.layer_type_names,
            sliding_window=cfg.sliding_window,
            tokenizer_vocab_size=manifest.target.tokenizer_vocab_size,
            num_attention_heads=cfg.drafter_heads,
            num_key_value_heads=cfg.drafter_kv_heads,
            head_dim=cfg.drafter_head_dim,
            intermediate_size=cfg.drafter_intermediate,
            unused_token=unused_special_token(cfg.data),
            drafter_type=cfg.drafter_type,
            is_causal=cfg.causal,
            **family_fields(cfg),
        )
    except (ValueError, KeyError) as e:
        problems.append(option_problem(str(e), cfg))
        return None, hidden
    if cfg.sliding_window is not None and "sliding_attention" not in drafter.layer_types:
        types = ", ".join(sorted(set(drafter.layer_types)))
        problems.append(
            f"{OPTION_PROBLEM}--sliding-window {cfg.sliding_window} has no effect: no layer "
            f"slides (this target's default layer types: {types}); drop it, or give a sliding "
            "--layer-types"
        )
        return None, hidden
    return drafter, hidden


# The drafter config's fields that an option sets: (its flag, the TrainConfig field).
_OPTIONS = {
    "num_attention_heads": ("--drafter-heads", "drafter_heads"),
    "num_key_value_heads": ("--drafter-kv-heads", "drafter_kv_heads"),
    "head_dim": ("--drafter-head-dim", "drafter_head_dim"),
    "intermediate_size": ("--drafter-intermediate", "drafter_intermediate"),
    "num_layers": ("--drafter-layers", "drafter_layers"),
    "layer_types": ("--layer-types", "layer_types"),
    "sliding_window": ("--sliding-window", "sliding_window"),
    "block_size": ("--block-size", "block_size"),
    "mask_token_id": ("--mask-token-id", "mask_token_id"),
    "conv_group_size": ("--conv-group-size", "conv_group_size"),
    "conv_kernel_size": ("--conv-kernel-size", "conv_kernel_size"),
    "selector_rank": ("--selector-rank", "selector_rank"),
    "selector_top_k": ("--selector-top-k", "selector_top_k"),
    "final_logit_softcapping": ("--final-logit-softcapping", "final_logit_softcapping"),
    "markov_rank": ("--markov-rank", "markov_rank"),
    "is_causal": ("--is-causal", "is_causal"),
}
OPTION_PROBLEM = "the drafter options make no drafter: "
MAX_LENGTH_PROBLEM = "--max-length "  # the command's to fix, as OPTION_PROBLEM's


def option_problem(error: str, cfg: TrainConfig) -> str:
    """A drafter config's complaint: the options' to fix where it names a field an option set
    to other than its default (named with it), else the target config's or the defaults'."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    named = [
        flag
        for field, (flag, attr) in _OPTIONS.items()
        if re.search(rf"\b{field}\b", error) and getattr(cfg, attr) != defaults[attr]
    ]
    if not named:
        return f"drafter config: {error}"
    return f"{OPTION_PROBLEM}{error} (set by {', '.join(named)})"


def family_fields(cfg: TrainConfig) -> dict[str, int | float | bool]:
    """The drafter config's fields of `cfg`'s family (none for a DFlash drafter). DFlash2: its
    sizes and the logit transform only where given (else the target's, see
    `target_logit_transform`). DSpark: its heads (a confidence head only with the full loss)
    and the anchors per row, which its export records."""
    if cfg.drafter_type == "dspark":
        return {
            "markov_rank": cfg.markov_rank,
            "enable_confidence_head": cfg.with_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
            "num_anchors": cfg.anchors_per_row,
        }
    if cfg.drafter_type != "dflash2":
        return {}
    fields: dict[str, int | float | bool] = {name: getattr(cfg, name) for name in DFLASH2_FIELDS}
    for name in LOGIT_FIELDS:
        if getattr(cfg, name) is not None:
            fields[name] = getattr(cfg, name)
    return fields


def _embedding_rows(cache: Path, manifest: Manifest, problems: list[str]) -> int | None:
    """Rows of the cached embedding; a hidden size other than the manifest's is a problem."""
    path = target_dir(cache) / EMBED_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            rows, hidden = f.get_slice(EMBED_KEY).get_shape()
    except (OSError, KeyError, ValueError) as e:
        problems.append(f"target embedding {path} unreadable ({e})")
        return None
    if hidden != manifest.target.hidden_size:
        problems.append(
            f"target embedding has hidden size {hidden}, the manifest says "
            f"{manifest.target.hidden_size}"
        )
    return int(rows)
