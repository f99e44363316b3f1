"""extract.forward_clock: every forward counted and timed, figures reset by take()."""

import pytest
import torch
from torch import nn

from extract.forward_clock import ForwardClock


def test_counts_forwards_and_resets_on_take():
    model = nn.Linear(8, 8)
    clock = ForwardClock(model)
    for _ in range(3):
        model(torch.randn(4, 8))
    times = clock.take()
    assert times.forwards == 3 and times.host_s > 0
    assert times.device_s == times.span_s == times.idle_s == 0  # no device clock on the CPU
    assert "3 forwards" in times.describe()
    model(torch.randn(4, 8))
    assert clock.take().forwards == 1
    clock.close()
    model(torch.randn(4, 8))
    assert clock.take().forwards == 0  # hooks removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_seconds_and_idle_between_forwards():
    model = nn.Linear(2048, 2048).cuda()
    x = torch.randn(4096, 2048, device="cuda")
    clock = ForwardClock(model)
    model(x)
    torch.cuda._sleep(50_000_000)  # device busy outside any forward: idle for the clock
    model(x)
    times = clock.take()
    assert times.forwards == 2 and times.device_s > 0
    assert times.first_device_s < times.device_s
    assert times.span_s >= times.device_s and times.idle_s > 0.001
    assert "s between them" in times.describe()
