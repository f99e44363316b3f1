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
            f"thread {self.host_s:.1f} s inside them"
        )


class ForwardClock:
    """Times every forward call of `module` (hooks), host and device side. Two CUDA events per
    forward on the launching stream: nothing waits for them until `take()`."""

    def __init__(self, module: nn.Module) -> None:
        self.cuda = next(module.parameters()).is_cuda
        self._host_s, self._start, self._count = 0.0, 0.0, 0
        self._events: list[list] = []
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self._begin()),
            module.register_forward_hook(lambda *_: self._end()),
        ]

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _begin(self) -> None:
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
        if pairs:
            pairs[-1][1].synchronize()
            spans = [a.elapsed_time(b) / 1e3 for a, b in pairs]
            device_s, first_s = sum(spans), spans[0]
            span_s = pairs[0][0].elapsed_time(pairs[-1][1]) / 1e3
        times = ForwardTimes(self._count, self._host_s, device_s, first_s, span_s)
        self._host_s, self._count, self._events = 0.0, 0, []
        return times

    def close(self) -> None:
        for h in self._handles:
            h.remove()
