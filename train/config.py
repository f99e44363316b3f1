"""TrainConfig: every setting of stage two, the single source of CLI options and defaults.

Fields left at None are resolved against the cache and the device by `train.run.resolve` (the
target layers, mask token, gamma, attention backend, compile mode, max length); the resolved
config is what `runs/NAME/config.json` records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from shared.cli import option
from train.drafters import config as drafter_names  # the drafters' names, fields and defaults
from train.drafters import objective as objectives  # the losses' and slot weights' names
from train.options import (
    ATTENTIONS,
    CE_MODES,
    COMPILE_MODES,
    GRAD_CKPT_MODES,
    ONLY_WITH,
    OPTIMIZERS,
    parse_ints,
    parse_layer_types,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    ONLY_WITH: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = ONLY_WITH  # train.options
    # where
    data: Path = option(help="cache folder written by `python -m extract` (holds manifest.json)")
    out: Path = option(help="run folder: config.json, checkpoints/, metrics.jsonl, export/")
    gpus: str | None = option(
        None, help="devices: 0-4, 0,2,5, cpu, cpu:N (N gloo processes); default all GPUs, else cpu"
    )
    follow: bool = option(
        True,
        help="train on a cache that an extraction is still writing, reading parts as they are "
        "committed and waiting for more; --no-follow refuses a cache that is not complete",
    )
    # drafter
    drafter_type: str = option(
        "dflash",
        choices=drafter_names.DRAFTER_TYPES,
        help="dflash, dflash2 (DFlash plus grouped dynamic convolutions and a candidate "
        "selector) or dspark (the anchor slot drafts too, plus a Markov head and a confidence "
        "head); one cache serves all three",
    )
    drafter_layers: int = option(5, help="number of drafter layers")
    layer_types: str | None = option(
        None,
        help="per drafter layer, comma-separated: full_attention or sliding_attention (aliases "
        "full, sliding; one value applies to all); default all full, except Qwen3.6-27B targets: "
        "all but the last sliding (window 2048), as its published drafter (dflash2: all sliding)",
    )
    sliding_window: int | None = option(
        None,
        help="window of sliding-attention layers: required with a sliding --layer-types (the "
        "default layer types come with theirs: 2048 for dflash2 and for Qwen3.6-27B targets)",
    )
    is_causal: str | None = option(
        None,
        choices=("true", "false"),
        help="attention inside the block: causal or not for every layer; default sliding "
        "layers causal, full ones not (dflash2: false, as the published DFlash2 drafters)",
    )
    conv_kernel_size: int = option(2, help="dflash2: taps of each convolution")
    conv_group_size: int = option(16, help="dflash2: channels per dynamic-kernel group")
    selector_rank: int = option(256, help="dflash2: rank of the candidate selector")
    selector_top_k: int = option(16, help="dflash2: candidates the selector rescores")
    output_multiplier: float | None = option(
        None,
        help="dflash2: scale of the drafter's logits (default the target's logit scale, if any)",
    )
    final_logit_softcapping: float | None = option(
        None, help="dflash2: tanh softcap of the drafter's logits (default the target's, if any)"
    )
    selector_weight: float = option(1.0, help="dflash2: weight alpha of the selector's CE")
    selector_warmup: float = option(
        0.0, help="dflash2: fraction of steps with the selector's CE off (alpha 0)"
    )
    selector_ramp: float = option(
        0.0, help="dflash2: fraction of steps after the warm-up over which alpha ramps linearly"
    )
    selector_stop_grad: bool = option(
        False, help="dflash2: the selector's CE trains the selector only, not the backbone"
    )
    markov_rank: int = option(256, help="dspark: rank of the Markov head (0: no Markov head)")
    confidence_head: bool = option(
        True, help="dspark, --dspark-loss full: train the confidence head"
    )
    confidence_head_with_markov: bool = option(
        True,
        help="dspark: the confidence head reads the previous token's Markov embedding beside the "
        "hidden state (as the released drafters; SGLang refuses false)",
    )
    dspark_loss: str = option(
        "full",
        choices=drafter_names.DSPARK_LOSSES,
        help="dspark: full (CE, L1 to the target's distribution and the confidence BCE; the cache "
        "must hold the target's last layer) or ce (CE alone, no confidence head; any cache)",
    )
    dspark_ce_weight: float = option(0.1, help="dspark: weight of the CE term (full loss)")
    dspark_l1_weight: float = option(0.9, help="dspark: weight of the L1 term (full loss)")
    dspark_conf_weight: float = option(1.0, help="dspark: weight of the confidence BCE term")
    init_from: Path | None = option(
        None,
        help="warm start: a checkpoint folder (step-N) or an export of a DFlash or DFlash2 "
        "drafter of the same shape; parameters it lacks keep their (no-op) init",
    )
    drafter_heads: int | None = option(
        None,
        help="attention heads of the drafter; default the published drafters' (the target's; "
        "32 for Qwen3.5/3.6)",
    )
    drafter_kv_heads: int | None = option(
        None,
        help="key/value heads of the drafter; default the published drafters' (the target's; "
        "8 for Qwen3.5/3.6, 4 for their MoE targets)",
    )
    drafter_head_dim: int | None = option(
        None,
        help="head dimension of the drafter; default the published drafters' (the target's; "
        "128 for Qwen3.5/3.6)",
    )
    drafter_intermediate: int | None = option(
        None,
        help="MLP intermediate size of the drafter; default the target's (MoE targets: routed "
        "experts per token x moe_intermediate_size + the shared expert's)",
    )
    block_size: int | None = option(None, help="tokens per draft block; default 16 (dspark: 7)")
    num_anchors: int | None = option(
        None,
        help="anchor blocks drawn per micro-batch row; default --batch-tokens / 6, the recipe's "
        "512 per 3072 tokens (fewer candidates: the rest are dropped, weight 0)",
    )
    gamma: float | None = option(
        None,
        help="loss decay over block offsets (--slot-weights exp); default 7 for block 16, 4 for "
        "block 8, 7 x block / 16 rounded for others (dspark: 4)",
    )
    target_layers: str | None = option(
        None,
        help="comma-separated cached target layer ids to use (trained and exported in ascending "
        "order, the order serving engines feed them in); default all (dspark: all but the "
        "target's last layer, which it reads as the target's distribution)",
    )
    mask_token_id: int | None = option(
        None,
        help="embedding row used as the mask token; default: Qwen3's or Qwen3.5's published id, "
        "else the first row past the tokenizer, else an unused special token of the tokenizer",
    )
    # compute
    attention: str | None = option(
        None, choices=ATTENTIONS, help="attention backend; default flex on CUDA, sdpa on CPU"
    )
    compile: str | None = option(
        None,
        choices=COMPILE_MODES,
        help="torch.compile: none (on CUDA the flex_attention kernel is still compiled: eager flex "
        "is a slow reference), flex (also the BlockMask builder) or model (the whole drafter); "
        "default model on CUDA, none on CPU",
    )
    recompile_limit: int = option(
        16, help="torch.compile recompiles allowed per function; hitting it is an error"
    )
    grad_ckpt: str = option(
        "loss",
        choices=GRAD_CKPT_MODES,
        help="activation checkpointing: none, loss (the lm_head + CE chunks, with --ce autograd) "
        "or layers (the drafter layers too)",
    )
    ce: str = option(
        "fused",
        choices=CE_MODES,
        help="lm_head + CE: fused (each chunk's gradient formed in the forward: no logits kept or "
        "recomputed; compiled with --compile model) or autograd (checkpointed per --grad-ckpt)",
    )
    ce_chunk_blocks: int = option(128, help="blocks per lm_head + CE chunk")
    # data
    batch_tokens: int = option(
        3072,
        help="context tokens of a micro-batch: one row of whole samples packed back to back "
        "(fixed shape; a longer sample is truncated to it, and counted)",
    )
    max_length: int | None = option(None, help="truncate samples to this; default the cache's")
    workers: int | None = option(
        None,
        help="DataLoader worker processes per rank (0: read in-process; default 8 on GPUs, "
        "2 on CPU ranks)",
    )
    shuffle_buffer: int = option(1024, help="samples held by the shuffle buffer of each worker")
    prefetch: int = option(2, help="micro-batches each worker prepares ahead")
    # recipe
    grad_accum: int = option(1, help="micro-batches per optimizer step (per rank)")
    optimizer: str = option(
        "adamw",
        choices=OPTIMIZERS,
        help="adamw (every parameter), or muon: torch.optim.Muon on the hidden weight matrices "
        "(the nn.Linear weights) at --muon-lr, AdamW on the rest (norms, DFlash2's kernels and "
        "codebooks) at --lr",
    )
    lr: float = option(6e-4, help="peak learning rate (AdamW)")
    muon_lr: float = option(
        0.02, help="peak learning rate of Muon's matrices (--optimizer muon; same schedule)"
    )
    noise_std: float = option(
        0.0,
        help="standard deviation of Gaussian noise added to the cached hidden states of real "
        "tokens fed to the drafter in training (not in evaluation); 0: off",
    )
    loss: str = option(
        "ce",
        choices=objectives.LOSSES,
        help="dflash: the loss of each slot: ce (cross-entropy on the data token), kl (KL(target "
        "|| drafter) to the target's distribution, softmax of lm_head(the target's last hidden "
        "state); the cache must hold the target's last layer), tv (total variation to it) or mix "
        "((1 - --kl-weight) CE + --kl-weight KL)",
    )
    kl_weight: float = option(0.5, help="--loss mix: the KL's weight (the CE's is 1 minus it)")
    slot_weights: str = option(
        "exp",
        choices=objectives.SLOT_WEIGHTS,
        help="loss weight of each block offset k: exp (exp(-(k-1)/--gamma), the DFlash recipe), "
        "uniform (1), or dpace (dflash, --loss ce: speculators' D-PACE, each slot weighted by "
        "the expected acceptance it leads to, from the drafter's own smoothed confidences)",
    )
    dpace_alpha: float = option(0.5, help="--slot-weights dpace: confidence smoothing, in (0, 1]")
    warmup: float = option(0.04, help="fraction of steps of linear warmup before cosine decay")
    weight_decay: float = option(0.0, help="AdamW weight decay")
    grad_clip: float = option(1.0, help="clip the global gradient norm to this (0: off)")
    epochs: int = option(
        6,
        help="epochs over the training parts (not with --steps); on a cache still being "
        "written, the run's steps are fixed at start from an estimate of the finished cache",
        moot_with="steps",
    )
    steps: int | None = option(None, help="optimizer steps to train; default from --epochs")
    seed: int = option(0, help="seed of init, data order and anchors")
    # evaluation
    eval_fraction: float = option(
        0.01,
        help="fraction of samples held out for evaluation, evenly spaced over the cache (rounded "
        "down, at least one; not with --eval-parts)",
        moot_with="eval_parts",
    )
    eval_parts: int | None = option(
        None, help="hold out this many whole parts instead (not with --eval-fraction)"
    )
    eval_every: int = option(1000, help="evaluate every this many steps (0: only at the end)")
    eval_batches: int = option(0, help="micro-batches per rank per evaluation (0: all)")
    # bookkeeping
    log_every: int = option(10, help="log metrics every this many steps")
    checkpoint_every: int = option(1000, help="save a checkpoint every this many steps")
    keep_checkpoints: int = option(3, help="keep this many newest checkpoints")
    resume: str = option("auto", help="auto (newest complete checkpoint), none, or a step-N path")
    stop_after_steps: int | None = option(
        None,
        help="stop after this many steps as if killed there (the checkpoints due by then, no "
        "export; exits 0): for resume tests",
    )
    verbose: bool = option(False, help="debug logging on every rank")

    def __post_init__(self) -> None:
        for name in ("drafter_layers", "batch_tokens", "grad_accum"):
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        for name in ("epochs", "shuffle_buffer", "eval_every", "eval_batches"):
            _check(getattr(self, name) >= 0, name, "must be >= 0")
        _check(self.workers is None or self.workers >= 0, "workers", "must be >= 0")
        for name in ("log_every", "checkpoint_every", "keep_checkpoints", "prefetch"):
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        _check(self.recompile_limit >= 1, "recompile_limit", "must be >= 1")
        _check(bool(self.resume.strip()), "resume", "is empty: give auto, none or a checkpoint")
        if self.resume.strip().lower() in ("auto", "none"):  # AUTO, None: the words, any case
            object.__setattr__(self, "resume", self.resume.strip().lower())
        if self.block_size is None:  # the family's default, fixed at construction
            object.__setattr__(self, "block_size", self.default_block_size)
        _check(self.block_size >= 2, "block_size", "must be >= 2 (offset 0 is never a target)")
        _check(
            self.block_size <= self.batch_tokens,
            "block_size",
            f"must be at most batch_tokens ({self.batch_tokens}): a block lies in one packed row",
        )
        _check(
            self.max_length is None or self.max_length >= self.block_size,
            "max_length",
            f"must be at least block_size ({self.block_size}): no draft block fits in a shorter "
            "sample",
        )
        for name in _AT_LEAST_0:
            value = getattr(self, name)
            _check(value is None or value >= 0, name, "must be >= 0")
        _check(
            self.drafter_type != "dspark"
            or self.markov_rank > 0
            or not self.with_confidence_head
            or not self.confidence_head_with_markov,
            "markov_rank",
            "0 leaves the confidence head without its Markov input: give --no-confidence-head "
            "(the plain anchor-first drafter) or --no-confidence-head-with-markov",
        )
        objectives.Objective.of(self)  # the loss and slot weights, with their family
        _check(self.ce_chunk_blocks >= 1, "ce_chunk_blocks", "must be >= 1")
        for name in drafter_names.DFLASH2_FIELDS:
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        for name in drafter_names.LOGIT_FIELDS:
            value = getattr(self, name)
            _check(value is None or value > 0, name, "must be > 0")
            _check(
                value is None or self.drafter_type == "dflash2",
                name,
                "applies to --drafter-type dflash2 only (a DFlash drafter's logits are lm_head's)",
            )
        for name in ("selector_warmup", "selector_ramp"):
            _check(0 <= getattr(self, name) <= 1, name, "must be in [0, 1]")
        _check(
            self.selector_warmup + self.selector_ramp <= 1,
            "selector_ramp",
            "selector_warmup + selector_ramp must be <= 1",
        )
        _check(self.lr > 0, "lr", "must be > 0")
        _check(self.muon_lr > 0, "muon_lr", "must be > 0")
        _check(0 <= self.warmup < 1, "warmup", "must be in [0, 1)")
        _check(0 <= self.eval_fraction < 1, "eval_fraction", "must be in [0, 1)")
        for name in _AT_LEAST_1:
            value = getattr(self, name)
            _check(value is None or value >= 1, name, "must be >= 1")
        _check(self.gamma is None or self.gamma > 0, "gamma", "must be > 0")
        _check(self.steps is not None or self.epochs >= 1, "epochs", "must be >= 1 without steps")
        for name, allowed in (
            ("attention", ATTENTIONS),
            ("compile", COMPILE_MODES),
            ("grad_ckpt", GRAD_CKPT_MODES),
            ("ce", CE_MODES),
            ("optimizer", OPTIMIZERS),
        ):
            value = getattr(self, name)
            _check(value is None or value in allowed, name, f"must be one of {allowed}")
        ids = parse_ints(self.target_layers, "target_layers")
        _check(ids is None or len(ids) > 0, "target_layers", "must name at least one layer")
        _check(
            ids is None or len(set(ids)) == len(ids),
            "target_layers",
            f"names a layer twice ({self.target_layers}): give each layer once",
        )
        types = parse_layer_types(self.layer_types, self.drafter_layers)
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("sliding_window: required when a drafter layer slides")
        _check(
            self.layer_types is None or "sliding_attention" in types or self.sliding_window is None,
            "sliding_window",
            "has no effect: no layer of --layer-types slides (drop it, or make a layer sliding)",
        )

    @property
    def default_block_size(self) -> int:
        return drafter_names.DSPARK_BLOCK_SIZE if self.drafter_type == "dspark" else 16

    @property
    def with_confidence_head(self) -> bool:
        """Whether a DSpark drafter gets a confidence head: asked for, and trainable (full loss)."""
        return self.confidence_head and self.dspark_loss == "full"

    @property
    def anchors_per_row(self) -> int:
        """num_anchors, or the recipe's density: 512 blocks per 3072 context tokens."""
        return self.num_anchors or max(1, round(self.batch_tokens * 512 / 3072))

    @property
    def target_layer_ids(self) -> tuple[int, ...] | None:
        return parse_ints(self.target_layers, "target_layers")

    @property
    def layer_type_names(self) -> tuple[str, ...]:
        return parse_layer_types(self.layer_types, self.drafter_layers)

    @property
    def causal(self) -> bool | None:
        """--is-causal as a bool, None when unset."""
        return None if self.is_causal is None else self.is_causal == "true"

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


# Fields that must be >= 0 where given.
_AT_LEAST_0 = ("selector_weight", "noise_std", "weight_decay", "grad_clip", "eval_parts")
_AT_LEAST_0 += ("mask_token_id", "markov_rank", "dspark_ce_weight", "dspark_l1_weight")
_AT_LEAST_0 += ("dspark_conf_weight",)
# Fields that must be >= 1 where given.
_AT_LEAST_1 = ("steps", "stop_after_steps", "sliding_window", "drafter_heads", "drafter_kv_heads")
_AT_LEAST_1 += ("drafter_head_dim", "drafter_intermediate", "num_anchors")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
