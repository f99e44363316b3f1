"""Whether a target fits a layout, checked before loading: its parameter count from the
safetensors headers, what one rank holds under a layout, the memory per device, and a layout
that fits when the chosen one does not (`plan_layout`, also for `--parallel auto`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from extract.layouts import forward_mode
from extract.parallel import Layout, LayoutError, engine_fields, engine_kwargs, parse_layout
from shared.dist import DeviceSpec, torchrun_world_size, under_torchrun

if TYPE_CHECKING:
    from extract.config import ExtractConfig
    from shared.manifest import Manifest

# The process group's timeout under a sharded layout: every rank loads its shard of a large
# checkpoint before the first collective after it, which can take longer than the usual 30 min.
LOAD_TIMEOUT = datetime.timedelta(hours=3)

# A device's memory the weights may take: the rest is for activations, staging and the
# allocator (a 16K-token forward of a 235B MoE holds a few GB).
WEIGHT_SHARE = 0.85


@dataclasses.dataclass(frozen=True)
class TargetSize:
    dense: int  # parameters outside the experts
    experts: int  # parameters of routed experts
    layers: int
    moe: bool

    def per_device(self, layout: Layout, *, bytes_per_param: int) -> int:
        """Bytes of weights one rank holds under `layout` (all layers: loading precedes the
        truncation), with one gathered layer more under fsdp."""
        if layout.legacy_ep:
            dense, experts = self.dense, self.experts / layout.ep
        else:
            dense = self.dense / (layout.tp * layout.fsdp)
            experts = self.experts / (layout.ep if layout.ep > 1 else layout.tp * layout.fsdp)
        # One layer's weights gathered at a time (experts split by ep are not gathered).
        layer = (self.dense + (self.experts if layout.ep == 1 else 0)) / self.layers
        gathered = layer if layout.fsdp > 1 else 0
        return int((dense + experts + gathered) * bytes_per_param)


def target_size(target: Path, num_layers: int) -> TargetSize:
    """Parameter counts from the safetensors headers (no weights read). Quantized checkpoints
    count stored elements (mxfp4 blocks undercount by 2)."""
    dense = experts = 0
    for f in sorted(Path(target).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = math.prod(meta["shape"])
            if "experts" in name.split("."):
                experts += n
            else:
                dense += n
    return TargetSize(dense=dense, experts=experts, layers=max(1, num_layers), moe=experts > 0)


def candidates(size: TargetSize, world: int, fields: frozenset[str]) -> list[Layout]:
    """Layouts to suggest, preferred first: ep for MoE targets, then tp, then fsdp."""
    out = []
    kinds = ("ep", "tp", "fsdp") if size.moe else ("tp", "fsdp")
    k = 2
    while k <= world:
        if world % k == 0:
            for kind in kinds:
                try:
                    layout = parse_layout(f"{kind}={k}", world, fields=fields)
                    engine_kwargs(layout, fields)
                except LayoutError:
                    continue
                out.append(layout)
        k *= 2
    return out


def fit_problem(
    size: TargetSize,
    layout: Layout,
    *,
    world: int,
    memory: int,
    bytes_per_param: int,
    device: str,
    fields: frozenset[str],
) -> str | None:
    """None if `layout` fits devices of `memory` bytes, else a message with the target's size,
    the memory per device, and a layout that fits (or how many devices one would need)."""
    need = size.per_device(layout, bytes_per_param=bytes_per_param)
    budget = int(memory * WEIGHT_SHARE)
    if need <= budget:
        return None
    total = (size.dense + size.experts) * bytes_per_param
    fits = [
        c
        for c in candidates(size, world, fields)
        if size.per_device(c, bytes_per_param=bytes_per_param) <= budget
    ]
    if fits:
        each = size.per_device(fits[0], bytes_per_param=bytes_per_param)
        hint = f"--parallel {fits[0]} fits ({_gb(each)} per {device})"
    else:
        k = 2
        while (
            k < 4096
            and size.per_device(_layout_of(size, k), bytes_per_param=bytes_per_param) > budget
        ):
            k *= 2
        hint = (
            f"no layout of {world} {device}s fits: it needs about {k} of them "
            f"(--parallel {_layout_of(size, k)})"
        )
    return (
        f"--target: {_gb(total)} of weights ({size.dense + size.experts:,} parameters) need "
        f"{_gb(need)} per {device} under --parallel {layout}, more than {WEIGHT_SHARE:.0%} of "
        f"the {_gb(memory)} each has; {hint}"
    )


def _need(size: TargetSize, layout: Layout, bytes_per_param: int) -> int:
    return size.per_device(layout, bytes_per_param=bytes_per_param)


def _layout_of(size: TargetSize, k: int) -> Layout:
    return Layout(fsdp=k, ep=k) if size.moe else Layout(tp=k, shared=k)


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def device_memory(kind: str, devices: tuple[int, ...]) -> int:
    """Bytes of memory per rank: the smallest GPU's, or on CPUs the host's available memory
    shared by the processes."""
    if kind == "cuda":
        import torch

        return min(torch.cuda.get_device_properties(d).total_memory for d in devices)
    return _available_host_memory() // max(1, len(devices))


def _available_host_memory() -> int:
    """MemAvailable (free memory plus the page cache the kernel can reclaim), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_layout(
    parallel: str,
    target: Path,
    *,
    num_layers: int,
    world: int,
    device: str,
    memory: int,
    fields: frozenset[str] | None = None,
) -> Layout:
    """The layout `--parallel` asks for (`auto`: one model per rank where it fits, else the
    first of `candidates` that fits), checked to fit devices of `memory` bytes before anything
    is loaded; raises LayoutError saying what would fit."""
    fields = engine_fields() if fields is None else fields
    size = target_size(target, num_layers)
    bytes_per_param = 2 if device == "cuda" else 4  # bf16 on GPUs, fp32 on CPUs
    plain = Layout(dp=world)
    if parallel == "auto":
        fitting = [
            c
            for c in [plain, *candidates(size, world, fields)]
            if size.per_device(c, bytes_per_param=bytes_per_param) <= memory * WEIGHT_SHARE
        ]
        layout = fitting[0] if fitting else plain
    else:
        layout = parse_layout(parallel, world, fields=fields)
    if layout.sharded:
        engine_kwargs(layout, fields)
    name = "GPU" if device == "cuda" else "process"
    problem = fit_problem(
        size,
        layout,
        world=world,
        memory=memory,
        bytes_per_param=bytes_per_param,
        device=name,
        fields=fields,
    )
    if problem is not None:
        raise LayoutError(problem)
    return layout


