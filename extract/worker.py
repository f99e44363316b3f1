"""One extract process: its share of the work units, the target, and its part pipeline."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from extract.backpressure import describe_end
from extract.capture import LayerCapture
from extract.disk import disk_full_message
from extract.forward_clock import ForwardClock
from extract.job import Job, writer_threads
from extract.layouts import Sharded, choose_layout, compiled_graphs, forward_mode
from extract.lockstep import LockStep, agree_max, cpu_group
from extract.packing import chunk_size
from extract.parallel import describe_engine, engine_kwargs
from extract.pipeline import PartPipeline
from extract.stops import (
    Reached,
    prepared_unless_stopped,
    stopped_at_once,
    stopped_before_preparing,
    stopped_while_loading,
)
from extract.target import TargetError, load_failure, load_target
from extract.units import Reader, reader_reading_ahead, run_units
from shared.dist import RankInfo, all_gather_objects, one_rank_group
from shared.fsio import os_error_text
from shared.int4 import prepare_encoder
from shared.logs import setup_logging
from shared.progress import RankCounters, SummedBar
from shared.stopping import Stopped, StopRequest, StopRun

log = logging.getLogger(__name__)


class TargetLoadFailed(StopRun):
    """The target failed to load on a rank: raised on every rank, before --out is prepared."""


# What the first stop signal starts, in words, until the target has loaded on every rank.
STOPPING_ONCE_LOADED = "stopping once the target has loaded, before any part (again: at once)"


@dataclass
class _Rank:
    """One process of the run: who it is, its job, its units and whether it writes them, its
    stop request (the stop signals go to it), and how far it got."""

    info: RankInfo
    job: Job
    mine: tuple[int, ...]
    writes: bool
    stop: StopRequest
    reached: Reached = field(default_factory=Reached)

    @property
    def sharded(self) -> bool:
        return self.job.layout is not None and self.job.layout.sharded


def rank_main(info: RankInfo, job: Job, prepare: Callable[[], object] | None = None) -> None:
    """One process: its units extracted. `prepare` (the output cleared and begun anew, where
    --out holds a cache to replace) is run by rank 0 once every rank holds its target, the
    others waiting: a target that does not load, or a stop signal before then, leaves that
    cache as it was."""
    setup_logging(info.rank, verbose=job.verbose)
    if info.device.type == "cpu":
        # Respects OMP_NUM_THREADS; several CPU ranks share the cores.
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))
    mine, writes = _my_units(info, job)
    rank = _Rank(info, job, mine, writes, StopRequest())
    if rank.sharded and info.world_size == 1:
        one_rank_group(info)
    rank.stop.install(STOPPING_ONCE_LOADED)
    try:
        _load_and_extract(rank, prepare)
    except KeyboardInterrupt:  # a second signal in a process started by hand: where it was
        raise stopped_at_once(
            job.out,
            rank.reached.stage,
            replaces=prepare is not None,
            before=job.done_before,
            now=rank.reached.committed,
        ) from None
    finally:
        rank.stop.restore()


def _load_and_extract(rank: _Rank, prepare: Callable[[], object] | None) -> None:
    """`rank_main`'s work, as `rank.reached` follows it: the target loaded on every rank (a
    signal meanwhile stops them all once all have loaded), --out prepared by rank 0 (where it
    holds a cache to replace: the ranks stop before it on a signal since), the rank's units
    extracted (a signal now stops it between parts), what it did reported."""
    from transformers import AutoTokenizer

    job = rank.job
    tokenizer = AutoTokenizer.from_pretrained(job.target)
    read = reader_reading_ahead(job, tokenizer, rank.mine)
    model, failure = _load(rank)
    _agree_all_loaded(rank, failure, replaces=prepare is not None)
    rank.reached.stage = "preparing" if prepare is not None else "loaded"
    _prepared(rank, prepare)
    rank.reached.stage = "prepared"
    rank.stop.what = "finishing the parts in progress, then stopping"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    _compile_int4_encoder(rank, model)
    group = cpu_group() if rank.sharded else None
    capture = _capture(rank, model, pad=pad, group=group)
    _extract(rank, capture, read, pad=pad, group=group)


def _load(rank: _Rank) -> tuple[torch.nn.Module | None, str | None]:
    """This rank's target, or why it did not load (memory, damaged weights, an unsupported
    model: whatever it is, the other ranks must hear of it)."""
    job, info = rank.job, rank.info
    try:
        model = load_target(
            job.target,
            device=info.device,
            last_layer=max(job.layer_ids),
            sharding=engine_kwargs(job.layout) if rank.sharded else None,
        )
    except Exception as e:
        log.debug("rank %d: the target did not load", info.rank, exc_info=True)
        return None, load_failure(job.target, info.device, e)
    return model, None


def _agree_all_loaded(rank: _Rank, failure: str | None, *, replaces: bool) -> None:
    """Every rank told how the others' loads went: a failure on any raises TargetLoadFailed on
    every rank with the first failing rank's message, and a signal on any while they loaded
    Stopped. A sharded target is loaded by its ranks together, through collectives of
    transformers' own, so a rank that fails there raises at once: the others, waiting in a
    collective it never joins, are ended by the launcher and never agree that all loaded."""
    job, info = rank.job, rank.info
    report = (failure, rank.stop.signal_name)
    ranks = [report] if rank.sharded and failure else all_gather_objects(report)
    failures = [f for f, _ in ranks if f is not None]
    if failures:
        many = f" ({len(failures)} of {info.world_size} ranks)" if info.world_size > 1 else ""
        kept = f"; the cache in --out {job.out} was not touched" if replaces else ""
        raise TargetLoadFailed(f"{failures[0]}{many}{kept}")
    signals = [s for _, s in ranks if s is not None]
    if signals:
        raise stopped_while_loading(job.out, signals[0], replaces=replaces, before=job.done_before)


def _prepared(rank: _Rank, prepare: Callable[[], object] | None) -> None:
    """`prepare` run by rank 0 while the other ranks wait, unless a signal reached it since
    all loaded (the cache to replace then stays); its failure or that stop raised on every
    rank."""
    out = rank.job.out
    prepared_unless_stopped(
        rank.info.is_main,
        functools.partial(_prepare_or_say_why, out, prepare) if prepare is not None else None,
        signal_name=rank.stop.signal_name,
        stopped=functools.partial(stopped_before_preparing, out),
    )


def _prepare_or_say_why(out: Path, prepare: Callable[[], object]) -> None:
    """`prepare` run; where it fails, a StopRun saying why (which every rank can raise)."""
    try:
        prepare()
    except (TargetError, OSError) as e:  # `target/` or --out that cannot be written
        raise StopRun(str(e) if isinstance(e, TargetError) else os_error_text(e, out)) from None
    except Exception as e:
        log.exception("rank 0: preparing %s failed", out)
        raise StopRun(f"{out}: it could not be prepared ({type(e).__name__}: {e})") from None


def _compile_int4_encoder(rank: _Rank, model: torch.nn.Module) -> None:
    """Before the target's start-up probe, which counts the graphs made after it as
    recompilations. `--compile none` keeps the encoder eager too."""
    job, info = rank.job, rank.info
    if job.store == "int4" and info.device.type == "cuda" and job.compile != "none":
        seconds = prepare_encoder(model.config.get_text_config().hidden_size, info.device)
        log.info("rank %d: the int4 encoder compiled in %.1f s", info.rank, seconds)


def _capture(rank: _Rank, model: torch.nn.Module, *, pad: int, group: object) -> LayerCapture:
    """The target's forwards on this rank, capturing the job's layers, in the layout its
    start-up probe chose (the ranks of a sharded target, in `group`, probe together)."""
    job, info = rank.job, rank.info
    if rank.sharded and info.is_main:
        log.info(
            "--parallel %s: %s; %d input groups, each written by its first rank",
            job.layout,
            describe_engine(job.layout),
            job.layout.groups,
        )
    compiled, packed = forward_mode(job.compile, job.packing, info.device.type)
    layout = functools.partial(
        choose_layout,
        packed=packed,
        compile_layers=compiled,
        chunk_tokens=chunk_size(job.batch_tokens, job.max_length),
        pad_id=pad,
        attention=None if job.attention == "auto" else job.attention,
        # the ranks of a sharded target probe together and keep the same layout
        sharded=Sharded(model, functools.partial(agree_max, group=group)) if rank.sharded else None,
    )
    capture = LayerCapture(model, job.layer_ids, pad_id=pad, layout=layout, sharded=rank.sharded)
    log.info("rank %d: the target runs %s", info.rank, capture.layout.describe())
    return capture


def _extract(rank: _Rank, capture: LayerCapture, read: Reader, *, pad: int, group: object) -> None:
    """The rank's units through its part pipeline until they are done or a signal stops it
    between parts (Stopped, then), the ranks of a sharded target in lock step (`group`); what
    it did logged."""
    job, info = rank.job, rank.info
    counters = rank.reached.counters = RankCounters(job.progress_dir, info.rank)
    bar = _summed_bar(rank, counters)
    clock = ForwardClock(capture.body)  # after LayerCapture's mask probe
    lockstep = LockStep(group, rank.stop) if rank.sharded else None
    switch_interval = sys.getswitchinterval()
    try:
        pipeline = _started_pipeline(rank, capture, counters, clock, lockstep)
        dummy = functools.partial(
            capture.run, [np.full(1, pad, dtype=np.int64)], device=info.device
        )
        after_part = bar.refresh if bar is not None else None
        done, seconds, forwards = _run(rank, pipeline, read, after_part, lockstep, dummy)
        _report(info.rank, counters.counts["tokens"], seconds, forwards, pipeline, clock, capture)
    finally:
        sys.setswitchinterval(switch_interval)
        clock.close()
        capture.close()
        counters.close()
        if bar is not None:
            bar.close()
    if lockstep is not None:
        log.info(
            "rank %d: %d forwards of its own, %d dummy forwards to keep the ranks in step",
            info.rank,
            lockstep.forwards,
            lockstep.dummies,
        )
    if done < len(rank.mine):
        signal_name = (lockstep or rank.stop).signal_name
        raise Stopped(
            f"stopped by {signal_name}: rank {info.rank} committed {done} of its "
            f"{len(rank.mine)} parts in this run, and no part was left half-written; rerun the "
            "same command to resume."
        )


def _summed_bar(rank: _Rank, counters: RankCounters) -> SummedBar | None:
    """The bar of every rank's rows, drawn by rank 0 where no launching parent draws it."""
    job = rank.job
    if not (job.draw_bar and rank.info.is_main):
        return None
    bar = job.bar()
    counters.listener = bar.refresh
    return bar


