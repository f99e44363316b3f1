"""The target's projections that read one input, as one matmul: q/k/v of attention, gate/up of
the MLP.

A decoder layer calls `q_proj(x)`, `k_proj(x)` and `v_proj(x)` on the same `x` (and
`gate_proj(x)`, `up_proj(x)`): three matmuls of the same rows, two of them narrow (the 8B
shape's k and v are 1,024 wide against its 4,096 hidden size). `fuse_projections` makes the
first of each group compute them all at once against the group's weights concatenated, and
the others return their part of that result, so the model's own forward runs unchanged. A
later projection checks that it is given the very tensor the first one was (otherwise it
multiplies as before), and the parts are dropped as soon as they are taken, so no more memory is
held than by the separate matmuls. The original weights become views into the concatenated
one, so the model holds no second copy, and `undo` gives every module back its own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# the groups, first member first: the order in which transformers' decoder layers call them
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Parts:
    """The first projection's input and the later ones' outputs, until each is taken."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.outputs: dict[str, torch.Tensor] = {}


def _group(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    """The group's Linear modules in `module` if they can be fused: present, plain nn.Linear,
    one input width, one dtype and device, biases on all or none."""
    linears = [getattr(module, n, None) for n in names]
    if not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0]
    same = all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in linears
    )
    return linears if same else None


def _concatenate(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """The members' `attr` (weight or bias) as one tensor, each member's now a view into it."""
    parts = [getattr(m, attr) for m in linears]
    if parts[0] is None:
        return None
    whole = torch.cat([p.detach() for p in parts])
    start = 0
    for p in parts:
        p.data = whole[start : start + p.shape[0]]
        start += p.shape[0]
    return whole


def _install(linears: list[nn.Linear], names: tuple[str, ...]) -> Callable[[], None]:
    weight, bias = _concatenate(linears, "weight"), _concatenate(linears, "bias")
    widths = [m.out_features for m in linears]
    parts = _Parts()

    def first(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight, bias)
        head, *rest = y.split(widths, dim=-1)
        parts.input = x
        parts.outputs = dict(zip(names[1:], rest, strict=True))
        return head

    def later(name: str, own: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = parts.outputs.pop(name, None)
            mine = out is not None and x is parts.input
            if not parts.outputs:
                parts.input = None
            return out if mine else F.linear(x, own.weight, own.bias)

        return forward

    linears[0].forward = first
    for name, m in zip(names[1:], linears[1:], strict=True):
        m.forward = later(name, m)

    def undo() -> None:
        for m in linears:
            vars(m).pop("forward", None)

    return undo


def fuse_projections(model: nn.Module) -> Callable[[], None]:
    """Fuse every group of GROUPS found in `model`'s modules; returns `undo` (the weights stay
    views into the concatenated ones: the same values)."""
    undos = []
    for module in list(model.modules()):
        for names in GROUPS:
            linears = _group(module, names)
            if linears is not None:
                undos.append(_install(linears, names))

    def undo() -> None:
        for u in undos:
            u()

    return undo