def layout_for(cfg: ExtractConfig, spec: DeviceSpec, planned: Manifest) -> Layout:
    """The layout of this run (`--parallel` for its processes and devices), refused before
    anything loads where the target does not fit it."""
    world = torchrun_world_size() if under_torchrun() else spec.nprocs
    plain = cfg.parallel.strip().lower() in ("", "none")
    layout = plan_layout(
        "none" if plain else cfg.parallel,
        Path(planned.target.path),
        num_layers=planned.target.num_layers,
        world=world,
        device=spec.kind,
        memory=device_memory(spec.kind, spec.devices),
    )
    if cfg.attention != "auto" and not forward_mode(cfg.compile, cfg.packing, spec.kind)[1]:
        raise LayoutError(
            f"--attention {cfg.attention} has no effect: the target runs padded batches on "
            f"{spec.kind} with --compile {cfg.compile} and --packing {cfg.packing} (packed rows "
            "are the default where the layers are compiled); drop it, or give --packing on"
        )
    if spec.kind == "cpu" and layout.sharded:
        import torch

        if torch.cuda.is_available():
            raise LayoutError(
                f"--parallel {cfg.parallel} with --gpus {spec}: transformers lays a sharded "
                "model out on the accelerator it finds; use --gpus with GPUs here"
            )
    return layout
