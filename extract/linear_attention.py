"""Gated DeltaNet layers (Qwen3.5/3.6) on packed rows: the convolution and the recurrent state
restart at every sample.

`PackedGatedDeltaNet` takes the place of a layer's `linear_attn` module and computes what the
model's own module computes for each sample alone (projections, causal convolution, gated delta
rule, gated norm, output projection, from the module's own weights), with the segments of the
current packed row (`Segments`). Its two sequence kernels run outside torch.compile, as compiled
code must never trace through them: on a GPU with flash-linear-attention, its varlen Triton
kernels (`cu_seqlens`: one launch per row, whatever the samples); elsewhere a PyTorch reference,
the model module's own chunked delta rule per sample and a convolution that masks each tap at
sample starts. A module whose structure differs (another transformers version, Qwen3-Next's
fused projections) is not supported: `supports` says so and extraction keeps padded rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# What the module must hold for `PackedGatedDeltaNet` to reproduce its forward.
_REQUIRED = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "head_k_dim",
    "head_v_dim",
    "key_dim",
    "value_dim",
    "activation",
)


@dataclass
class Segments:
    """The current packed row's segment bounds: `cu_seqlens` on the device and on the host, and
    each token's position in its segment (the reference convolution's tap mask)."""

    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_cpu: torch.Tensor | None = None
    positions_N: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)


def supports(module: nn.Module) -> str | None:
    """None if `PackedGatedDeltaNet` can stand in for `module`, else why not."""
    missing = [a for a in _REQUIRED if not hasattr(module, a)]
    if missing:
        return f"{type(module).__name__} lacks {', '.join(missing)}"
    if getattr(module, "activation", None) not in ("silu", "swish"):
        return f"{type(module).__name__}'s convolution activation {module.activation!r}"
    if _torch_delta_rule(module) is None:
        return f"{type(module).__module__} has no torch_chunk_gated_delta_rule"
    return None


def fla_kernels() -> tuple | None:
    """(causal_conv1d, chunk_gated_delta_rule) of flash-linear-attention, or None."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return causal_conv1d, chunk_gated_delta_rule


def _torch_delta_rule(module: nn.Module):  # noqa: ANN202
    return getattr(sys.modules.get(type(module).__module__), "torch_chunk_gated_delta_rule", None)


class PackedGatedDeltaNet(nn.Module):
    """A Gated DeltaNet module's forward over the samples of a packed row [1, N, H]."""

    def __init__(self, inner: nn.Module, segments: Segments, *, use_fla: bool):
        super().__init__()
        self.inner, self.segments = inner, segments
        self.kernels = fla_kernels() if use_fla else None
        if use_fla and self.kernels is None:
            raise ValueError("flash-linear-attention is not installed")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.inner
        batch, n, _ = hidden_states.shape
        if batch != 1:
            raise ValueError(f"a packed row has batch 1, not {batch}")
        mixed = self._conv(m.in_proj_qkv(hidden_states))
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(1, n, -1, m.head_k_dim)
        k = k.reshape(1, n, -1, m.head_k_dim)
        v = v.reshape(1, n, -1, m.head_v_dim)
        z = m.in_proj_z(hidden_states).reshape(1, n, -1, m.head_v_dim)
        beta = m.in_proj_b(hidden_states).sigmoid()
        # float32 as the model computes it (A would overflow in half precision)
        g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(hidden_states).float() + m.dt_bias)
        core = self._delta_rule(q, k, v, g, beta)
        core = m.norm(core.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(core.reshape(1, n, -1))

    @torch.compiler.disable
    def _conv(self, x_BND: torch.Tensor) -> torch.Tensor:
        """Causal depthwise convolution + activation, restarting at every segment."""
        conv, s = self.inner.conv1d, self.segments
        weight_DW = conv.weight.squeeze(1)
        if self.kernels is not None:
            out, _ = self.kernels[0](
                x_BND,
                weight_DW,
                conv.bias,
                activation=self.inner.activation,
                cu_seqlens=s.cu_seqlens,
                cu_seqlens_cpu=s.cu_seqlens_cpu,
            )
            return out
        return segment_conv(x_BND, weight_DW, conv.bias, s.positions_N).to(x_BND.dtype)

    @torch.compiler.disable
    def _delta_rule(self, q, k, v, g, beta) -> torch.Tensor:  # noqa: ANN001
        s = self.segments
        if self.kernels is not None:
            out, _ = self.kernels[1](
                q,
                k,
                v,
                g=g,
                beta=beta,
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=s.cu_seqlens,
                cu_seqlens_cpu=s.cu_seqlens_cpu,
            )
            return out
        rule, parts, start = _torch_delta_rule(self.inner), [], 0
        for n in s.lengths:
            cut = slice(start, start + n)
            out, _ = rule(
                q[:, cut], k[:, cut], v[:, cut], g=g[:, cut], beta=beta[:, cut],
                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            parts.append(out)
            start += n
        return torch.cat(parts, dim=1)


def segment_conv(
    x_BND: torch.Tensor, weight_DW: torch.Tensor, bias_D: torch.Tensor | None, pos_N: torch.Tensor
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of [B, N, D] where tap j reaches back j tokens only where the
    token sits at least j into its segment (`pos_N`); float32 as the model's fallback computes.

    >>> x = torch.ones(1, 4, 1)
    >>> out = segment_conv(x, torch.ones(1, 2), None, torch.tensor([0, 1, 0, 1]))
    >>> torch.allclose(out.squeeze(), F.silu(torch.tensor([1.0, 2.0, 1.0, 2.0])))
    True
    """
    width = weight_DW.shape[-1]
    x = x_BND.to(weight_DW.dtype)
    out = x * weight_DW[:, width - 1]
    for j in range(1, width):
        tap = F.pad(x[:, :-j], (0, 0, j, 0)) * (pos_N >= j).to(x.dtype)[None, :, None]
        out = out + tap * weight_DW[:, width - 1 - j]
    if bias_D is not None:
        out = out + bias_D
    return F.silu(out)
