"""DFlash2: the DFlash drafter plus grouped dynamic causal convolutions and a candidate selector.

Both additions follow z-lab's reference `dflash.model` (`GroupedDynamicCausalConv`,
`CandidateSelector`); ../shared/DFLASH2.md describes them. The layers, attention, MLP, norms, masks
and RoPE are the DFlash drafter's (train/drafters/dflash.py); only the layer's order of operations
changes. Parameter names are the public export keys, codebooks without a `.weight` suffix.

Shapes as in train/drafters/dflash.py, plus k conv taps, G = H / g channel groups of g, r selector
rank, K selector candidates, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, DrafterLayer, init_drafter_weights

# Parameter-name markers of the DFlash2 additions (everything else is a DFlash parameter).
_ADDED = (".attention_conv.", ".mlp_conv.", "candidate_selector.")


def block_slots(q_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Slot index within its block of every block column [Q] (blocks lie side by side).

    >>> block_slots(6, 3, torch.device("cpu")).tolist()
    [0, 1, 2, 0, 1, 2]
    """
    return torch.arange(q_len, device=device) % block_size


def grouped_dynamic_conv(
    y_BQH: torch.Tensor,
    dynamic_BQkG: torch.Tensor,
    base_kH: torch.Tensor,
    *,
    group_size: int,
    slot_Q: torch.Tensor,
) -> torch.Tensor:
    """out_t[ch] = sum_{j<k} (base[j, ch] + dynamic_t[j, ch // g]) * y_{t-j}[ch].

    A tap t - j is zero where slot_Q[t] < j, so taps never reach into the previous block even
    when blocks lie side by side in one row.

    >>> y = torch.arange(1.0, 5.0).view(1, 4, 1)
    >>> base = torch.tensor([[1.0], [1.0]])
    >>> dyn = torch.zeros(1, 4, 2, 1)
    >>> grouped_dynamic_conv(y, dyn, base, group_size=1, slot_Q=torch.tensor([0, 1, 0, 1]))
    tensor([[[1.],
             [3.],
             [3.],
             [7.]]])
    """
    batch, q_len, hidden = y_BQH.shape
    groups = hidden // group_size
    y_BQGg = y_BQH.view(batch, q_len, groups, group_size)
    base_kGg = base_kH.to(y_BQH.dtype).view(-1, groups, group_size)
    dyn_BQkG1 = dynamic_BQkG.to(y_BQH.dtype)[..., None]
    out = y_BQGg * (base_kGg[0] + dyn_BQkG1[:, :, 0])
    for j in range(1, base_kH.shape[0]):
        tap_BQGg = F.pad(y_BQGg[:, :-j], (0, 0, 0, 0, j, 0))
        tap_BQGg = tap_BQGg * (slot_Q >= j).to(y_BQH.dtype).view(1, q_len, 1, 1)
        out = out + tap_BQGg * (base_kGg[j] + dyn_BQkG1[:, :, j])
    return out.view(batch, q_len, hidden)


class GroupedDynamicCausalConv(nn.Module):
    """base_kernel [2, k, H] (side 0 before the sublayer, side 1 after) and kernel_projection
    (H -> 2*k*G): the dynamic kernel of both sides comes from the sublayer's normed input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(
        self, n_BQH: torch.Tensor, slot_Q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer's input, the after-side dynamic kernel [B, Q, k, G])."""
        groups = n_BQH.shape[-1] // self.group_size
        dyn = self.kernel_projection(n_BQH).view(*n_BQH.shape[:-1], 2, self.kernel_size, groups)
        before = grouped_dynamic_conv(
            n_BQH, dyn[:, :, 0], self.base_kernel[0], group_size=self.group_size, slot_Q=slot_Q
        )
        return before, dyn[:, :, 1]

    def finish(
        self, y_BQH: torch.Tensor, dynamic_BQkG: torch.Tensor, slot_Q: torch.Tensor
    ) -> torch.Tensor:
        return grouped_dynamic_conv(
            y_BQH, dynamic_BQkG, self.base_kernel[1], group_size=self.group_size, slot_Q=slot_Q
        )


class DFlash2Layer(DrafterLayer):
    """A DFlash layer whose attention and MLP each sit between the two sides of a convolution."""

    def __init__(self, cfg: DrafterConfig, layer_type: str) -> None:
        super().__init__(cfg, layer_type)
        self.block_size = cfg.block_size
        sizes = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedDynamicCausalConv(*sizes)
        self.mlp_conv = GroupedDynamicCausalConv(*sizes)

    def run(self, x_BQH: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]):
        slot_Q = block_slots(x_BQH.shape[1], self.block_size, x_BQH.device)
        u, dyn = self.attention_conv.prepare(self.input_layernorm(x_BQH), slot_Q)
        x_BQH = x_BQH + self.attention_conv.finish(attend(u), dyn, slot_Q)
        u, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x_BQH), slot_Q)
        return x_BQH + self.mlp_conv.finish(self.mlp(u), dyn, slot_Q)


