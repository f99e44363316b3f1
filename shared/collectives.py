"""Collectives that are no-ops in a single process, so stage code never branches on world
size (`shared.dist` re-exports them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist


class _Rank(Protocol):
    """What `main_first` reads of a `shared.dist.RankInfo`."""

    @property
    def is_main(self) -> bool: ...


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def main_first(info: _Rank) -> Iterator[None]:
    """Rank 0 runs the block before the others (e.g. to create a folder or a cache)."""
    if not info.is_main:
        barrier()
    yield
    if info.is_main:
        barrier()
