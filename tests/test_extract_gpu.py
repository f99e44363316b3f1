"""GPU only: the extraction pipeline on CUDA (pinned input copies, capture, side-stream host
copies into pinned staging buffers, writer threads) stores the states of a plain forward, in
both stores."""

from __future__ import annotations

import pytest
import torch

from tests.test_extract import data_file, extract, samples_by_row  # noqa: F401  (fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def reference_on_gpu(target, ids, layer_ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        ids_1L = torch.from_numpy(ids.astype("int64"))[None].cuda()
        hs = model(ids_1L, output_hidden_states=True).hidden_states
    return torch.stack([hs[i + 1][0] for i in layer_ids], dim=1).float().cpu()


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_cuda_extraction_stores_the_forward_states(tmp_path, tiny_qwen3, data_file, store):  # noqa: F811
    # Small batches and parts: several batches in flight between the device and the writers.
    m = extract(tmp_path / "cache", tiny_qwen3, data_file, gpus="0", batch_tokens=256, store=store)
    assert m.complete
    samples = samples_by_row(tmp_path / "cache")
    assert len(samples) == m.totals()["rows_kept"] > 10
    for row in list(samples)[:6]:
        s = samples[row]
        ref = reference_on_gpu(tiny_qwen3, s.input_ids, m.layer_ids)
        got = s.hidden_tensor(torch.device("cpu")).float()
        assert got.shape == ref.shape
        if store == "bf16":  # rounding may differ between batch shapes
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        else:  # e4m3 with a scale per token and layer: 3 mantissa bits of each row's range
            bound = 0.0625 * ref.abs().amax(-1, keepdim=True) + 2e-2
            assert ((got - ref).abs() <= bound).all()