def transform_logits(logits: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor:
    """The target's own logit transform, when it has one: scale, then tanh softcap."""
    return scale_and_softcap(logits, cfg.output_multiplier, cfg.final_logit_softcapping)


def scale_and_softcap(
    logits: torch.Tensor, multiplier: float | None, softcap: float | None
) -> torch.Tensor:
    """softcap * tanh(multiplier * logits / softcap), each step only where given."""
    if multiplier is not None:
        logits = logits * multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class CandidateSelector(nn.Module):
    """Rescores the unary top-K with a rank-r bilinear term in (predecessor, hidden, candidate).

    s[j] = l[C[j]] + sum_r P[pred, r] * (W_hp h)[r] * S[C[j], r].
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.top_k = cfg.selector_top_k
        rank = cfg.selector_rank
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, rank))

    def scores(
        self,
        hidden_NH: torch.Tensor,
        unary_NK: torch.Tensor,
        candidates_NK: torch.Tensor,
        predecessor_N: torch.Tensor,
    ) -> torch.Tensor:
        """Selector scores [N, K] of the candidates, given each row's predecessor token."""
        z_Nr = self.hidden_projection(hidden_NH) * F.embedding(
            predecessor_N, self.predecessor_codebook
        ).to(hidden_NH.dtype)
        succ_NKr = F.embedding(candidates_NK, self.successor_codebook).to(z_Nr.dtype)
        return unary_NK + torch.einsum("nr,nkr->nk", z_Nr, succ_NKr)

    def walk(
        self, hidden_NQH: torch.Tensor, logits_NQV: torch.Tensor, first_N: torch.Tensor
    ) -> torch.Tensor:
        """Greedy selection left to right [N, Q]: each slot's predecessor is the token chosen at
        the slot before (the block's known first token for the first slot)."""
        unary_NQK, cand_NQK = torch.topk(logits_NQV, self.top_k, dim=-1)
        predecessor_N, path = first_N, []
        for slot in range(hidden_NQH.shape[1]):
            scores_NK = self.scores(
                hidden_NQH[:, slot], unary_NQK[:, slot], cand_NQK[:, slot], predecessor_N
            )
            predecessor_N = cand_NQK[:, slot].gather(1, scores_NK.argmax(-1, keepdim=True))[:, 0]
            path.append(predecessor_N)
        return torch.stack(path, dim=1)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash drafter with convolved layers and a candidate selector."""

    layer_class = DFlash2Layer

    def __init__(self, cfg: DrafterConfig) -> None:
        if cfg.drafter_type != "dflash2":
            raise ValueError(f"DFlash2Drafter needs drafter_type dflash2, got {cfg.drafter_type}")
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)

    def propose(
        self, hidden_NQH: torch.Tensor, lm_head_VH: torch.Tensor, first_N: torch.Tensor
    ) -> torch.Tensor:
        logits = F.linear(hidden_NQH.to(lm_head_VH.dtype), lm_head_VH)
        hidden = hidden_NQH.to(self.candidate_selector.hidden_projection.weight.dtype)
        return self.candidate_selector.walk(hidden, transform_logits(logits, self.cfg), first_N)


def is_added_parameter(name: str) -> bool:
    """Whether a parameter name belongs to a DFlash2 addition (not to the DFlash drafter)."""
    return any(marker in name or name.startswith(marker) for marker in _ADDED)


@torch.no_grad()
def init_dflash2_weights(model: DFlash2Drafter, seed: int) -> None:
    """DFlash parameters exactly as `init_drafter_weights` with the same seed; the additions as
    no-ops: base_kernel[:, 0] = 1, other taps 0, kernel_projection 0, successor_codebook 0;
    predecessor_codebook and hidden_projection N(0, 0.02) from their own generator. The drafter
    then computes exactly what the DFlash drafter computes."""
    names = [name for name, _ in model.named_parameters()]
    init_drafter_weights(model, seed, names=[n for n in names if not is_added_parameter(n)])
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    selector = model.candidate_selector
    selector.successor_codebook.zero_()
    gen = torch.Generator().manual_seed(seed + 1)
    for param in (selector.hidden_projection.weight, selector.predecessor_codebook):
        draw = torch.empty(param.shape, dtype=torch.float32)
        param.copy_(draw.normal_(0.0, 0.02, generator=gen))
