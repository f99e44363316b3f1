"""The streaming loader: reads the micro-batches an epoch plan (train/plan.py) assigns to a rank.

Per worker and epoch: plan the rank's streams from metadata, work out what this worker yields
(`rank_schedule`), then stream the stream's parts in plan order, keeping only samples a pending
batch still needs (at most the shuffle buffer's worth plus one batch), and collate each batch
into padded host tensors. fp8 payloads stay e4m3 bits until `device_batch` dequantises them on
the device. Resuming skips planned batches without reading them.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shared.cache import Sample, open_part
from shared.codec import dequantize_fp8
from shared.manifest import Manifest
from shared.stopping import loader_worker_init
from train.plan import (
    PlanSpec,
    SampleRef,
    WorkerItem,
    epoch_limit,
    mix_seed,
    padded_length,
    plan_epoch,
    plan_stream,
    rank_schedule,
    stream_parts,
)
from train.step import Batch

log = logging.getLogger(__name__)

LOADER_STATE_VERSION = 1


@dataclass(frozen=True)
class PartInfo:
    path: str
    lengths: tuple[int, ...]


def load_catalog(cache: Path, manifest: Manifest) -> tuple[list[PartInfo], list[str]]:
    """Every committed part's path and sample lengths, plus problems found opening them."""
    parts, problems = [], []
    expect_layers, expect_hidden = len(manifest.layer_ids), manifest.target.hidden_size
    for record in manifest.parts:
        path = Path(cache) / record.name
        try:
            reader = open_part(path)
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"part {record.name} cannot be opened ({e})")
            continue
        found = (reader.store, reader.num_layers, reader.hidden_size)
        if found != (manifest.store, expect_layers, expect_hidden):
            problems.append(
                f"part {record.name} holds store {found[0]}, {found[1]} layers, hidden "
                f"{found[2]}; the manifest says {manifest.store}, {expect_layers}, {expect_hidden}"
            )
            continue
        parts.append(PartInfo(str(path), tuple(int(n) for n in reader.lengths)))
    return parts, problems


def split_eval(num_parts: int, num_eval: int) -> tuple[list[int], list[int]]:
    """(train, eval) part numbers: `num_eval` evenly spaced parts are held out.

    >>> split_eval(10, 2)
    ([0, 1, 3, 4, 5, 6, 8, 9], [2, 7])
    """
    if not 0 <= num_eval < max(num_parts, 1):
        raise ValueError(f"cannot hold out {num_eval} of {num_parts} parts for evaluation")
    held = sorted({int((i + 0.5) * num_parts / num_eval) for i in range(num_eval)})
    return [p for p in range(num_parts) if p not in held], held


def layer_positions(cached: Sequence[int], wanted: Sequence[int]) -> tuple[int, ...]:
    """Positions in the stored layer axis of the wanted layer ids, in the wanted order."""
    return tuple(list(cached).index(i) for i in wanted)


def epoch_limits(
    spec: PlanSpec, *, workers: int, grad_accum: int, epochs: int | None, steps: int | None
) -> list[int]:
    """Micro-batches per rank of each epoch to run: `epochs` of them, or enough for `steps`."""
    limits: list[int] = []
    done = 0
    while (steps is None and len(limits) < (epochs or 0)) or (steps is not None and done < steps):
        counts = [len(s) for s in plan_epoch(spec, epoch=len(limits))]
        limit = epoch_limit(counts, workers=workers, grad_accum=grad_accum)
        if limit == 0:
            raise ValueError(
                f"epoch {len(limits)} has no full optimizer step on some rank: too little data "
                "for this many ranks x workers x grad_accum (lower --batch-tokens or --workers)"
            )
        limits.append(limit)
        done += limit // grad_accum
    return limits


def collate(samples: Sequence[Sample], refs: Sequence[SampleRef]) -> dict[str, torch.Tensor]:
    """Padded host tensors of one micro-batch (sequence length a multiple of 128)."""
    seq = max(padded_length(r.length) for r in refs)
    first = samples[0].hidden
    batch, layers, hidden = len(samples), first.shape[1], first.shape[2]
    ids = np.zeros((batch, seq), np.int64)
    mask = np.zeros((batch, seq), np.uint8)
    payload = np.zeros((batch, seq, layers, hidden), first.dtype)
    scale = np.zeros((batch, seq, layers), np.float32) if samples[0].scale is not None else None
    for b, (s, r) in enumerate(zip(samples, refs, strict=True)):
        n = r.length  # already clipped to max_length by the plan
        ids[b, :n] = s.input_ids[:n]
        mask[b, :n] = s.loss_mask[:n]
        payload[b, :n] = s.hidden[:n]
        if scale is not None:
            scale[b, :n] = s.scale[:n]
    out = {
        "ids": torch.from_numpy(ids),
        "loss_mask": torch.from_numpy(mask),
        "lengths": torch.tensor([r.length for r in refs], dtype=torch.int64),
    }
    if scale is None:
        out["hidden"] = torch.from_numpy(payload).view(torch.bfloat16)
    else:
        out["hidden_q"], out["hidden_scale"] = torch.from_numpy(payload), torch.from_numpy(scale)
    return out


def device_batch(item: dict[str, Any], device: torch.device) -> Batch:
    """A collated micro-batch on `device` (non-blocking from pinned memory), fp8 dequantised."""

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    if "hidden_q" in item:
        hidden = dequantize_fp8(move(item["hidden_q"]), move(item["hidden_scale"]))
    else:
        hidden = move(item["hidden"])
    return Batch(
        ids_BS=move(item["ids"]),
        loss_mask_BS=move(item["loss_mask"]),
        lengths_B=move(item["lengths"]),
        hidden_BSKH=hidden,
    )


