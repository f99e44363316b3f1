"""The optimizer of a run: AdamW on every parameter, or Muon on the hidden matrices and AdamW on
the rest, as one optimizer object (one learning-rate schedule, one state in a checkpoint).

Muon (`torch.optim.Muon`) orthogonalises the momentum of a 2-D weight; it is meant for the weight
matrices of hidden layers only. Here those are the weights of the drafter's `nn.Linear` modules
(`fc`, the attention and MLP projections, DFlash2's kernel and hidden projections); norms, biases,
DFlash2's base kernels and its codebooks (lookup tables, like embeddings) stay with AdamW.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from train.config import TrainConfig
from train.options import OPTIMIZERS


def hidden_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the weights of the model's nn.Linear modules, every other trainable parameter)."""
    hidden = {
        id(m.weight): m.weight
        for m in model.modules()
        if isinstance(m, nn.Linear) and m.weight.requires_grad and m.weight.ndim == 2
    }
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden]
    return list(hidden.values()), rest


class MuonAdamW(torch.optim.Optimizer):
    """Muon on `hidden`, AdamW on `rest`: both optimizers' groups, in that order, are this one's
    `param_groups` (the same dicts), so a scheduler scales both peak rates by one factor."""

    def __init__(
        self,
        hidden: list[nn.Parameter],
        rest: list[nn.Parameter],
        *,
        lr: float,
        muon_lr: float,
        weight_decay: float,
        fused: bool = False,
    ) -> None:
        self.muon = torch.optim.Muon(hidden, lr=muon_lr, weight_decay=weight_decay)
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, fused=fused)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # Loading replaces the inner groups' dicts: share the new ones again.
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


def build_optimizer(
    model: nn.Module, cfg: TrainConfig, *, fused: bool = False
) -> torch.optim.Optimizer:
    """`cfg.optimizer` "adamw": AdamW on every parameter at `cfg.lr`; "muon": `MuonAdamW`, Muon at
    `cfg.muon_lr`. `fused`: AdamW's fused kernel (CUDA)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused
        )
    if cfg.optimizer == "muon":
        hidden, rest = hidden_matrices(model)
        return MuonAdamW(
            hidden, rest, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay, fused=fused
        )
    raise ValueError(f"optimizer: must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
