"""The int4 store's code on literal tensors: what is exact, what is bounded, which vectors go
to fp8, the records' bytes on disk, and the scheme's validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from shared.fp8 import FP8_MAX
from shared.int4 import (
    SCALE_STEPS,
    Int4Scheme,
    decode_int4,
    encode_int4,
    quantize_groups_NGC,
    scale_of,
)
from shared.int4_frames import int4_frames, int4_unframe
from shared.int4_rotation import hadamard_GG, rotate_NH, rotation_signs_H, unrotate_NH

H = 128
SCHEME = Int4Scheme(hidden=H)


def is_fp8(records: torch.Tensor) -> torch.Tensor:
    """Which records are fp8: their last 4 bytes (a float32 scale) are not zero."""
    return records[..., -4:].ne(0).any(-1)


def round_trip(x: torch.Tensor, scheme: Int4Scheme = SCHEME) -> tuple[torch.Tensor, torch.Tensor]:
    records = encode_int4(x, scheme)
    return records, decode_int4(records, scheme, torch.float32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def test_the_rotation_is_orthogonal_and_undone():
    x = torch.randn(5, H, dtype=torch.float64)
    signs, m = rotation_signs_H(H, 3).double(), hadamard_GG(64).double()
    assert torch.allclose(m @ m, torch.eye(64, dtype=torch.float64))
    y = rotate_NH(x, signs, m)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))
    assert torch.allclose(unrotate_NH(y, signs, m), x)
    # Another seed, other signs: the seed is part of what a cache records.
    assert not torch.equal(rotation_signs_H(H, 3), rotation_signs_H(H, 4))


def test_ordinary_vectors_keep_their_top_values_exactly_and_the_rest_within_the_code():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, H, generator=g) * 3).to(torch.bfloat16).float()
    x[:, 7] = 60.0  # an outlier channel, as real targets have
    records, back = round_trip(x)
    assert not is_fp8(records).any()
    top = x.abs().topk(SCHEME.topk, dim=-1).indices
    assert torch.equal(back.gather(-1, top), x.gather(-1, top))
    # The rest: 16 levels on the rotated values, so at most half a step of the scale that
    # covers each group's max (one grid step above it) per value.
    rest = x.scatter(-1, top, 0.0)
    y = rotate_NH(rest, rotation_signs_H(H, 0), hadamard_GG(64)).view(64, -1, 64)
    step = y.abs().amax(-1) / 7.5 * 2 ** (1 / SCALE_STEPS)
    bound = (64 * (step / 2) ** 2).sum(-1).sqrt()
    assert ((back - x).norm(dim=-1) <= bound * 1.0001).all()
    assert relative_error(back, x).mean() < 0.1


def test_a_massive_activation_is_stored_in_fp8():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, H, generator=g)
    x[0, 5] = 25000.0  # the first token of a sequence, at a later layer
    x[1, [5, 9]] = torch.tensor([-24000.0, 12000.0])
    records, back = round_trip(x.to(torch.bfloat16))
    assert is_fp8(records).tolist() == [True, True, False]
    want = x.to(torch.bfloat16).float()
    # e4m3 keeps 3 mantissa bits (2^-4 relative) and its subnormals a step of 2^-9 * scale.
    scale = want.abs().amax(-1, keepdim=True) / FP8_MAX
    assert ((back - want).abs()[:2] <= want.abs()[:2] * 2**-4 + scale[:2] * 2**-10).all()


def test_the_massive_criterion_at_its_boundary():
    """fp8 exactly when the top-k values hold at least `massive_energy` of the energy."""
    rest = torch.ones(H - SCHEME.topk)  # energy H - topk outside the top values

    def vector(fraction: float) -> torch.Tensor:
        # top-k equal values v with topk * v^2 = fraction * total energy
        v = (fraction * len(rest) / (1 - fraction) / SCHEME.topk) ** 0.5
        return torch.cat([torch.full((SCHEME.topk,), v), rest])

    below, above = vector(SCHEME.massive_energy - 1e-3), vector(SCHEME.massive_energy + 1e-3)
    records = encode_int4(torch.stack([below, above]), SCHEME)
    assert is_fp8(records).tolist() == [False, True]


def test_what_the_code_gets_wrong_goes_to_fp8():
    """The worst case of the code: a vector that the rotation makes one spike in a group (so its
    other 63 values fall under a step of the spike's 1/7.5). Its values are all of a size (its
    top 2 hold about 2/64 of its energy: not massive), and the code errs by about half of it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, H, generator=g) * 0.01
    y = torch.randn(1, H, generator=g)
    y[0, 0] = 100.0
    x[:1] = unrotate_NH(y, rotation_signs_H(H, 0), hadamard_GG(64)).to(torch.bfloat16)
    records, back = round_trip(x)
    assert is_fp8(records).tolist() == [True, False]
    assert relative_error(back[:1], x[:1]) < 0.05
    plain = dataclasses.replace(SCHEME, fp8_above=1e9)  # the same without the fallback
    assert relative_error(round_trip(x[:1], plain)[1], x[:1]) > SCHEME.fp8_above


