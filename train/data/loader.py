"""The streaming loader: reads the packed rows an epoch plan (train/data/plan.py) assigns to a rank.

Per worker and epoch: plan the epoch's rows from metadata, take this worker's slice of this
rank's rows and what it yields (`rank_schedule`), read each row's samples and collate them into
one row of exactly `row_tokens` tokens with document ids and per-sample positions. zarr parts are
read at random, sample by sample, in row order (one row in memory); webdataset tars are streamed
front to back, keeping only samples a pending row still needs (a tar's samples are numbered in
zarr's order, not the tar's: `shared.wds.canonical_order`). fp8 payloads stay e4m3 bits
and int4 payloads records (`shared.int4`) until `device_batch` decodes them on the device.
Resuming skips planned rows without reading them. A part that fails to decode ends the run with
one message naming it (`CacheReadError`).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from shared.cache import Sample, open_part
from shared.codec import dequantize_fp8
from shared.int4 import decode_int4
from shared.manifest import CacheMismatch, read_manifest, repair_commands
from shared.stopping import StopRun, loader_worker_init, worker_died
from train.data.batch import Batch
from train.data.catalog import PartInfo
from train.data.growing import GrowingRows, interleaved_rows
from train.data.plan import (
    PlanSpec,
    SampleRef,
    WorkerItem,
    mix_seed,
    plan_rows,
    rank_schedule,
    worker_rows,
)

log = logging.getLogger(__name__)

LOADER_STATE_VERSION = 2  # 2: packed rows (1: padded batches of several samples)
OPEN_PARTS = 4  # zarr parts a worker keeps open (a slice of the shuffled order spans few)


class CacheReadError(StopRun):
    """A part of the cache could not be read while training; the message names it."""


def layer_positions(cached: Sequence[int], wanted: Sequence[int]) -> tuple[int, ...]:
    """Positions in the stored layer axis of the wanted layer ids, in the wanted order."""
    return tuple(list(cached).index(i) for i in wanted)


def collate_row(
    samples: Sequence[Sample], refs: Sequence[SampleRef], *, row_tokens: int
) -> dict[str, torch.Tensor]:
    """One packed row [1, row_tokens]: the samples back to back, then padding.

    `doc_ids` numbers the samples 0, 1, ... (-1 on padding); `positions` restart at 0 at each
    sample (RoPE positions); ids, loss mask and hidden states are zero on padding.

    >>> from shared.cache import Sample
    >>> s = [Sample(0, np.arange(3), np.ones(3, np.uint8), np.zeros((3, 1, 2), np.uint16)),
    ...      Sample(1, np.arange(2), np.ones(2, np.uint8), np.zeros((2, 1, 2), np.uint16))]
    >>> out = collate_row(s, [SampleRef(0, 0, 3), SampleRef(0, 1, 2)], row_tokens=6)
    >>> out["doc_ids"].tolist(), out["positions"].tolist()
    ([[0, 0, 0, 1, 1, -1]], [[0, 1, 2, 0, 1, 0]])
    """
    total = sum(r.length for r in refs)
    if total > row_tokens:
        raise ValueError(f"row of {total} tokens exceeds row_tokens {row_tokens}")
    first = samples[0].hidden
    layers, hidden = first.shape[1], first.shape[2]
    ids = np.zeros((1, row_tokens), np.int64)
    mask = np.zeros((1, row_tokens), np.uint8)
    docs = np.full((1, row_tokens), -1, np.int32)
    pos = np.zeros((1, row_tokens), np.int32)
    payload = np.zeros((1, row_tokens, layers, hidden), first.dtype)
    scale = np.zeros((1, row_tokens, layers), np.float32) if samples[0].scale is not None else None
    start = 0
    for d, (s, r) in enumerate(zip(samples, refs, strict=True)):
        n, rows = r.length, slice(start, start + r.length)  # length already clipped by the plan
        ids[0, rows] = s.input_ids[:n]
        mask[0, rows] = s.loss_mask[:n]
        docs[0, rows] = d
        pos[0, rows] = np.arange(n, dtype=np.int32)
        payload[0, rows] = s.hidden[:n]
        if scale is not None:
            scale[0, rows] = s.scale[:n]
        start += n
    out = {
        "ids": torch.from_numpy(ids),
        "loss_mask": torch.from_numpy(mask),
        "doc_ids": torch.from_numpy(docs),
        "positions": torch.from_numpy(pos),
        "tokens": torch.tensor(start, dtype=torch.int64),
    }
    if samples[0].scheme is not None:  # int4 records, and how to decode them
        out["hidden_int4"], out["int4_scheme"] = torch.from_numpy(payload), samples[0].scheme
    elif scale is None:
        out["hidden"] = torch.from_numpy(payload).view(torch.bfloat16)
    else:
        out["hidden_q"], out["hidden_scale"] = torch.from_numpy(payload), torch.from_numpy(scale)
    return out


def device_batch(item: dict[str, Any], device: torch.device) -> Batch:
    """A collated row on `device` (non-blocking from pinned memory), fp8 and int4 decoded there
    (the int4 rotation undone before the drafter: `shared.int4.decode_int4`)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    if "hidden_int4" in item:
        hidden = decode_int4(move(item["hidden_int4"]), item["int4_scheme"])
    elif "hidden_q" in item:
        hidden = dequantize_fp8(move(item["hidden_q"]), move(item["hidden_scale"]))
    else:
        hidden = move(item["hidden"])
    return Batch(
        ids_BS=move(item["ids"]),
        loss_mask_BS=move(item["loss_mask"]),
        doc_ids_BS=move(item["doc_ids"]),
        positions_BS=move(item["positions"]),
        hidden_BSKH=hidden,
        num_tokens=move(item["tokens"]),
    )


