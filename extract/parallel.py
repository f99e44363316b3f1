"""Distributed layouts of the target (`--parallel`): which ranks share a model and which share
inputs, and the transformers `DistributedConfig` that loads it.

A layout is tensor parallel (`tp`: every rank of a group holds a slice of every weight and runs
the group's inputs), fully sharded (`fsdp`: every rank holds a slice, gathers each layer when it
runs it, and runs inputs of its own), expert parallel (`ep`: the experts of a MoE target split
over ranks) and data parallel across groups (`dp`: copies of the sharded model). Ranks are laid
out as transformers' device mesh lays them, (dp, fsdp, tp) with tp innermost, so the ranks of a
tp group are consecutive. Ranks that share inputs form an input group with one writer (its first
rank); every other rank has inputs and a writer of its own. Pipeline parallel is never used:
transformers' hooks there see the passed-through input of layers a rank does not own.
"""

from __future__ import annotations

import dataclasses
import math

KEYS = ("tp", "fsdp", "ep", "dp")


class LayoutError(ValueError):
    """A layout that cannot run here; the message says why and what would."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A resolved layout for `world` ranks. `shared`: how many consecutive ranks run the same
    inputs (tp, or ep where the installed transformers runs experts only on shared inputs).
    `single`: the key a one-process run named at size 1 (`--parallel fsdp=1` on one GPU): the
    sharded code path with one rank (the target loaded whole, as the engine would shard
    nothing; the probe and forwards in step), which shows what that path costs against a plain
    run."""

    tp: int = 1
    fsdp: int = 1
    ep: int = 1
    dp: int = 1
    shared: int = 1
    single: str = ""

    @property
    def world(self) -> int:
        return self.dp * self.fsdp * self.tp * (self.ep if self.legacy_ep else 1)

    @property
    def legacy_ep(self) -> bool:
        """Experts split over a group sharing inputs (transformers without `ep_size`)."""
        return self.ep > 1 and self.shared == self.ep and self.tp == 1

    @property
    def sharded(self) -> bool:
        """Whether the run takes the sharded path (transformers' distributed loading where it
        shards anything, forwards in step): a layout over several ranks, or one named at size 1
        on one process."""
        return self.tp * self.fsdp * self.ep > 1 or bool(self.single)

    @property
    def groups(self) -> int:
        """Input groups, each with its own units and one writer."""
        return self.world // self.shared

    def group(self, rank: int) -> tuple[int, bool]:
        """(input group of `rank`, whether it writes that group's parts).

        >>> Layout(tp=2, dp=2, shared=2).group(3), Layout(fsdp=2).group(1)
        ((1, False), (1, True))
        """
        return rank // self.shared, rank % self.shared == 0

    def __str__(self) -> str:
        """`tp=2,dp=2`: the sizes above one, `none` when all are one (`fsdp=1` if named so on
        one process)."""
        sizes = [f"{k}={getattr(self, k)}" for k in KEYS if getattr(self, k) > 1]
        return ",".join(sizes) or (f"{self.single}=1" if self.single else "none")


def engine_fields() -> frozenset[str]:
    """The fields of the installed transformers' DistributedConfig."""
    from transformers.distributed import DistributedConfig

    return frozenset(f.name for f in dataclasses.fields(DistributedConfig))