class PlanDataset(IterableDataset):
    """The micro-batches of one rank for a run of epochs, starting `consumed` batches in.

    Yields dicts: `real` False marks a placeholder (keeps DataLoader workers in step, see
    train/plan.py); real items carry `epoch`, `stream`, `round`, `anchor_seed` and tensors.
    """

    def __init__(
        self,
        parts: Sequence[PartInfo],
        spec: PlanSpec,
        *,
        layers: Sequence[int],
        rank: int,
        workers: int,
        limits: dict[int, int],
        start_epoch: int = 0,
        consumed: int = 0,
    ) -> None:
        self.paths = [p.path for p in parts]
        self.spec, self.layers = spec, tuple(layers)
        self.rank, self.workers = rank, max(workers, 1)
        self.limits, self.start_epoch, self.consumed = dict(limits), start_epoch, consumed

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        physical = 0 if info is None else info.id
        if (1 if info is None else info.num_workers) != self.workers:
            raise RuntimeError(f"planned {self.workers} workers, DataLoader runs {info}")
        rotation = None
        for epoch in sorted(e for e in self.limits if e >= self.start_epoch):
            consumed = self.consumed if epoch == self.start_epoch else 0
            first = self.rank * self.workers
            parts_of = stream_parts(self.spec, epoch=epoch)[first : first + self.workers]
            plans = [
                plan_stream(self.spec, parts, epoch=epoch, stream=first + s)
                for s, parts in enumerate(parts_of)
            ]
            rot, items = rank_schedule(
                [len(p) for p in plans], limit=self.limits[epoch], consumed=consumed
            )
            rotation = rot if rotation is None else rotation
            s = (physical + rotation) % self.workers
            yield from self._read_stream(epoch, first + s, parts_of[s], plans[s], items[s])

    def _read_stream(
        self,
        epoch: int,
        stream: int,
        parts: Sequence[int],
        batches: Sequence[list[SampleRef]],
        items: Sequence[WorkerItem],
    ) -> Iterator[dict[str, Any]]:
        needed = {(r.part, r.index) for it in items if it.real for r in batches[it.round]}
        source = self._read_needed(parts, needed)
        loaded: dict[tuple[int, int], Sample] = {}
        for it in items:
            meta = {"epoch": epoch, "stream": stream, "round": it.round, "real": it.real}
            if not it.real:
                yield meta
                continue
            refs = batches[it.round]
            for r in refs:
                while (r.part, r.index) not in loaded:
                    key, sample = next(source)
                    loaded[key] = sample
            samples = [loaded.pop((r.part, r.index)) for r in refs]
            seed = mix_seed(self.spec.seed, epoch, stream, it.round)
            yield {**meta, "anchor_seed": seed, **collate(samples, refs)}

    def _read_needed(
        self, parts: Sequence[int], needed: set[tuple[int, int]]
    ) -> Iterator[tuple[tuple[int, int], Sample]]:
        """Needed samples in stream order (the order the shuffle buffer took them in)."""
        by_part: dict[int, list[int]] = {}
        for q, n in needed:
            by_part.setdefault(q, []).append(n)
        for p in parts:
            wanted = sorted(by_part.get(p, ()))
            if not wanted:
                continue
            reader = open_part(Path(self.paths[p]))
            if self.paths[p].endswith(".tar") or len(wanted) == reader.num_samples:
                keep = set(wanted)
                for n, sample in enumerate(reader.iter_samples(self.layers)):
                    if n in keep:
                        yield (p, n), sample
            else:  # zarr random access: skipped samples are never decoded
                for n in wanted:
                    yield (p, n), reader.read(n, self.layers)


def _worker_context() -> mp.context.BaseContext:
    """forkserver with this module preloaded: workers start in milliseconds (after one import
    of torch and zarr per process) without forking the trainer, whose CUDA, NCCL and zarr I/O
    threads make a plain fork unsafe."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def make_loader(
    dataset: PlanDataset, *, workers: int, prefetch: int, pin_memory: bool
) -> DataLoader:
    """A DataLoader over a PlanDataset (batch_size None: the dataset yields whole batches)."""
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs = dict(prefetch_factor=prefetch, multiprocessing_context=_worker_context())
        kwargs["worker_init_fn"] = functools.partial(loader_worker_init, os.getpid())
    return DataLoader(
        dataset, batch_size=None, num_workers=workers, pin_memory=pin_memory, **kwargs
    )


@dataclass(frozen=True)
class LoaderState:
    """Where a rank's loader is: `consumed` micro-batches of `epoch` are done."""

    epoch: int = 0
    consumed: int = 0

    def advance(self, limits: Sequence[int]) -> LoaderState:
        """The state after one more micro-batch (rolling over to the next epoch at its end)."""
        consumed = self.consumed + 1
        if self.epoch < len(limits) and consumed >= limits[self.epoch]:
            return LoaderState(self.epoch + 1, 0)
        return LoaderState(self.epoch, consumed)

    def to_dict(self, *, world_size: int, workers: int) -> dict[str, int]:
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "world_size": world_size,
            "workers": workers,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int], *, world_size: int, workers: int) -> LoaderState:
        if d.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"loader state version {d.get('version')}, expected 1")
        if (d["world_size"], d["workers"]) != (world_size, workers):
            raise ValueError(
                f"the checkpoint was written by {d['world_size']} ranks x {d['workers']} "
                f"workers, this run has {world_size} x {workers}: the data plan would differ"
            )
        return cls(d["epoch"], d["consumed"])
