"""Token ids reach the device through `extract.capture.DeviceInputs`."""

from __future__ import annotations

import pytest
import torch

from extract.capture import INPUT_SLOTS, DeviceInputs


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [B, L], index [N]) pairs of growing sizes and distinct values."""
    out = []
    for k in range(count):
        rows, width = 1 + k % 3, 100 + 4000 * k  # above 64 KiB from the second batch on
        ids = torch.arange(rows * width, dtype=torch.long).view(rows, width) + 1_000_000 * k
        out.append((ids, torch.arange(rows * width - k, dtype=torch.long) * 7 + k))
    return out


def test_cpu_inputs_are_the_tensors_themselves():
    inputs = DeviceInputs(torch.device("cpu"))
    for ids, index in batches(3):
        got_ids, got_index = inputs.send(ids, index)
        assert torch.equal(got_ids, ids) and torch.equal(got_index, index)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_buffers_are_not_refilled_before_their_copy_lands():
    device = torch.device("cuda")
    inputs = DeviceInputs(device)
    sent = batches(3 * INPUT_SLOTS)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued ahead of every copy
    got = [inputs.send(ids, index) for ids, index in sent]
    torch.cuda.synchronize()
    for (ids, index), (got_ids, got_index) in zip(sent, got, strict=True):
        assert got_ids.device.type == "cuda" and got_ids.shape == ids.shape
        assert torch.equal(got_ids.cpu(), ids) and torch.equal(got_index.cpu(), index)