def test_the_fp8_fallback_follows_the_decoded_error_at_its_threshold():
    """The encoder judges a vector's code by its error as decoded, off the exact values'
    positions (where decoding puts the exact value back), without decoding it: with the
    threshold at the median error of 400 vectors, each goes to fp8 exactly when its decoded
    int4 code errs by more (the rotated code's own error, which also counts the exact
    positions, would send more)."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(400, H, generator=g) * torch.rand(400, 1, generator=g)).to(torch.bfloat16)
    x = x.float()
    plain = dataclasses.replace(SCHEME, fp8_above=1e9)
    err = relative_error(round_trip(x, plain)[1], x)
    threshold = float(err.median())
    records = encode_int4(x, dataclasses.replace(SCHEME, fp8_above=threshold))
    clear = (err / threshold - 1).abs() > 1e-5  # not within rounding of the threshold
    assert clear.sum() > 390
    assert torch.equal(is_fp8(records)[clear], (err > threshold)[clear])
    assert 150 < int(is_fp8(records).sum()) < 250


def test_all_zero_tokens_and_groups_decode_to_exact_zeros():
    x = torch.zeros(3, H)
    x[1, 70:] = torch.linspace(-2, 2, H - 70)  # its first group all zero
    records, back = round_trip(x)
    assert not is_fp8(records).any()
    assert torch.equal(back[0], torch.zeros(H)) and torch.equal(back[2], torch.zeros(H))
    assert torch.equal(back[1, :64], torch.zeros(64))
    assert records[0].sum() == 0  # all-zero records: nothing to store


def test_scales_are_bytes_on_a_grid_and_values_beyond_it_go_to_fp8():
    b = torch.arange(1, 256, dtype=torch.uint8)
    ratios = scale_of(b)[1:] / scale_of(b)[:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, 2 ** (1 / SCALE_STEPS)))
    q, sb, err = quantize_groups_NGC(torch.tensor([[[-3.0, 0.0, 1.0, 3.0]]]), 2)
    assert (q >= -8).all() and (q <= 7).all() and 7.5 * scale_of(sb) >= 3.0 * 2**-0.125
    # Tiny and huge values: beyond the grid the code errs, and the vector goes to fp8.
    x = torch.randn(2, H)
    x[0] *= 1e-7
    x[1] *= 1e6
    records, back = round_trip(x)
    assert is_fp8(records).all()
    assert (relative_error(back, x) < 0.05).all()


def test_decoding_gives_the_dtype_and_shape_asked_and_refuses_other_records():
    x = torch.randn(2, 3, H).to(torch.bfloat16)
    records = encode_int4(x, SCHEME)
    assert records.shape == (2, 3, SCHEME.width) and records.dtype == torch.uint8
    assert decode_int4(records, SCHEME).dtype == torch.bfloat16
    assert decode_int4(records, SCHEME).shape == x.shape
    with pytest.raises(ValueError, match="records"):
        decode_int4(records[..., :-1], SCHEME)
    with pytest.raises(ValueError, match="hidden"):
        encode_int4(torch.randn(2, 64), SCHEME)


def test_long_inputs_are_coded_in_steps_alike(monkeypatch):
    import shared.int4 as int4

    x = torch.randn(50, H)
    whole = encode_int4(x, SCHEME)
    monkeypatch.setattr(int4, "STEP_ELEMENTS", 7 * H)  # steps of 7 rows: one row in the last
    assert torch.equal(encode_int4(x, SCHEME), whole)
    assert torch.equal(decode_int4(whole, SCHEME), decode_int4(whole[:, None], SCHEME)[:, 0])


def test_frames_round_trip_and_refuse_a_wrong_width():
    x = torch.randn(64, H)
    x[0, 3] = 3e4  # one fp8 record among them
    records = encode_int4(x, SCHEME).numpy()
    pieces = int4_frames(records, SCHEME.int4_bytes)
    blob = b"".join(pieces)
    assert np.array_equal(int4_unframe(blob, SCHEME.width), records)
    out = np.zeros((70, SCHEME.width), np.uint8)
    int4_unframe(blob, SCHEME.width, out=out)
    assert np.array_equal(out[:64], records) and not out[64:].any()
    assert len(blob) < records.size * 0.6  # the zeros of the int4 records cost nearly nothing
    with pytest.raises(ValueError, match="int4 frames"):
        int4_unframe(blob, SCHEME.width + 1)


def test_the_scheme_validates_and_round_trips_through_its_record():
    s = Int4Scheme(hidden=576)
    assert Int4Scheme.from_dict(s.to_dict()) == s
    assert s.to_dict()["layout"].startswith("per vector uint8 [H + 4]")
    with pytest.raises(ValueError, match="--store int4 needs a hidden size"):
        Int4Scheme(hidden=100)
    with pytest.raises(ValueError, match="power of two"):
        Int4Scheme(hidden=576, group=48)
    with pytest.raises(ValueError, match="topk"):
        Int4Scheme(hidden=64, topk=16)


def assert_errs_alike(
    a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, scheme: Int4Scheme
) -> None:
    """Records `a` and `b` of states `x` decode with the same mean relative error (1%)."""

    def error(r: torch.Tensor) -> float:
        back = decode_int4(r, scheme, torch.float32).reshape(-1, scheme.hidden)
        ref = x.float().reshape(-1, scheme.hidden)
        return ((back - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).mean().item()

    assert error(a) == pytest.approx(error(b), rel=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_codes_as_the_cpu_does():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(300, 4, 512, generator=g) * 5).to(torch.bfloat16)
    x[0, 2, 11] = 25000.0
    scheme = Int4Scheme(hidden=512)
    on_gpu = encode_int4(x.cuda(), scheme)
    on_cpu = encode_int4(x, scheme)
    # Rounding at a level's or a scale's edge may differ between the devices' float32 paths
    # (the GPU's is compiled: 99.8% of the bytes agreed on an H200): nearly all bytes agree,
    # the codes err alike, and each device decodes the other's records alike.
    assert (on_gpu.cpu() == on_cpu).float().mean() > 0.995
    assert_errs_alike(on_gpu.cpu(), on_cpu, x, scheme)
    a = decode_int4(on_gpu, scheme, torch.float32).cpu()
    b = decode_int4(on_gpu.cpu(), scheme, torch.float32)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_encoder_compiles_once_for_every_row_count():
    """The GPU encoder is compiled for one step of rows: a row count over a step and one under
    it (the last step padded) code as the CPU's eager encoder does, with no second graph."""
    from torch._dynamo.utils import counters

    from shared.int4 import STEP_ELEMENTS, prepare_encoder

    scheme = Int4Scheme(hidden=1024)
    step = STEP_ELEMENTS // scheme.hidden
    prepare_encoder(scheme.hidden, torch.device("cuda"))
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(3)
    for rows in (step + 100, 7):
        x = (torch.randn(rows, scheme.hidden, generator=g) * 3).to(torch.bfloat16)
        on_gpu, on_cpu = encode_int4(x.cuda(), scheme).cpu(), encode_int4(x, scheme)
        assert (on_gpu == on_cpu).float().mean() > 0.995
        assert_errs_alike(on_gpu, on_cpu, x, scheme)
    with torch.inference_mode():  # the states extraction captures are inference tensors
        states = x.cuda()
    encode_int4(states, scheme)
    with torch.no_grad():
        encode_int4(x.cuda(), scheme)
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_compiled_encoder_gets_one_kind_of_input_from_any_states():
    """Whatever the states (a row count over a step or under it, float32 or bf16, an inference
    tensor, under no_grad or inference_mode), the compiled encoder is called on one kind of
    input: one graph (Dynamo's own eager backend, so no compiler runs on the CPU)."""
    from torch._dynamo.utils import counters

    from shared.int4 import STEP_ELEMENTS, _encode_rows, encode_steps

    scheme = Int4Scheme(hidden=2048)
    step = STEP_ELEMENTS // scheme.hidden
    encode = torch.compile(_encode_rows, backend="eager", dynamic=False)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(step + 5, scheme.hidden, generator=g) * 3
    with torch.inference_mode():
        states = x.to(torch.bfloat16)
    before = counters["stats"]["unique_graphs"]
    first = encode_steps(x, scheme, encode)
    assert counters["stats"]["unique_graphs"] == before + 1
    assert not first.is_inference()  # the caller's records: writable outside inference_mode
    assert torch.equal(first, encode_steps(x, scheme, _encode_rows, fixed=False))
    assert torch.equal(encode_steps(states, scheme, encode), first)
    with torch.no_grad():
        assert torch.equal(encode_steps(x[:9].bfloat16(), scheme, encode), first[:9])
    with torch.inference_mode():
        assert torch.equal(encode_steps(states[-3:], scheme, encode), first[-3:])
    assert counters["stats"]["unique_graphs"] == before + 1
