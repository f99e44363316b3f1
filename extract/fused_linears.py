"""One matmul for the projections of a decoder layer that read the same input.

A Qwen3 or Llama layer projects its normed input three times for attention (q, k, v) and twice
for its MLP (gate, up). `fuse_projections` concatenates each group's weights once and puts
`_Part` modules in the projections' places: the first part called with an input computes the
whole product and splits it, the others take their slice of it, so the model's own forward runs
unchanged and one GEMM of the summed width replaces several narrower ones (k and v are a quarter
of q's width on GQA targets, too narrow to fill an H200). Under torch.compile the memo is traced
away: the graph holds one matmul per group. The original modules' weights become views of the
concatenated one (no second copy); `undo` puts them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (the submodule, its projections read from one input) of the layers this knows
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class _Fused(nn.Module):
    """The concatenated weight (and bias) of a group, and the product of the current input."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), False)
            biases = [lin.bias for lin in linears]
            self.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases), False)
        self.memo: tuple | None = None  # (input, its parts, the parts taken)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        memo = self.memo
        if memo is None or memo[0] is not x or i in memo[2]:
            memo = (x, F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1), set())
        memo[2].add(i)
        # forget the product once every part has been taken (nothing kept between forwards)
        self.memo = None if len(memo[2]) == len(self.sizes) else memo
        return memo[1][i]


class _Part(nn.Module):
    """Projection i of a fused group, in the place of the nn.Linear it stands for."""

    def __init__(self, fused: _Fused, i: int, original: nn.Linear):
        super().__init__()
        self.fused, self.i = fused, i
        self.in_features, self.out_features = original.in_features, original.out_features

    @property
    def weight(self) -> torch.Tensor:
        lo = sum(self.fused.sizes[: self.i])
        return self.fused.weight[lo : lo + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.i)


def _fusable(linears: list) -> bool:
    """Plain nn.Linear of one input width and dtype, all with a bias or none."""
    if len(linears) < 2 or any(type(lin) is not nn.Linear for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        and (lin.bias is None) == (first.bias is None)
        for lin in linears
    )


def fuse_projections(layer: nn.Module) -> list[Callable[[], None]]:
    """Fuse `layer`'s groups of projections in place (those it has, see GROUPS); the undo steps,
    in the order to run them."""
    undo = []
    for owner_name, names in GROUPS:
        owner = getattr(layer, owner_name, None)
        linears = [getattr(owner, n, None) for n in names]
        if owner is None or not _fusable(linears):
            continue
        fused = _Fused(linears)
        lo = 0
        for i, (name, lin) in enumerate(zip(names, linears, strict=True)):
            hi = lo + lin.out_features
            lin.weight = nn.Parameter(fused.weight[lo:hi], requires_grad=False)
            if lin.bias is not None:
                lin.bias = nn.Parameter(fused.bias[lo:hi], requires_grad=False)
            setattr(owner, name, _Part(fused, i, lin))
            lo = hi
        undo.append(_restore(owner, dict(zip(names, linears, strict=True))))
    return undo[::-1]


def _restore(owner: nn.Module, linears: dict[str, nn.Linear]) -> Callable[[], None]:
    def restore() -> None:
        for name, lin in linears.items():
            setattr(owner, name, lin)

    return restore
