"""The vocabularies and parsers of stage two's options: the allowed values of the choice options,
the options a resumed run may change, and the parsers of the comma-separated ones. Torch-free, like
train/config.py, so that `python -m train --help` stays fast."""

from __future__ import annotations

ATTENTIONS = ("flex", "sdpa")
COMPILE_MODES = ("none", "flex", "model")
GRAD_CKPT_MODES = ("none", "loss", "layers")
CE_MODES = ("fused", "autograd")
OPTIMIZERS = ("adamw", "muon")
LAYER_TYPE_ALIASES = {
    "full": "full_attention",
    "full_attention": "full_attention",
    "sliding": "sliding_attention",
    "sliding_attention": "sliding_attention",
}

# Changing these in an existing run folder changes no state a checkpoint holds, so a resume may
# use new values; any other change (drafter shape, data order, recipe) makes the run refuse.
HARMLESS_CHANGES = frozenset(
    {
        "data",  # the cache itself is compared by its manifest identity instead
        "out",  # the folder whose config.json this is, however the command spells it
        "gpus",  # the world size is checked against the checkpoint's loader state
        "workers",  # so are the loader streams
        "follow",  # the plan (followed or not) is the checkpoint's
        "steps",
        "epochs",
        "stop_after_steps",
        "attention",
        "compile",
        "recompile_limit",
        "grad_ckpt",
        "ce",
        "prefetch",
        "checkpoint_every",
        "keep_checkpoints",
        "resume",
        "log_every",
        "eval_every",
        "eval_batches",
        "verbose",
    }
)


def parse_ints(text: str | None, name: str) -> tuple[int, ...] | None:
    """'1,9,17' -> (1, 9, 17); ValueError naming the field on anything else."""
    if text is None:
        return None
    try:
        return tuple(int(v) for v in str(text).replace(" ", "").split(",") if v != "")
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated integers, got {text!r}") from None


def parse_layer_types(text: str | None, num_layers: int) -> tuple[str, ...]:
    """'sliding,full,...' (one per drafter layer, or one for all) -> full layer type names."""
    if text is None:
        return ("full_attention",) * num_layers
    names = [v for v in str(text).replace(" ", "").split(",") if v]
    bad = [v for v in names if v not in LAYER_TYPE_ALIASES]
    if bad:
        raise ValueError(f"layer_types: unknown {bad}; use full_attention or sliding_attention")
    if len(names) == 1:
        names = names * num_layers
    if len(names) != num_layers:
        raise ValueError(f"layer_types: {len(names)} given for {num_layers} drafter layers")
    return tuple(LAYER_TYPE_ALIASES[v] for v in names)


DFLASH2_ONLY = (
    "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_weight",
    "selector_warmup", "selector_ramp", "selector_stop_grad",
)  # fmt: skip
DSPARK_ONLY = ("markov_rank", "dspark_loss")
# DSpark's options that act only with its full loss: `--dspark-loss ce` trains the CE alone, with
# weight 1 and no confidence head (`TrainConfig.with_confidence_head`, `DSparkLoss.coefficients`).
DSPARK_FULL_ONLY = (
    "confidence_head", "confidence_head_with_markov", "dspark_ce_weight", "dspark_l1_weight",
    "dspark_conf_weight",
)  # fmt: skip
# Options that act only where another option has one of some values (and that one's own
# condition, if it has one): typed on a command line without it, refused
# (`shared.cli.refuse_moot`, through `TrainConfig.ONLY_WITH`), as a sweep of them would train the
# same run under several names.
ONLY_WITH = {
    **dict.fromkeys(DFLASH2_ONLY, ("drafter_type", ("dflash2",))),
    **dict.fromkeys(DSPARK_ONLY, ("drafter_type", ("dspark",))),
    **dict.fromkeys(DSPARK_FULL_ONLY, ("dspark_loss", ("full",))),  # itself dspark's only
    "muon_lr": ("optimizer", ("muon",)),
    "kl_weight": ("loss", ("mix",)),
    "dpace_alpha": ("slot_weights", ("dpace",)),
}