def _started_pipeline(
    rank: _Rank,
    capture: LayerCapture,
    counters: RankCounters,
    clock: ForwardClock,
    lockstep: LockStep | None,
) -> PartPipeline:
    """The rank's part pipeline, its writer threads started, and the GIL's switch interval set
    for the run (the caller restores it)."""
    job, info = rank.job, rank.info
    threads = writer_threads(job, info)
    pipeline = PartPipeline(
        job,
        info.device,
        capture,
        threads=threads,
        counters=counters,
        clock=clock,
        writes=rank.writes,
        before_forward=lockstep.before_forward if lockstep is not None else None,
    )
    sys.setswitchinterval(job.switch_interval_s)
    log.info(
        "rank %d: %s on %s, %d writer threads, GIL switch interval %g ms",
        info.rank,
        f"{len(rank.mine)} part{'s' if len(rank.mine) != 1 else ''}",
        info.device,
        threads,
        sys.getswitchinterval() * 1e3,
    )
    return pipeline


def _run(
    rank: _Rank,
    pipeline: PartPipeline,
    read: Reader,
    after_part: Callable[[], None] | None,
    lockstep: LockStep | None,
    dummy: Callable[[], object],
) -> tuple[int, float, float]:
    """The rank's units through `pipeline` until a stop (`dummy` forwards then keep a sharded
    target's ranks in step until none has work), the pipeline closed: how many units were
    submitted, the seconds it all took and those until the last forward ended."""
    info = rank.info
    start = time.perf_counter()
    rank.reached.stage = "extracting"
    with disk_full_message(rank.job):
        try:
            stop = lockstep or rank.stop
            done = run_units(pipeline, rank.mine, read=read, after_part=after_part, stop=stop)
            if lockstep is not None:
                lockstep.drain(dummy)
            if info.device.type == "cuda":
                torch.cuda.synchronize(info.device)
            forwards = time.perf_counter() - start
            pipeline.mark_forwards_end()
        except BaseException:
            pipeline.close(failed=True)  # its own failure, if any, is the one raised
            raise
        finally:
            pipeline.close()
    return done, time.perf_counter() - start, forwards


