"""Codec: bf16 views, fp8 e4m3 quantisation, checksums."""

from __future__ import annotations

import json

import crc32c
import numpy as np
import pytest
import torch

from shared.checksum import crc32c_file, crc32c_hex, part_checksum
from shared.codec import (
    BLOSC,
    FP8_MAX,
    bf16_to_u16,
    codec_description,
    dequantize_fp8,
    numcodecs_blosc,
    quantize_fp8,
    u16_to_bf16,
)

# e4m3 keeps 3 mantissa bits: round to nearest is within 2^-4 relative for normal numbers, and
# within half the smallest subnormal step (2^-9 / 2) times the scale near zero.
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL = 2.0**-10


def e4m3_bound(h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return h.abs() * E4M3_REL + scale.unsqueeze(-1) * E4M3_SUBNORMAL


def test_bf16_u16_views_share_memory_and_round_trip_exactly():
    t = torch.randn(4, 3, 8).to(torch.bfloat16)
    a = bf16_to_u16(t)
    assert a.dtype == np.uint16 and a.shape == (4, 3, 8)
    assert a.ctypes.data == t.data_ptr()  # a view, not a copy
    back = u16_to_bf16(a)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == a.ctypes.data
    assert torch.equal(back, t)
    with pytest.raises(TypeError):
        bf16_to_u16(t.float())


def test_fp8_keeps_a_massive_activation_where_a_plain_cast_does_not():
    h = torch.randn(6, 2, 64)
    h[2, 1, 5] = 3000.0
    h[4, 0, 0] = -2500.0
    cast = h[2, 1, 5].to(torch.float8_e4m3fn).float().item()  # clips (or is NaN): why we scale
    assert not abs(cast - 3000.0) <= 3000.0 * E4M3_REL
    q, scale = quantize_fp8(h.to(torch.bfloat16))
    assert q.dtype == torch.uint8 and q.shape == h.shape
    assert scale.dtype == torch.float32 and scale.shape == (6, 2)
    back = dequantize_fp8(q, scale, torch.float32)
    hb = h.to(torch.bfloat16).float()
    assert ((back - hb).abs() <= e4m3_bound(hb, scale)).all()
    assert abs(back[2, 1, 5].item() - 3000.0) <= 3000.0 * E4M3_REL
    # The row's largest magnitude lands on the largest finite e4m3 value.
    assert torch.allclose(scale, hb.abs().amax(-1) / FP8_MAX)


def test_fp8_zero_rows_get_scale_one_and_dtype_is_respected():
    h = torch.zeros(3, 2, 16)
    h[1, 1] = torch.linspace(-1, 1, 16)
    q, scale = quantize_fp8(h)
    assert scale[0, 0].item() == 1.0 and scale[2, 1].item() == 1.0
    back = dequantize_fp8(q, scale)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back[0], torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        dequantize_fp8(q.float(), scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_runs_on_the_gpu_like_on_the_cpu():
    h = torch.randn(32, 3, 256, dtype=torch.bfloat16) * 40
    q, scale = quantize_fp8(h.cuda())
    assert q.is_cuda and scale.is_cuda
    q_cpu, scale_cpu = quantize_fp8(h)
    assert torch.allclose(scale.cpu(), scale_cpu)
    back = dequantize_fp8(q, scale).cpu().float()
    assert ((back - h.float()).abs() <= e4m3_bound(h.float(), scale_cpu) + 1e-3).all()


def test_crc32c_matches_the_standard_check_value(tmp_path):
    # 0xE3069283 is CRC-32C's published check value for the ASCII string "123456789".
    assert crc32c_hex(b"123456789") == "crc32c:e3069283"
    path = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 100_000, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    assert crc32c_file(path) == f"crc32c:{crc32c.crc32c(data.tobytes()):08x}"
    assert crc32c_hex(data) == crc32c_file(path)


def test_part_checksum_of_a_folder_sees_content_names_and_files(tmp_path):
    def make(root):
        (root / "a" / "c").mkdir(parents=True)
        (root / "a" / "c" / "0").write_bytes(b"chunk0")
        (root / "zarr.json").write_text("{}")
        return root

    one, two = make(tmp_path / "one"), make(tmp_path / "two")
    base = part_checksum(one)
    assert base == part_checksum(two) and base.startswith("crc32c:")
    (two / "a" / "c" / "0").write_bytes(b"chunk1")
    assert part_checksum(two) != base
    (two / "a" / "c" / "0").write_bytes(b"chunk0")
    (two / "a" / "c" / "0").rename(two / "a" / "c" / "1")
    assert part_checksum(two) != base
    (two / "a" / "c" / "1").rename(two / "a" / "c" / "0")
    (two / "extra").write_bytes(b"")
    assert part_checksum(two) != base
    tar = tmp_path / "p.tar"
    tar.write_bytes(b"x" * 1000)
    assert part_checksum(tar) == crc32c_file(tar)


def test_codec_description_and_blosc_settings():
    bf16, fp8 = codec_description("bf16"), codec_description("fp8")
    assert bf16["compressor"]["id"] == "planes" and fp8["compressor"]["typesize"] == 1
    exponent = bf16["compressor"]["planes"]["exponent"]
    assert exponent["id"] == "zstd" and exponent["strategy"] == "fast"
    assert bf16["compressor"]["planes"]["sign_mantissa"]["cname"] == "lz4"
    assert BLOSC["cname"] == "zstd"
    assert fp8["compressor"]["cname"] == "zstd"
    assert fp8["scale"] and bf16["scale"] is None
    assert json.loads(json.dumps(bf16)) == bf16
    with pytest.raises(ValueError):
        codec_description("fp16")
    a = torch.randn(256, 64).to(torch.bfloat16).view(torch.uint16).numpy()
    blob = numcodecs_blosc(2).encode(a)
    out = np.empty_like(a)
    numcodecs_blosc(2).decode(blob, out=out)
    assert np.array_equal(out, a)


def test_crc32c_combine_equals_the_crc_of_the_concatenation():
    import random

    import crc32c

    from shared.checksum import crc32c_combine

    rnd = random.Random(0)
    for len_b in [0, 1, 7, 255, 256, 4097, 1 << 16, *(rnd.randint(0, 300_000) for _ in range(20))]:
        a, b = rnd.randbytes(rnd.randint(0, 40)), rnd.randbytes(len_b)
        assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_tree_file_sizes_lists_every_file_with_its_size(tmp_path):
    from shared.checksum import tree_file_sizes

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x").write_bytes(b"12345")
    (tmp_path / "y").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    assert tree_file_sizes(tmp_path) == {"a/b/x": 5, "y": 0}


@pytest.mark.parametrize("typesize", [1, 2])
def test_blosc_compressor_gives_the_bytes_of_the_numcodecs_codec(typesize):
    from shared.codec import blosc_compressor

    rng = np.random.default_rng(typesize)
    a = rng.integers(0, 1 << (8 * typesize), (64, 300)).astype(f"u{typesize}")
    assert blosc_compressor(typesize)(a) == numcodecs_blosc(typesize).encode(a)
