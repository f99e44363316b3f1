"""The optimizer of a run: AdamW on every parameter, or Muon on the hidden matrices and AdamW on
the rest, as one optimizer object (one learning-rate schedule, one state in a checkpoint).

Muon (`torch.optim.Muon`) orthogonalises the momentum of a 2-D weight; it is meant for the weight
matrices of hidden layers only. Here those are the weights of the drafter's `nn.Linear` modules
(`fc`, the attention and MLP projections, DFlash2's kernel and hidden projections); norms, biases,
DFlash2's base kernels and its codebooks (lookup tables, like embeddings) stay with AdamW.

Its Newton-Schulz iterations cost more than the step's forward and backward at the 8B drafter
shape (README, "Recipe"). With several data-parallel ranks every rank holds the same averaged
gradients, so `ShardedMuon` has each matrix orthogonalised by one rank only (the matrices dealt
out by size, `balanced_owners`) and broadcast from it: the same update bit for bit as every rank
computing all of them, for 1 / world_size of the work per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

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


def balanced_owners(sizes: list[int], world_size: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the rank with the
    least work so far (ties to the lowest rank); the same on every rank.

    >>> balanced_owners([10, 40, 30, 20], 2)
    [0, 0, 1, 1]
    """
    load, owners = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(world_size), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


class ShardedMuon(torch.optim.Muon):
    """`torch.optim.Muon` whose Newton-Schulz work is split among the ranks of the default process
    group: every rank updates every momentum buffer (so a checkpoint's state is whole on rank 0),
    orthogonalises the matrices `balanced_owners` gives it, and takes the others from their
    owners (one broadcast each, all in flight together). Alone, it is `torch.optim.Muon`."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rank, world = dist.get_rank(), dist.get_world_size()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            lr, momentum = group["lr"], group["momentum"]
            owners = balanced_owners([p.numel() for p in params], world)
            updates, pending = [], []
            for grad, buf, owner in zip(grads, bufs, owners, strict=True):
                buf.lerp_(grad, 1 - momentum)
                if owner == rank:
                    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                    update = _zeropower_via_newtonschulz(
                        update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                    ).contiguous()
                else:  # the bf16 result Newton-Schulz gives, filled by its owner
                    update = torch.empty(grad.shape, dtype=torch.bfloat16, device=grad.device)
                pending.append(dist.broadcast(update, src=owner, async_op=True))
                updates.append(update)
            for work in pending:
                work.wait()
            for param, update in zip(params, updates, strict=True):
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


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
        self.muon = ShardedMuon(hidden, lr=muon_lr, weight_decay=weight_decay)
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