def parse_layout(text: str, world: int, *, fields: frozenset[str] | None = None) -> Layout:
    """The layout `text` names (`tp=2`, `fsdp=2,dp=2`, `ep=4`, `none`) for `world` ranks: the
    sizes must divide it, and what they leave over is `dp`. `fields`: the installed
    transformers' DistributedConfig fields, which decide how `ep` runs (see `engine_kwargs`).

    >>> ALL = frozenset({"tp_size", "fsdp_size", "ep_size", "dp_replicate_size"})
    >>> str(parse_layout("tp=2", 4, fields=ALL)), str(parse_layout("ep=2", 2, fields=ALL))
    ('tp=2,dp=2', 'fsdp=2,ep=2')
    >>> str(parse_layout("fsdp=1", 1, fields=ALL)), str(parse_layout("fsdp=1", 2, fields=ALL))
    ('fsdp=1', 'dp=2')
    >>> parse_layout("tp=3", 4, fields=ALL)
    Traceback (most recent call last):
    extract.parallel.LayoutError: --parallel tp=3: 3 ranks per model do not divide the 4 processes
    """
    fields = engine_fields() if fields is None else fields
    sizes = {k: 1 for k in KEYS}
    given = set()
    for item in filter(None, text.replace(" ", "").lower().split(",")):
        if item == "none":
            continue
        key, eq, value = item.partition("=")
        if key not in KEYS or not eq or not value.isdigit() or int(value) < 1:
            raise LayoutError(
                f"--parallel {text}: {item!r} is not KEY=N with KEY one of {', '.join(KEYS)} "
                "(e.g. tp=2, fsdp=2,dp=2, ep=4, or none)"
            )
        sizes[key], _ = int(value), given.add(key)
    tp, fsdp, ep = sizes["tp"], sizes["fsdp"], sizes["ep"]
    if ep > 1 and "ep_size" not in fields:
        if tp > 1 or fsdp > 1:
            raise LayoutError(
                f"--parallel {text}: the installed transformers splits experts only over ranks "
                "sharing inputs (no DistributedConfig.ep_size): use ep=N alone"
            )
        shared, model = ep, ep
    else:
        if ep > 1 and "fsdp" not in given and (fsdp * tp) % ep:
            fsdp = ep // math.gcd(ep, tp)  # ep=N alone: experts over N ranks of their own inputs
        if ep > 1 and (ep % tp or (fsdp * tp) % ep):
            raise LayoutError(
                f"--parallel {text}: ep must be a multiple of tp and divide fsdp x tp"
            )
        shared, model = tp, tp * fsdp
    if world % model:
        raise LayoutError(
            f"--parallel {text}: {model} ranks per model do not divide the {world} processes"
        )
    dp = world // model
    if "dp" in given and sizes["dp"] != dp:
        raise LayoutError(
            f"--parallel {text}: {model} ranks per model x dp={sizes['dp']} is not the "
            f"{world} processes (dp={dp} would be)"
        )
    named = sorted(given & {"tp", "fsdp"})
    single = named[0] if world == 1 and named and model == 1 else ""
    return Layout(tp=tp, fsdp=fsdp, ep=ep, dp=dp, shared=shared, single=single)


def engine_kwargs(layout: Layout, fields: frozenset[str] | None = None) -> dict:
    """DistributedConfig's arguments for `layout` in the installed transformers (5.17 and 5.24
    checked): tp_size, fsdp_size, and, where it has them, ep_size and dp_replicate_size. Without
    `ep_size`, experts are split with `enable_expert_parallel` over a group that shares inputs;
    without `dp_replicate_size`, a sharded layout must use every process (dp=1)."""
    fields = engine_fields() if fields is None else fields
    if layout.legacy_ep:
        kwargs = {"tp_size": layout.ep, "enable_expert_parallel": True}
    else:
        kwargs = {"tp_size": layout.tp, "fsdp_size": layout.fsdp}
        if layout.ep > 1:
            kwargs["ep_size"] = layout.ep
    if layout.dp > 1:
        if "dp_replicate_size" not in fields:
            raise LayoutError(
                f"--parallel {layout}: copies of a sharded model (dp={layout.dp}) need a "
                "transformers whose DistributedConfig has dp_replicate_size (5.24 has it, 5.17 "
                "not): use one model over all processes"
            )
        kwargs["dp_replicate_size"] = layout.dp
    return kwargs


def engine_places(sharding: dict) -> bool:
    """Whether transformers shards and places the weights for DistributedConfig(**sharding): only
    where some size is above 1 (with every size 1 it returns before making a device mesh, and
    the weights stay where they were loaded: on the CPU without a device_map).

    >>> engine_places({"tp_size": 1, "fsdp_size": 1}), engine_places({"tp_size": 2, "fsdp_size": 1})
    (False, True)
    """
    return any(v > 1 for k, v in sharding.items() if k.endswith("_size"))


def describe_engine(layout: Layout) -> str:
    """What loads the target under `layout`, for logs and the manifest."""
    import torch
    import transformers

    kwargs = engine_kwargs(layout)
    if not engine_places(kwargs):
        return (
            f"transformers {transformers.__version__}, loaded whole (one process: "
            f"DistributedConfig would shard nothing), torch {torch.__version__}"
        )
    args = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return (
        f"transformers {transformers.__version__} DistributedConfig({args}), "
        f"torch {torch.__version__}"
    )


def layout_record(layout: Layout) -> str:
    """What a part made under `layout` records in the manifest: the layout and its engine."""
    return f"{layout}; {describe_engine(layout)}"
