"""One matmul for the projections of a decoder layer that read the same input.

A Qwen3 or Llama layer projects its normed input three times for attention (q, k, v) and twice
for its MLP (gate, up). `fuse_projections` concatenates each group's weights once and puts
`_Part` modules in the projections' places: the first part called with an input computes the
whole product and splits it, the others take their slice of it, so the model's own forward runs
unchanged and one GEMM of the summed width replaces several narrower ones (k and v are a quarter
of q's width on GQA targets, too narrow to fill an H200). Under torch.compile the memo is traced
away: the graph holds one matmul per group. While fused, the concatenated weight is the only
copy (the projections' own are dropped); undoing gives each projection its weight back as a
Parameter of its own, with its `requires_grad`, outside inference mode.

Only plain `nn.Linear` projections without hooks are fused: a subclass (LoRA, a quantized
linear) or a hook (accelerate's included) would be bypassed by the fused product.
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
        # Forgotten once every part has been taken, as the layers GROUPS names take them all in
        # each forward; a forward stopped half-way keeps one product until the next.
        self.memo = None if len(memo[2]) == len(self.sizes) else memo
        return memo[1][i]

    def slice(self, i: int, of: torch.Tensor | None) -> torch.Tensor | None:
        """Part i's rows of the concatenated weight or bias `of`."""
        if of is None:
            return None
        lo = sum(self.sizes[:i])
        return of[lo : lo + self.sizes[i]]


class _Part(nn.Module):
    """Projection i of a fused group, in the place of the nn.Linear it stands for."""

    def __init__(self, fused: _Fused, i: int, original: nn.Linear):
        super().__init__()
        self.fused, self.i = fused, i
        self.in_features, self.out_features = original.in_features, original.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.fused.slice(self.i, self.fused.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.fused.slice(self.i, self.fused.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.i)


def _fusable(linears: list) -> bool:
    """Plain nn.Linear of one input width, dtype and device, all with a bias or none, and none
    with hooks or a forward of its own."""
    if len(linears) < 2 or any(type(lin) is not nn.Linear for lin in linears):
        return False
    first = linears[0]
    return all(
        lin.in_features == first.in_features
        and lin.weight.dtype == first.weight.dtype
        and lin.weight.device == first.weight.device
        and (lin.bias is None) == (first.bias is None)
        and not (lin._forward_hooks or lin._forward_pre_hooks or "forward" in vars(lin))
        and not hasattr(lin, "_hf_hook")
        for lin in linears
    )


def fuse_projections(layer: nn.Module) -> list[Callable[[], None]]:
    """Fuse `layer`'s groups of projections in place (those it has, see GROUPS); the steps
    that undo it, one per group fused, in any order."""
    undo = []
    for owner_name, names in GROUPS:
        owner = getattr(layer, owner_name, None)
        linears = [getattr(owner, n, None) for n in names]
        if owner is None or not _fusable(linears):
            continue
        fused = _Fused(linears)
        grads = [(lin.weight.requires_grad, lin.bias is not None and lin.bias.requires_grad)
                 for lin in linears]  # fmt: skip
        for i, (name, lin) in enumerate(zip(names, linears, strict=True)):
            setattr(owner, name, _Part(fused, i, lin))
            lin.weight = lin.bias = None  # the concatenated weight is the one copy
        pairs = zip(linears, grads, strict=True)
        undo.append(_restore(owner, fused, dict(zip(names, pairs, strict=True))))
    return undo


def _restore(owner: nn.Module, fused: _Fused, linears: dict) -> Callable[[], None]:
    def restore() -> None:
        # outside inference mode: the layouts fuse inside it, and the model given back must
        # train, save and update in place as loaded
        with torch.inference_mode(False), torch.no_grad():
            for i, (name, (lin, (weight_grad, bias_grad))) in enumerate(linears.items()):
                lin.weight = nn.Parameter(fused.slice(i, fused.weight).clone(), weight_grad)
                if fused.bias is not None:
                    lin.bias = nn.Parameter(fused.slice(i, fused.bias).clone(), bias_grad)
                setattr(owner, name, lin)

    return restore
