"""The DFlash drafter: a few Qwen3-style layers that attend to target hidden states.

Parameter names equal the export keys of the public DFlash checkpoints (DESIGN.md section 5), so
export is a plain state dict. The drafter owns no embedding and no lm_head: the training step
embeds block tokens with the target's frozen embedding and scores with the target's lm_head.

Shapes: B batch, S context length, K captured target layers, H hidden size, C = K*H,
N blocks per sequence, Q = N * block_size block tokens, T = S + Q keys, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from train.drafters.config import DrafterConfig
from train.drafters.mask import get_flex_attention


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale after casting back (same rounding as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32; "linear" scaling divides positions by `factor`."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if cfg.rope_scaling and cfg.rope_scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / float(cfg.rope_scaling["factor"])
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BnTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, None].to(x_BnTD.dtype), sin_BTD[:, None].to(x_BnTD.dtype)
    return x_BnTD * cos + rotate_half(x_BnTD) * sin


class DrafterAttention(nn.Module):
    """Queries from the block; keys/values from [context ; block]; q/k per-head RMSNorm."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        # flex_attention kernel_options (`train.drafters.mask.flex_kernel_options`), set per device
        # by `DFlashDrafter.use_flex_options`: a plain attribute, constant to torch.compile.
        self.flex_options: dict[str, int] | None = None
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(
        self,
        x_BQH: torch.Tensor,
        ctx_BSH: torch.Tensor,
        cos_BTD: torch.Tensor,
        sin_BTD: torch.Tensor,
        mask: Any,
        attention: str,
    ) -> torch.Tensor:
        b, q_len, _ = x_BQH.shape
        t_len = ctx_BSH.shape[1] + q_len
        q = self.q_norm(self.q_proj(x_BQH).view(b, q_len, self.num_heads, self.head_dim))
        k = torch.cat([self.k_proj(ctx_BSH), self.k_proj(x_BQH)], dim=1)
        v = torch.cat([self.v_proj(ctx_BSH), self.v_proj(x_BQH)], dim=1)
        k = self.k_norm(k.view(b, t_len, self.num_kv_heads, self.head_dim))
        q_BnQD = apply_rope(q.transpose(1, 2), cos_BTD[:, -q_len:], sin_BTD[:, -q_len:])
        k_BnTD = apply_rope(k.transpose(1, 2), cos_BTD, sin_BTD)
        v_BnTD = v.view(b, t_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out_BnQD = _attend(q_BnQD, k_BnTD, v_BnTD, mask, attention, self.flex_options)
        return self.o_proj(out_BnQD.transpose(1, 2).reshape(b, q_len, -1))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    attention: str,
    flex_options: dict[str, int] | None = None,
):
    scale = q.shape[-1] ** -0.5
    if attention == "flex":
        extra = {"kernel_options": flex_options} if flex_options else {}
        return get_flex_attention(compiled=q.is_cuda)(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **extra
        )
    if attention != "sdpa":
        raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
    # Repeat kv heads explicitly: sdpa's enable_gqa with a mask falls back to the math kernel.
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, x_BQH, ctx_BSH, cos_BTD, sin_BTD, mask, attention: str) -> torch.Tensor:
        attn = self.self_attn
        return self.run(x_BQH, lambda h: attn(h, ctx_BSH, cos_BTD, sin_BTD, mask, attention))

    def run(self, x_BQH: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]):
        """The layer with `attend(normed block stream)` as its attention (inference caches K/V).

        The context feature is not re-normalised per layer: only the block stream is.
        """
        x_BQH = x_BQH + attend(self.input_layernorm(x_BQH))
        return x_BQH + self.mlp(self.post_attention_layernorm(x_BQH))


class DFlashDrafter(nn.Module):
    """Single-device DFlash drafter; parameter names are the export keys."""

    layer_class: type[DrafterLayer] = DrafterLayer  # a variant's layers (train/drafters/dflash2.py)

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def use_flex_options(self, options: dict[str, int] | None) -> None:
        """flex_attention kernel_options for every layer (None: Inductor's own choice)."""
        for module in self.modules():
            if isinstance(module, DrafterAttention):
                module.flex_options = options

    def forward(
        self,
        context_BSC: torch.Tensor,
        block_emb_BQH: torch.Tensor,
        ctx_pos_BS: torch.Tensor,
        block_pos_BQ: torch.Tensor,
        masks: dict[str, Any],
        *,
        attention: str = "sdpa",
        checkpoint_layers: bool = False,
    ) -> torch.Tensor:
        """Hidden states [B, Q, H] of the block tokens after the final norm.

        `masks` maps each layer type to the mask object for `attention` (see
        train/drafters/mask.py). `checkpoint_layers` recomputes each layer in backward
        (non-reentrant checkpointing).
        """
        ctx_BSH = self.hidden_norm(self.fc(_compute_dtype(context_BSC, self.fc.weight)))
        x_BQH = _compute_dtype(block_emb_BQH, self.fc.weight)
        pos_BT = torch.cat([ctx_pos_BS, block_pos_BQ], dim=1)
        freqs_BTd = pos_BT[..., None].float() * self.inv_freq.float()
        emb_BTD = torch.cat([freqs_BTd, freqs_BTd], dim=-1)
        cos_BTD, sin_BTD = emb_BTD.cos(), emb_BTD.sin()
        for layer in self.layers:
            args = (x_BQH, ctx_BSH, cos_BTD, sin_BTD, masks[layer.layer_type], attention)
            if checkpoint_layers and torch.is_grad_enabled():
                x_BQH = checkpoint(layer, *args, use_reentrant=False)
            else:
                x_BQH = layer(*args)
        return self.norm(x_BQH)

    def propose(
        self, hidden_NQH: torch.Tensor, lm_head_VH: torch.Tensor, first_N: torch.Tensor
    ) -> torch.Tensor:
        """Greedy draft ids [N, Q] from final hidden states of the slots to draft; `first_N` is
        the block's known first token (unused here; DFlash2's selector starts from it)."""
        return F.linear(hidden_NQH.to(lm_head_VH.dtype), lm_head_VH).argmax(dim=-1)


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Cast inputs to the weight dtype unless autocast is on (it casts inside each matmul)."""
    if torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(weight.dtype)


@torch.no_grad()
def init_drafter_weights(
    model: DFlashDrafter, seed: int, names: Collection[str] | None = None
) -> None:
    """Deterministic init: linear weights N(0, 0.02) (Qwen3's initializer_range), norms 1.

    Draws from a CPU generator in parameter-name order, so the result does not depend on the
    device or on how many processes run. `names` limits it to those parameters (a variant's
    DFlash parameters then get the same values as a DFlash drafter of the same seed).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if names is not None and name not in names:
            continue
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            draw = torch.empty(param.shape, dtype=torch.float32)
            draw.normal_(0.0, 0.02, generator=gen)
            param.copy_(draw)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
