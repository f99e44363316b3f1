"""Attention masks for the capture forward: premade where that is provably the model's own.

transformers models take a dict {layer type: mask} as already built masks. Without one they
build them from the inputs, and finding out whether the rows are packed sequences reads a device
tensor back (`masking_utils.find_packed_sequence_indices`): the thread that launches the forward
passes then waits for the device to finish the previous batch, and queues the next batch's
kernels only just ahead of the GPU while writer threads want the GIL it needs for each launch
(measured: `bench/extract_bench.py --masks premade|library`, README Results). Our rows are
right-padded and never packed, so for a model whose layers are all causal full attention or
linear attention the masks it would build are `None` for every type: sdpa and flash attention
read `None` as causal, and a linear-attention layer without a padding mask keeps every token.

`choose_masks` decides once per process: the config must qualify (`premade_masks`), and a probe
forward on two right-padded rows must give the same states with the premade masks as with the
model's own (it catches a model whose forward does not take the dict).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# Layer types whose mask, for right-padded rows run without a cache, is plain causal attention.
CAUSAL_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})
# Attention implementations that read a `None` mask as causal (eager and flex_attention read it
# as no mask at all: every token would see the ones after it).
CAUSAL_WHEN_NONE = frozenset({"sdpa", "flash_attention_2", "flash_attention_3"})
# Off only to measure what the premade masks change (`bench/extract_bench.py --masks library`).
PREMADE_MASKS = True
# The probe: two rows of these lengths (the second right-padded), and the largest difference
# allowed between the two forwards, relative to the states' largest magnitude.
PROBE_LENGTHS = (24, 11)
PROBE_TOLERANCE = 1e-3

Masks = dict[str, None]


def premade_masks(config) -> Masks | None:  # noqa: ANN001
    """The mapping {layer type: None} for a config whose masks are all plain causal attention,
    else None. Sliding-window layers, configs without `layer_types`, and attention
    implementations that do not read `None` as causal keep the model's own masks.

    >>> from types import SimpleNamespace as NS
    >>> premade_masks(NS(layer_types=["linear_attention", "full_attention"],
    ...                  _attn_implementation="sdpa"))
    {'full_attention': None, 'linear_attention': None}
    >>> premade_masks(NS(layer_types=["full_attention", "sliding_attention"],
    ...                  _attn_implementation="sdpa")) is None
    True
    >>> premade_masks(NS(layer_types=["full_attention"], _attn_implementation="eager")) is None
    True
    """
    types = getattr(config, "layer_types", None)
    if not PREMADE_MASKS or not types or not set(types) <= CAUSAL_LAYER_TYPES:
        return None
    if getattr(config, "_attn_implementation", None) not in CAUSAL_WHEN_NONE:
        return None
    return {t: None for t in sorted(set(types))}


def forward_kwargs(ids_BL: torch.Tensor, masks: Masks | None) -> dict:
    """Keyword arguments of the decoder forward on right-padded `ids_BL`: no cache, and
    `masks` as the attention mask where given (None: the model builds its own)."""
    kwargs = {"input_ids": ids_BL, "use_cache": False}
    if masks is not None:
        kwargs["attention_mask"] = masks
    return kwargs


@torch.inference_mode()
def choose_masks(body: nn.Module, *, pad_id: int = 0) -> Masks | None:
    """The masks to pass to `body` (a decoder without capture hooks), or None for its own.

    Premade masks are used only when `premade_masks` allows them and a probe forward on two
    right-padded rows gives the states of the model's own masks at every real token."""
    masks = premade_masks(body.config)
    if masks is None:
        return None
    param = next(body.parameters())
    vocab = int(getattr(body.config, "vocab_size", 1000) or 1000)
    gen = torch.Generator().manual_seed(0)
    width = max(PROBE_LENGTHS)
    ids_BL = torch.full((len(PROBE_LENGTHS), width), pad_id, dtype=torch.long)
    for b, n in enumerate(PROBE_LENGTHS):
        ids_BL[b, :n] = torch.randint(0, min(vocab, 1000), (n,), generator=gen)
    ids_BL = ids_BL.to(param.device)
    try:
        mine = _states(body(**forward_kwargs(ids_BL, masks)))
    except Exception as e:  # a forward that does not take the mapping: its own masks
        name, error = type(body).__name__, f"{type(e).__name__}: {e}"
        log.info(
            "attention masks: the model's own (%s does not take premade ones: %s)", name, error
        )
        return None
    own = _states(body(**forward_kwargs(ids_BL, None)))
    diff = scale = 0.0
    for b, n in enumerate(PROBE_LENGTHS):  # real tokens only: padding is never stored
        diff = max(diff, (mine[b, :n] - own[b, :n]).abs().max().item())
        scale = max(scale, own[b, :n].abs().max().item())
    if not diff <= PROBE_TOLERANCE * max(scale, 1e-6):
        log.warning(
            "attention masks: the model's own (premade ones changed a probe forward of %s by "
            "%.2e, its states reach %.2e)",
            type(body).__name__,
            diff,
            scale,
        )
        return None
    log.info("attention masks: premade %s (no device read-back per forward)", sorted(masks))
    return masks


def _states(out) -> torch.Tensor:  # noqa: ANN001
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    return hidden.float()
