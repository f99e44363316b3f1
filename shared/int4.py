"""The `int4` store: a token's state at a layer in a 4-bit code, about a quarter of raw bf16.

Each vector x (H values, as bf16), on the extraction device (`encode_int4`):

1. its `topk` largest |values| are kept exactly (bf16 value and index) and set to 0 in x;
2. the rest is rotated group by group: `group` values times fixed random signs, then the
   normalised Walsh-Hadamard matrix (`rotate_NH`), which spreads a group's outliers over it;
3. each group is coded with 16 levels (q + 0.5) * s, q in -8..7, under one scale s, a power of
   2^(1/8) stored in a byte: of the `clips` powers from the smallest with 7.5 s >= the group's
   max |value| downwards, the one with the least squared error (a byte against bf16's two:
   0.4% of raw bf16 less on disk, the same error);
4. a massive-activation vector (its `topk` values hold at least `massive_energy` of its energy:
   on SmolLM2 a sequence's first token at its later layers, |h| ~ 25,000 in one channel) or one
   whose code errs by more than `fp8_above` (relative) is stored in fp8 (`shared.fp8`) instead.

The trainer decodes on its device (`decode_int4`): codes times scales, the rotation undone (the
matrix is its own inverse; the signs follow), the exact values put back, fp8 vectors taken
where they are. `bench/store_bench.py` measures the choices on SmolLM2's real states.

A vector's record (uint8 [W], W = H + 4, little-endian):
    int4: codes [H/2] (value i in byte i // 2, low nibble for even i, q + 8), scales uint8
          [H / group] (s = 2^((b - 128) / 8), 0 for b = 0), indices uint16 [topk] (ascending),
          values bf16 [topk], zeros, float32 0
    fp8:  e4m3 bits [H], float32 scale (> 0)
so a record says which it is by its last 4 bytes. On disk (`shared.int4_frames`), per 64 rows: a
zstd frame of the int4 bytes column by column (each byte position over the rows: codes, then
scales and indices, which repeat) and one of the rest row by row (zeros, and the few fp8
vectors).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared.fp8 import quantize_fp8
from shared.int4_rotation import rotate_NH, rotation_tables, unrotate_NH

INT4_LAYOUT = (
    "per vector uint8 [H + 4], little-endian: int4 = codes [H/2] (low nibble first, q + 8, value "
    "(q + 0.5) * s), scales uint8 [H/group] (s = 2^((b - 128)/8), b = 0: s = 0), top-k indices "
    "uint16 [topk] ascending, values bf16 [topk], zeros, float32 0; fp8 = e4m3 [H], float32 "
    "scale > 0; rotation: per group, signs (splitmix64 of seed, i), then Walsh-Hadamard / "
    "sqrt(group)"
)
# Scales are 2^((b - SCALE_ZERO) / SCALE_STEPS) for a byte b >= 1 (b = 0: an all-zero group):
# 2^-15.9 to 2^15.9 in steps of 9%. A group beyond that errs, and its vector goes to fp8.
SCALE_STEPS, SCALE_ZERO = 8, 128
# Rows encoded or decoded per step: bounds the float32 temporaries (a few of [rows, H]).
STEP_ELEMENTS = 1 << 24


@dataclass(frozen=True, kw_only=True)
class Int4Scheme:
    """The `int4` store's parameters, recorded in the manifest and in every part. Decoding needs
    `hidden`, `group`, `topk` and `seed`; `clips`, `massive_energy` and `fp8_above` are the
    encoder's choices.

    >>> s = Int4Scheme(hidden=576)
    >>> s.width, s.int4_bytes
    (580, 305)
    """

    hidden: int
    group: int = 64
    topk: int = 2
    seed: int = 0
    clips: int = 2
    massive_energy: float = 0.99
    fp8_above: float = 0.2

    def __post_init__(self) -> None:
        g, h = self.group, self.hidden
        if g < 2 or g & (g - 1):
            raise ValueError(f"int4 group must be a power of two, got {g}")
        if h % g or h >= 1 << 16:
            raise ValueError(
                f"--store int4 needs a hidden size that is a multiple of {g} and below 65536, "
                f"got {h}"
            )
        if not 0 <= self.topk < h or self.int4_bytes > h:
            raise ValueError(f"int4 topk {self.topk} does not fit a record of hidden {h}")
        if self.clips < 1:
            raise ValueError(f"int4 clips must be at least 1, got {self.clips}")

    @property
    def width(self) -> int:
        """Bytes of a record: an fp8 vector and its float32 scale."""
        return self.hidden + 4

    @property
    def int4_bytes(self) -> int:
        """Bytes of an int4 record before its zeros: codes, scales, top-k indices and values."""
        return self.hidden // 2 + self.hidden // self.group + 4 * self.topk

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layout": INT4_LAYOUT}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Int4Scheme:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _tables(scheme: Int4Scheme, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return rotation_tables(scheme.hidden, scheme.seed, scheme.group, device)


def quantize_groups_NGC(
    y_NGC: torch.Tensor, clips: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16-level codes of groups [N, G, C] (float32): (q in -8..7 as float [N, G, C], scale byte
    uint8 [N, G], squared error [N, G]). Of `clips` scales on the grid from the smallest with
    7.5 s >= the group's max |value| downwards, each group takes the one that errs least.

    >>> q, b, e = quantize_groups_NGC(torch.tensor([[[-3.0, 0.0, 1.0, 3.0]]]), 1)
    >>> q.tolist(), b.tolist(), scale_of(b).tolist()  # s = 2^(-10/8) = 0.42: 7.5 s >= 3
    ([[[-8.0, 0.0, 2.0, 7.0]]], [[118]], [[0.4204482138156891]])
    """
    amax = y_NGC.abs().amax(-1)
    top = torch.ceil(torch.log2(amax / 7.5) * SCALE_STEPS).clamp_(-SCALE_ZERO + 1, SCALE_ZERO - 1)
    best = None
    for j in range(clips):
        b = torch.where(amax > 0, (top - j + SCALE_ZERO).clamp_(min=1), 0.0).to(torch.uint8)
        s = scale_of(b).unsqueeze(-1)
        # an all-zero group: code 0 (q = -8), so that its bytes are zeros too
        q = torch.where(s > 0, torch.floor(y_NGC / torch.where(s > 0, s, 1.0)).clamp_(-8, 7), -8)
        err = ((q + 0.5) * s - y_NGC).square_().sum(-1)
        if best is None:
            best = (q, b, err)
            continue
        better = err < best[2]
        best = (
            torch.where(better.unsqueeze(-1), q, best[0]),
            torch.where(better, b, best[1]),
            torch.minimum(err, best[2]),
        )
    return best