def checked(items: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The loader's items, raising `CacheReadError` where a worker met an unreadable part; any
    error ending it (that one, or one a worker raised) stops the workers first."""
    try:
        for item in items:
            if "error" in item:
                raise CacheReadError(item["error"])
            yield item
    except (Exception, KeyboardInterrupt) as e:
        _stop_workers(items)
        if died := worker_died(e):  # each holds a shuffle buffer: those options take memory
            raise StopRun(f"{died} (less memory: fewer --workers, --shuffle-buffer)") from None
        raise


def _stop_workers(items: Iterator[dict[str, Any]]) -> None:
    """Stop a DataLoader iterator's workers now: the error's traceback keeps the iterator
    alive, and its workers (they ignore signals) would keep the exiting process waiting."""
    getattr(items, "_shutdown_workers", lambda: None)()  # torch's DataLoader iterator


class PlanDataset(IterableDataset):
    """The rows of one rank for a run of epochs, starting `consumed` rows in.

    Yields dicts: `real` False marks a placeholder (keeps DataLoader workers in step, see
    train/data/plan.py); real items carry `epoch`, `round`, `anchor_seed` and tensors; an item with
    `error` reports an unreadable part (see `checked`). `even` gives every rank the same number
    of rows (training); otherwise ranks get nearly equal shares and nothing is dropped (eval).
    `growing`: epoch 0 is a first pass that follows the extraction (train/data/growing.py),
    planned by the rank, its rows interleaved over ranks and workers.
    """

    def __init__(
        self,
        parts: Sequence[PartInfo],
        spec: PlanSpec,
        *,
        layers: Sequence[int],
        rank: int,
        world_size: int,
        workers: int,
        limits: dict[int, int],
        start_epoch: int = 0,
        consumed: int = 0,
        even: bool = True,
        growing: GrowingRows | None = None,
    ) -> None:
        self.paths = [p.path for p in parts]
        self.growing = growing
        self.spec, self.layers = spec, tuple(layers)
        self.rank, self.world_size, self.workers = rank, world_size, max(workers, 1)
        self.limits, self.start_epoch, self.consumed = dict(limits), start_epoch, consumed
        self.even = even

    def slices(
        self, epoch: int
    ) -> tuple[Sequence[list[SampleRef]] | dict[int, list[SampleRef]], list[range]]:
        """The epoch's rows (by row number), and the row numbers of each of its workers."""
        kw = dict(rank=self.rank, world_size=self.world_size, workers=self.workers)
        if epoch == 0 and self.growing is not None:
            return self.growing.rows, interleaved_rows(self.growing.planned, **kw)
        rows = plan_rows(self.spec, epoch=epoch)
        return rows, worker_rows(len(rows), **kw, even=self.even)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        physical = 0 if info is None else info.id
        if (1 if info is None else info.num_workers) != self.workers:
            raise RuntimeError(f"planned {self.workers} workers, DataLoader runs {info}")
        rotation = None
        for epoch in sorted(e for e in self.limits if e >= self.start_epoch):
            consumed = self.consumed if epoch == self.start_epoch else 0
            rows, slices = self.slices(epoch)
            rot, items = rank_schedule(
                [len(s) for s in slices], limit=self.limits[epoch], consumed=consumed
            )
            rotation = rot if rotation is None else rotation
            s = (physical + rotation) % self.workers
            yield from self._read_rows(epoch, rows, slices[s], items[s])

    def _read_rows(
        self,
        epoch: int,
        rows: Sequence[list[SampleRef]] | dict[int, list[SampleRef]],
        numbers: range,
        items: Sequence[WorkerItem],
    ) -> Iterator[dict[str, Any]]:
        source = self._samples([rows[numbers[it.round]] for it in items if it.real])
        for it in items:
            meta = {"epoch": epoch, "round": it.round, "real": it.real}
            if not it.real:
                yield meta
                continue
            number = numbers[it.round]
            refs = rows[number]
            try:
                samples = [next(source) for _ in refs]
            except Exception as e:  # any decode failure: report it, the trainer stops cleanly
                yield {**meta, "error": self._describe(e)}
                return
            # seeded by the row's number in the epoch: the same row draws the same anchors
            # whichever rank or worker reads it
            seed = mix_seed(self.spec.seed, epoch, number)
            yield {
                **meta,
                "row": number,
                "anchor_seed": seed,
                **collate_row(samples, refs, row_tokens=self.spec.row_tokens),
            }

    def _samples(self, rows: Sequence[list[SampleRef]]) -> Iterator[Sample]:
        """The samples of `rows`, in row order."""
        refs = [r for row in rows for r in row]
        if any(self.paths[r.part].endswith(".tar") for r in refs):
            yield from _streamed(self.paths, refs, self.layers, self._reading)
            return
        readers: OrderedDict[int, Any] = OrderedDict()
        for r in refs:
            self._current = r.part
            if r.part not in readers:
                readers[r.part] = open_part(Path(self.paths[r.part]))
                if len(readers) > OPEN_PARTS:
                    readers.popitem(last=False)
            readers.move_to_end(r.part)
            yield readers[r.part].read(r.index, self.layers)

    def _reading(self, part: int) -> None:
        self._current = part  # the part a failure names

    def _describe(self, error: Exception) -> str:
        part = getattr(self, "_current", None)
        where = self.paths[part] if part is not None else "a part of the cache"
        cache = Path(where).parent
        try:
            manifest = read_manifest(cache)
        except (CacheMismatch, OSError):
            manifest = None
        return (
            f"cannot read {where} ({type(error).__name__}: {error}). The cache is damaged: "
            f"{repair_commands(cache, manifest)}, then resume this run with the same command"
        )


def _streamed(
    paths: Sequence[str],
    refs: Sequence[SampleRef],
    layers: Sequence[int],
    reading: Callable[[int], None] = lambda part: None,
) -> Iterator[Sample]:
    """Samples of `refs` in their order, from tars read front to back (parts in first-use
    order); samples read before they are due wait in memory. `reading(part)` as each tar's
    reading starts."""
    needed: dict[int, set[int]] = {}
    for r in refs:
        needed.setdefault(r.part, set()).add(r.index)

    def stored_order() -> Iterator[tuple[tuple[int, int], Sample]]:
        for p in dict.fromkeys(r.part for r in refs):
            reading(p)
            reader = open_part(Path(paths[p]))
            for n, sample in reader.iter_indexed(layers, only=needed[p]):
                yield (p, n), sample

    source, loaded = stored_order(), {}
    for r in refs:
        while (r.part, r.index) not in loaded:
            key, sample = next(source)
            loaded[key] = sample
        yield loaded.pop((r.part, r.index))


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
            raise ValueError(
                f"loader state version {d.get('version')}, expected {LOADER_STATE_VERSION}: the "
                "checkpoint was written by an older version whose data plan differs"
            )
        if (d["world_size"], d["workers"]) != (world_size, workers):
            raise ValueError(
                f"the checkpoint was written by {d['world_size']} ranks x {d['workers']} "
                f"workers, this run has {world_size} x {workers}: the data plan would differ"
            )
        return cls(d["epoch"], d["consumed"])
