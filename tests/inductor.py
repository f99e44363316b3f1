"""Whether torch.compile works on this machine (Inductor's CPU backend needs a C++ compiler)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def compile_problem() -> str | None:
    """None where a tiny torch.compile runs, else why not (a skip reason)."""
    try:
        torch.compile(lambda t: t.exp().sum(), dynamic=False, fullgraph=True)(torch.ones(3))
    except Exception as err:  # any failure means no working Inductor backend here
        return f"torch.compile does not work here: {type(err).__name__}: {err}"[:300]
    return None