def scale_of(b: torch.Tensor) -> torch.Tensor:
    """float32 scales of scale bytes (0 for b = 0).

    >>> scale_of(torch.tensor([0, 128, 136, 120], dtype=torch.uint8)).tolist()
    [0.0, 1.0, 2.0, 0.5]
    """
    s = torch.exp2((b.float() - SCALE_ZERO) / SCALE_STEPS)
    return torch.where(b > 0, s, 0.0)


def _le_bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, n] of a 2- or 4-byte dtype -> uint8 [N, n * size], little-endian (as stored). By
    shifts of a same-size integer view, which Inductor compiles (a view to uint8 it cannot).

    >>> _le_bytes(torch.tensor([[1.0]], dtype=torch.bfloat16)).tolist()  # bf16 1.0 = 0x3F80
    [[128, 63]]
    """
    size = t.element_size()
    bits = t.view(torch.int16 if size == 2 else torch.int32).to(torch.int32)
    shifted = [(bits >> (8 * i)) & 0xFF for i in range(size)]
    return torch.stack(shifted, -1).flatten(-2).to(torch.uint8)


def _from_le_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, n * size] (little-endian) -> [N, n] of a 2- or 4-byte dtype. A copy: a slice
    of records need not start at a multiple of the size, which a view needs."""
    return b.clone().view(dtype)