def _report(
    rank: int,
    tokens: int,
    seconds: float,
    forwards: float,
    pipeline: PartPipeline,
    clock: ForwardClock,
    capture: LayerCapture,
) -> None:
    """What the rank's extraction took: its rate, the time after its last forward, the gaps
    between its forwards, and its compiled graphs."""
    log.info(
        "rank %d: %d tokens extracted in %.2f s (%.0f tok/s), target loading excluded; the "
        "forwards ended at %.2f s, the last writes and commit took %.2f s",
        rank,
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
        forwards,
        seconds - forwards,
    )
    if pipeline.end is not None:  # every commit succeeded, or close would have raised
        log.info("rank %d: %s", rank, describe_end(pipeline.end))
    log.info("rank %d: %s", rank, clock.take().describe())
    _report_graphs(rank, capture.layout)


def _my_units(info: RankInfo, job: Job) -> tuple[tuple[int, ...], bool]:
    """This rank's units, and whether it writes them: one model per rank takes every
    world-size-th unit; under a sharded layout each input group takes its share, and only the
    group's first rank writes (the others run the same forwards for their slices)."""
    if job.layout is None or not job.layout.sharded:
        return job.units[info.rank :: info.world_size], True
    group, writes = job.layout.group(info.rank)
    return job.units[group :: job.layout.groups], writes


def _report_graphs(rank: int, layout) -> None:  # noqa: ANN001
    """A compiled target makes its graphs in the start-up probe: any made since is a
    recompilation, which static shapes exist to prevent."""
    if getattr(layout, "compiled", False):
        extra = compiled_graphs() - layout.graphs_after_probe
        if extra:
            log.warning(
                "rank %d: the compiled target made %d more graphs during extraction (a "
                "recompilation: each costs seconds); please report it with the target's config",
                rank,
                extra,
            )
        else:
            log.info(
                "rank %d: %d compiled graphs, made in %.1f s before the first part; none since",
                rank,
                layout.graphs,
                layout.compile_s,
            )
