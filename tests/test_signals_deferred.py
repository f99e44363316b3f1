"""Work that must not be cut off half way runs to its end through Ctrl-C and SIGTERM
(`shared.stopping.signals_deferred`): vLLM's shutdown in `extract.regen --engine vllm`."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from extract.regen.engine import shut_down_after
from shared.stopping import Terminated, sigterm_raises


class _EngineCore:
    """vLLM's engine core client, as far as its shutdown: one that gets SIGTERM and Ctrl-C
    while it shuts down."""

    def __init__(self) -> None:
        self.down = False

    def shutdown(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecodes at which Python runs the signals' handlers
            pass
        self.down = True


def test_signals_during_vllms_shutdown_are_raised_once_it_is_down():
    engine = SimpleNamespace(engine_core=_EngineCore())
    ctrl_c = signal.getsignal(signal.SIGINT)  # ignored where a background shell started the tests
    with pytest.raises(Terminated), sigterm_raises():
        with shut_down_after(engine):
            pass
    assert engine.engine_core.down
    assert signal.getsignal(signal.SIGINT) is ctrl_c
