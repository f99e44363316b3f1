"""Where an extraction's time goes: the device's time inside the target's forwards, the time
between them, and the launching thread's time inside the forward calls.

Extraction is meant to run at the plain forward's speed. When it does not, these split the gap:
forwards slower than the plain ones (device work added beside them) show as more device seconds
a token; a device starved by its launching thread (other threads holding the GIL it needs for
every kernel launch, or a read-back) shows as seconds between forwards, with the host's
seconds inside the calls close to the wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn


@dataclass(frozen=True)
class ForwardTimes:
    """Seconds over the forwards since the clock was last taken."""

    forwards: int
    host_s: float  # the launching thread inside the forward calls
    device_s: float  # from each forward's first kernel to its last (CUDA events); 0 off CUDA
    first_device_s: float  # the first forward's share of device_s (one-time costs show there)
    span_s: float  # from the first forward's first kernel to the last one's last; 0 off CUDA
    # The device time between forwards, one gap at a time: how many exceed LONG_GAP_S and
    # their sum, and the LONGEST_GAPS longest as (seconds, index of the forward after the
    # gap, whether that forward began a part): a few long stalls of the launching thread, or
    # many short ones.
    long_gaps: int = 0
    long_gaps_s: float = 0.0
    longest_gaps: tuple[tuple[float, int, bool], ...] = ()

    @property
    def idle_s(self) -> float:
        """Device seconds between forwards (inside the span, outside every forward): idle time,
        plus what the launching stream runs between them (the next batch's input copy, the
        captured states' device-side payload: milliseconds a batch)."""
        return max(0.0, self.span_s - self.device_s)

    def describe(self) -> str:
        if self.span_s == 0:
            return f"{self.forwards} forwards, the launching thread {self.host_s:.1f} s inside them"
        return (
            f"{self.forwards} forwards on the device {self.device_s:.1f} s (the first "
            f"{self.first_device_s:.2f} s), {self.idle_s:.1f} s between them, the launching "
            f"thread {self.host_s:.1f} s inside them; {self.long_gaps} gaps over "
            f"{LONG_GAP_S * 1e3:.0f} ms ({self.long_gaps_s:.2f} s){self._longest()}"
        )

    def _longest(self) -> str:
        if not self.longest_gaps:
            return ""
        words = [
            f"{s * 1e3:.0f} ms before forward {i}{' (a part began)' if first else ''}"
            for s, i, first in self.longest_gaps
        ]
        return ", the longest " + ", ".join(words)


LONG_GAP_S = 0.01
LONGEST_GAPS = 3


def gap_summary(
    gaps_s: list[float], part_starts: set[int], *, top: int = LONGEST_GAPS
) -> tuple[int, float, tuple[tuple[float, int, bool], ...]]:
    """(gaps over LONG_GAP_S, their seconds, the `top` longest as (seconds, forward index,
    began a part)); gaps_s[i] is the device time before forward i + 1.

    >>> gap_summary([0.001, 0.2, 0.03], {2}, top=2)
    (2, 0.23, ((0.2, 2, True), (0.03, 3, False)))
    """
    long = [g for g in gaps_s if g > LONG_GAP_S]
    ranked = sorted(range(len(gaps_s)), key=lambda i: -gaps_s[i])[:top]
    longest = tuple((gaps_s[i], i + 1, i + 1 in part_starts) for i in ranked)
    return len(long), round(sum(long), 9), longest


class ForwardClock:
    """Times every forward call of `module` (hooks), host and device side. Two CUDA events per
    forward on the launching stream: nothing waits for them until `take()`."""

    def __init__(self, module: nn.Module) -> None:
        self.cuda = next(module.parameters()).is_cuda
        self._host_s, self._start, self._count, self._begun = 0.0, 0.0, 0, 0
        self._events: list[list] = []
        self._part_starts: set[int] = set()
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self._begin()),
            module.register_forward_hook(lambda *_: self._end()),
        ]

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark_part(self) -> None:
        """The next forward begins a part (the gaps before such forwards are named so)."""
        self._part_starts.add(self._begun)

    def _begin(self) -> None:
        self._begun += 1
        self._start = time.perf_counter()
        if self.cuda:
            self._events.append([self._event()])

    def _end(self) -> None:
        self._host_s += time.perf_counter() - self._start
        self._count += 1
        if self.cuda:
            self._events[-1].append(self._event())

    def take(self) -> ForwardTimes:
        """The times since the last take (synchronises the device), and starts anew."""
        pairs = [e for e in self._events if len(e) == 2]
        device_s = first_s = span_s = 0.0
        gaps: list[float] = []
        if pairs:
            pairs[-1][1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in pairs]
            device_s, first_s = sum(spans), spans[0]
            span_s = pairs[0][0].elapsed_time(pairs[-1][1]) / 1e3
            gaps = [a[1].elapsed_time(b[0]) / 1e3 for a, b in pairwise(pairs)]
        times = ForwardTimes(
            self._count, self._host_s, device_s, first_s, span_s,
            *gap_summary(gaps, self._part_starts),
        )  # fmt: skip
        self._host_s, self._count, self._begun, self._events = 0.0, 0, 0, []
        self._part_starts = set()
        return times

    def close(self) -> None:
        for h in self._handles:
            h.remove()