def largest_k(a_NH: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [N, k] of the k largest of each row of a (values >= 0), by k passes of argmax
    (the first of equals), each over `a` with the ones taken masked (never a scattered copy:
    compiled, each pass is one reduction over `a`): for the few values a record keeps, a
    radix-select topk cost the compiled encoder a third of its time on a GPU.

    >>> largest_k(torch.tensor([[0.0, 3.0, 1.0, 3.0]]), 2).tolist()
    [[1, 3]]
    """
    taken = []
    iota_1H = torch.arange(a_NH.shape[-1], device=a_NH.device)[None]
    for _ in range(k):
        masked_NH = a_NH if not taken else torch.where(_among(iota_1H, taken), -1.0, a_NH)
        taken.append(masked_NH.argmax(-1, keepdim=True))
    return torch.cat(taken, -1) if taken else a_NH.new_zeros(a_NH.shape[0], 0, dtype=torch.long)


def _among(iota_1H: torch.Tensor, columns: list[torch.Tensor]) -> torch.Tensor:
    """bool [N, H]: position h is one of the row's indices (`columns`, each [N, 1])."""
    hit = iota_1H == columns[0]
    for column in columns[1:]:
        hit = hit | (iota_1H == column)
    return hit


def _decoded_at(dq_NGC, idx_Nk, signs_H, hadamard):  # noqa: ANN001, ANN202
    """The decoded values [N, k] at positions idx of the rotated code dq [N, G, C]:
    `unrotate_NH` of each position's group alone (the matrix's row for its column: Sylvester's
    matrix is symmetric)."""
    g = hadamard.shape[0]
    group_NkC = dq_NGC.gather(1, (idx_Nk // g)[..., None].expand(-1, -1, g))
    return (group_NkC * hadamard[idx_Nk % g]).sum(-1) * signs_H[idx_Nk]


def _encode_rows(x: torch.Tensor, scheme: Int4Scheme, signs, hadamard) -> torch.Tensor:  # noqa: ANN001
    """uint8 records [n, W] of bf16 rows [n, H]."""
    n, H, g = x.shape[0], scheme.hidden, scheme.group
    x = x.float()
    energy = x.square().sum(-1)
    idx = largest_k(x.abs(), scheme.topk).sort(dim=-1).values  # ascending: they repeat
    idx = torch.where(energy.unsqueeze(-1) > 0, idx, 0)  # all-zero vectors: all-zero bytes
    vals = x.gather(-1, idx)
    iota_1H = torch.arange(H, device=x.device)[None]
    exact_NH = torch.zeros_like(x, dtype=torch.bool)
    if scheme.topk:
        exact_NH = _among(iota_1H, list(idx.split(1, dim=-1)))
    y = rotate_NH(torch.where(exact_NH, 0.0, x), signs, hadamard).view(n, H // g, g)
    q, s, err_NG = quantize_groups_NGC(y, scheme.clips)
    codes = (q.view(n, H) + 8).to(torch.uint8)
    record = torch.zeros(n, scheme.width, dtype=torch.uint8, device=x.device)
    parts = [
        codes[:, 0::2] | (codes[:, 1::2] << 4),
        s,
        torch.stack([idx & 0xFF, idx >> 8], -1).flatten(1).to(torch.uint8),
        _le_bytes(vals.to(torch.bfloat16)),
    ]
    record[:, : scheme.int4_bytes] = torch.cat(parts, 1)
    massive = vals.square().sum(-1) >= scheme.massive_energy * energy
    # The error as decoded, off the exact values' positions (there the exact value is put back):
    # the rotation keeps squared norms, so the code's error in the rotated domain less the
    # squared decoded values at those positions (where x, before its rotation, was set to 0),
    # without unrotating the vector.
    dq_NGC = (q + 0.5) * scale_of(s).unsqueeze(-1)
    err = err_NG.sum(-1) - _decoded_at(dq_NGC, idx, signs, hadamard).square().sum(-1)
    wrong = err > scheme.fp8_above**2 * energy
    use_fp8 = (massive | wrong) & (energy > 0)
    fq, fscale = quantize_fp8(x)
    fp8 = torch.cat([fq, _le_bytes(fscale.unsqueeze(-1))], 1)
    return torch.where(use_fp8.unsqueeze(-1), fp8, record)


def encode_int4(h: torch.Tensor, scheme: Int4Scheme, *, compiled: bool = True) -> torch.Tensor:
    """uint8 records [..., W] of states [..., H] (rounded to bf16 first: the reference is the
    bf16 cache), computed on h's device; on a GPU by the compiled encoder unless not `compiled`.

    >>> h = torch.zeros(2, 64); h[0] = torch.linspace(-1, 1, 64); h[1, 9] = 3e4
    >>> r = encode_int4(h, Int4Scheme(hidden=64))
    >>> r.shape, r[0, -4:].tolist(), r[1, -4:].tolist() != [0, 0, 0, 0]  # int4, then fp8
    (torch.Size([2, 68]), [0, 0, 0, 0], True)
    >>> back = decode_int4(r, Int4Scheme(hidden=64), torch.float32)
    >>> back[0, [0, 63]].tolist(), round(back[1, 9].item())  # exact top-k; fp8 of bf16(3e4)
    ([-1.0, 1.0], 29952)
    >>> round(((back[0] - h[0]).norm() / h[0].norm()).item(), 3)  # relative error
    0.091
    """
    if h.shape[-1] != scheme.hidden:
        raise ValueError(f"states of hidden {h.shape[-1]}, the scheme's is {scheme.hidden}")
    x = h.detach().reshape(-1, scheme.hidden)
    if h.is_cuda and compiled:
        out = encode_steps(x, scheme, _compiled_encoder())
    else:
        out = encode_steps(x, scheme, _encode_rows, fixed=False)
    return out.view(*h.shape[:-1], scheme.width)


def encode_steps(
    x: torch.Tensor, scheme: Int4Scheme, encode: Callable, *, fixed: bool = True
) -> torch.Tensor:
    """uint8 records [N, W] of states x [N, H], `encode` (`_encode_rows` or a compiled form of
    it) called on [STEP_ELEMENTS // H, H] bf16 rows at a time. `fixed`: every call gets one
    kind of input, whatever x is (a full step of a buffer made under inference_mode, the last
    step zero-filled), so a compiled `encode` makes one graph: torch.compile's guards tell
    inference tensors, grad modes and shapes apart, and a graph made again costs seconds."""
    step = max(1, STEP_ELEMENTS // scheme.hidden)
    out = torch.empty(x.shape[0], scheme.width, dtype=torch.uint8, device=x.device)  # ordinary
    signs, hadamard = _tables(scheme, x.device)
    with torch.inference_mode():
        buf = torch.empty(step, scheme.hidden, dtype=torch.bfloat16, device=x.device)
        for start in range(0, x.shape[0], step):
            rows = x[start : start + step]
            n = rows.shape[0]
            if fixed:
                buf[:n].copy_(rows)
                if n < step:
                    buf[n:].zero_()
                rows = buf
            out[start : start + n] = encode(rows.to(torch.bfloat16), scheme, signs, hadamard)[:n]
    return out


@functools.cache
def _compiled_encoder() -> Callable:
    """`_encode_rows` through torch.compile (on a GPU): its few dozen elementwise steps over
    float32 [rows, H] fused into a handful of kernels. Eager, they cost an 8B extraction 14% of
    its forwards' time (`bench/e2e_gpu.py --also-extract '--store int4'`); the rows of a step
    are one static shape, so one graph per hidden size."""
    return torch.compile(_encode_rows, dynamic=False)


def prepare_encoder(hidden: int, device: torch.device) -> float:
    """Compile the encoder for `hidden` on `device` before the first part (a GPU; nothing to do
    elsewhere): seconds spent."""
    if device.type != "cuda":
        return 0.0
    start = time.perf_counter()
    encode_int4(torch.zeros(1, hidden, device=device), Int4Scheme(hidden=hidden))
    torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _decode_rows(r: torch.Tensor, scheme: Int4Scheme, signs, hadamard) -> torch.Tensor:  # noqa: ANN001
    """float32 [n, H] of records [n, W]."""
    n, H, g, k = r.shape[0], scheme.hidden, scheme.group, scheme.topk
    a, b = H // 2, H // 2 + H // g
    codes = r[:, :a]
    q = torch.stack([codes & 0xF, codes >> 4], -1).view(n, H).float() - 7.5
    s = scale_of(r[:, a:b])
    x = unrotate_NH((q.view(n, H // g, g) * s.unsqueeze(-1)).view(n, H), signs, hadamard)
    idx = r[:, b : b + 2 * k].long().view(n, k, 2)
    idx = (idx[..., 0] | (idx[..., 1] << 8)).clamp_(max=H - 1)  # fp8 records: any bytes there
    vals = _from_le_bytes(r[:, b + 2 * k : b + 4 * k], torch.bfloat16).float()
    x.scatter_(-1, idx, vals)
    fscale = _from_le_bytes(r[:, H : H + 4], torch.float32)
    fp8 = r[:, :H].view(torch.float8_e4m3fn).float() * fscale
    return torch.where(fscale > 0, fp8, x)


def decode_int4(
    records: torch.Tensor, scheme: Int4Scheme, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """States [..., H] in `dtype` of uint8 records [..., W], on their device (`encode_int4`)."""
    if records.dtype != torch.uint8 or records.shape[-1] != scheme.width:
        raise ValueError(
            f"expected uint8 int4 records [..., {scheme.width}], got {records.dtype} "
            f"{tuple(records.shape)}"
        )
    r = records.reshape(-1, scheme.width)
    out = torch.empty(r.shape[0], scheme.hidden, dtype=dtype, device=records.device)
    signs, hadamard = _tables(scheme, records.device)
    step = max(1, STEP_ELEMENTS // scheme.hidden)
    for start in range(0, r.shape[0], step):
        out[start : start + step] = _decode_rows(r[start : start + step], scheme, signs, hadamard)
    return out.view(*records.shape[:-1], scheme.hidden)
