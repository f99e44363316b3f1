"""Stored states against a fresh forward of the target, layer by layer: the relative error
and each layer's allowance (the storage's rounding, or what other batch shapes move the fresh
states by). `python -m extract.verify` runs it on re-run samples."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# int4 (`bench/store_bench.py` on SmolLM2-135M's real states): a sample's error at a layer is at
# most 0.065, a token's 0.106; random-weight targets' Gaussian-like states err by about 0.09.
TOLERANCE = {"bf16": 2e-2, "fp8": 8e-2, "int4": 0.15}
# How many times the difference between two fresh forwards (alone, and in a full batch) a stored
# layer may differ from the fresh one: the stored states came from yet another batch shape.
FLOOR_FACTOR = 3.0
# How far a part made under a sharded layout (`PartRecord.layout`) may differ from the fresh
# forward of one process before FLOOR_FACTOR: bf16 tensor parallel states of tiny random Qwen3
# and Llama targets differ from one process's by 1.9e-3 at their first layer to 7.6e-3 at their
# sixth (`python bench/parallel_noise.py --family qwen3|llama`, 2-core CPU, transformers 5.24).
SHARDED_FLOOR = 7.6e-3


def layer_errors(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Relative error ||a - b|| / ||b|| of each layer's states, both [tokens, layers, H].

    >>> import torch
    >>> b = torch.ones(3, 2, 4)
    >>> a = b.clone(); a[:, 1] *= 1.5
    >>> layer_errors(a, b)
    [0.0, 0.5]
    """
    diff = (a - b).norm(dim=(0, 2))
    return (diff / b.norm(dim=(0, 2)).clamp_min(1e-12)).tolist()


@dataclasses.dataclass(frozen=True)
class LayerCheck:
    """One sample's stored states against a fresh forward, per layer id."""

    layer_ids: tuple[int, ...]
    errors: tuple[float, ...]  # stored vs the fresh forward alone
    floor: tuple[float, ...]  # the fresh forward in a full batch vs alone
    allowed: tuple[float, ...]

    @property
    def problems(self) -> list[str]:
        return [
            f"at layer {lid}: relative error {e:.3g} > {a:.3g} allowed (two fresh forwards of "
            f"other batch shapes differ by {f:.3g} there)"
            for lid, e, f, a in zip(
                self.layer_ids, self.errors, self.floor, self.allowed, strict=True
            )
            if not e <= a
        ]

    def summary(self) -> str:
        k = max(range(len(self.errors)), key=lambda i: self.errors[i] / self.allowed[i])
        return (
            f"relative error {max(self.errors):.2e} at most (layer {self.layer_ids[k]}: "
            f"{self.errors[k]:.2e} of {self.allowed[k]:.2e} allowed; fresh forwards of two "
            f"batch shapes differ there by {self.floor[k]:.2e})"
        )


def compare_layers(
    stored: torch.Tensor,
    fresh: torch.Tensor,
    batched: torch.Tensor,
    layer_ids,  # noqa: ANN001
    store: str,
    *,
    packed: torch.Tensor | None = None,
    sharded: bool = False,
) -> LayerCheck:
    """Stored states against the fresh ones, per layer, with each layer's allowance: the
    storage's tolerance, or `FLOOR_FACTOR` times the larger difference between the fresh
    forward alone and in another arrangement (`batched`: a full padded batch; `packed`: a
    packed row, where extraction packs), whichever is larger.

    >>> import torch
    >>> fresh = torch.ones(2, 2, 4)
    >>> stored = fresh * torch.tensor([1.01, 1.2]).view(1, 2, 1)
    >>> batched = fresh * torch.tensor([1.0, 1.1]).view(1, 2, 1)
    >>> check = compare_layers(stored, fresh, batched, (3, 9), "bf16")
    >>> [round(a, 3) for a in check.allowed], check.problems == []
    ([0.02, 0.3], True)
    >>> compare_layers(stored, fresh, fresh, (3, 9), "bf16").problems[0][:35]
    'at layer 9: relative error 0.2 > 0.'
    """
    floor = layer_errors(batched, fresh)
    if packed is not None:
        floor = [max(a, b) for a, b in zip(floor, layer_errors(packed, fresh), strict=True)]
    if sharded:  # made under a sharded layout: its reductions ran in another order
        floor = [max(f, SHARDED_FLOOR) for f in floor]
    return LayerCheck(
        layer_ids=tuple(layer_ids),
        errors=tuple(layer_errors(stored, fresh)),
        floor=tuple(floor),
        allowed=tuple(max(TOLERANCE[store], FLOOR_FACTOR * f) for f in floor),
    )
