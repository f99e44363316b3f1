"""float8 e4m3 with one float32 scale per vector: the `fp8` store's values, and the `int4`
store's massive-activation vectors (``shared/int4.py``)."""

from __future__ import annotations

import torch

# Largest finite float8 e4m3fn magnitude: scale = amax / FP8_MAX maps each row onto the full range.
FP8_MAX = 448.0


def quantize_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row float8 e4m3 quantisation over the last dim, on ``h``'s device.

    Returns ``(q, scale)``: q uint8 [..., H] holding e4m3 bits and scale float32 [...] with
    ``h ~= e4m3(q) * scale``. scale = amax / 448 so a row's largest value lands on e4m3's largest
    finite value; an all-zero row gets scale 1. A plain cast would clip massive activations.

    >>> q, s = quantize_fp8(torch.tensor([[3000.0, 1.0, -2.0]]))
    >>> dequantize_fp8(q, s, torch.float32)[0, 0].item()
    3000.0
    """
    h32 = h.detach().float()
    amax = h32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (h32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Inverse of quantize_fp8 on ``q``'s device: e4m3 bits [..., H] times scale [...]."""
    if q.dtype != torch.uint8:
        raise TypeError(f"expected uint8 e4m3 bits, got {q.dtype}")
    values = q.view(torch.float8_e4m3fn).float() * scale.float().unsqueeze(-1)
    return values.to(dtype)
