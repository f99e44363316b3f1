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
    clock.mark_part()
    model(x)
    times = clock.take()
    assert times.forwards == 2 and times.device_s > 0
    assert times.first_device_s < times.device_s
    assert times.span_s >= times.device_s and times.idle_s > 0.001
    assert "s between them" in times.describe()
    assert times.long_gaps == 1 and times.long_gaps_s > 0.001
    assert times.longest_gaps[0][1:] == (1, True)
    assert "ms before forward 1 (a part began)" in times.describe()


def test_gap_summary_counts_long_gaps_and_names_part_starts():
    from extract.forward_clock import LONG_GAP_S, gap_summary

    gaps = [0.002, 0.25, LONG_GAP_S, 0.04, 0.011]  # before forwards 1..5
    count, seconds, longest = gap_summary(gaps, {2, 5}, top=3)
    assert count == 3 and seconds == pytest.approx(0.25 + 0.04 + 0.011)  # LONG_GAP_S itself not
    assert longest == ((0.25, 2, True), (0.04, 4, False), (0.011, 5, True))
    assert gap_summary([], set()) == (0, 0.0, ())
