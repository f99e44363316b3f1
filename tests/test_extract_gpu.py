"""GPU only: the extraction pipeline on CUDA (pinned input copies, capture, side-stream host
copies into pinned staging buffers, writer threads) stores the states of a plain forward, in
both stores."""

from __future__ import annotations

import pytest
import torch

from tests.test_extract import (  # noqa: F401  (data_file: a fixture)
    data_file,
    extract,
    reference_states,
    samples_by_row,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_cuda_extraction_stores_the_forward_states(tmp_path, tiny_qwen3, data_file, store):  # noqa: F811
    # Small batches and parts: several batches in flight between the device and the writers.
    m = extract(tmp_path / "cache", tiny_qwen3, data_file, gpus="0", batch_tokens=256, store=store)
    assert m.complete
    samples = samples_by_row(tmp_path / "cache")
    assert len(samples) == m.totals()["rows_kept"] > 10
    for row in list(samples)[:6]:
        s = samples[row]
        ref = reference_states(
            tiny_qwen3, s.input_ids, m.layer_ids, device="cuda", dtype=torch.bfloat16
        )
        got = s.hidden_tensor(torch.device("cpu")).float()
        assert got.shape == ref.shape
        if store == "bf16":  # rounding may differ between batch shapes
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        else:  # e4m3 with a scale per token and layer: 3 mantissa bits of each row's range
            bound = 0.0625 * ref.abs().amax(-1, keepdim=True) + 2e-2
            assert ((got - ref).abs() <= bound).all()


def test_a_layout_of_one_process_on_a_gpu_stores_what_a_plain_run_stores(
    tmp_path,
    tiny_qwen3,
    data_file,  # noqa: F811
):
    """`--parallel fsdp=1` on one GPU: the target on the GPU (transformers' DistributedConfig of
    sizes 1 places nothing), the forwards in step with a group of one, and the same states as a
    run without `--parallel` (rounding of bf16 aside)."""
    kw = dict(gpus="0", batch_tokens=256, max_rows=12)
    m = extract(tmp_path / "one-rank", tiny_qwen3, data_file, parallel="fsdp=1", **kw)
    plain = extract(tmp_path / "plain", tiny_qwen3, data_file, **kw)
    assert m.complete and plain.complete and m.config["parallel"] == "fsdp=1"
    a, b = samples_by_row(tmp_path / "one-rank"), samples_by_row(tmp_path / "plain")
    assert sorted(a) == sorted(b)
    for row in a:
        got, want = (x[row].hidden_tensor(torch.device("cpu")).float() for x in (a, b))
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_planes_split_on_cuda_equals_the_cpu_split():
    """The bf16 planes staged from the device (`shared.planes.split_planes` on CUDA) are the
    CPU's, bit for bit, on every bf16 pattern."""
    from shared.planes import split_planes

    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    cpu, cuda = split_planes(every), split_planes(every.cuda())
    assert torch.equal(cuda.exponent.cpu(), cpu.exponent)
    assert torch.equal(cuda.sign_mantissa.cpu(), cpu.sign_mantissa)
