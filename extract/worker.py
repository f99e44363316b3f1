"""One extract process: its share of the work units, the target, and its part pipeline."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable
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
from extract.units import reader_reading_ahead, run_units
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


def rank_main(info: RankInfo, job: Job, prepare: Callable[[], object] | None = None) -> None:
    """One process: its units extracted. `prepare` (the output cleared and begun anew, where
    --out holds a cache to replace) is run by rank 0 once every rank holds its target, the
    others waiting: a target that does not load, or a stop signal before then, leaves that
    cache as it was."""
    setup_logging(info.rank, verbose=job.verbose)
    if info.device.type == "cpu":
        # Respects OMP_NUM_THREADS; several CPU ranks share the cores.
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))
    sharded = job.layout is not None and job.layout.sharded
    if sharded and info.world_size == 1:
        one_rank_group(info)
    mine, writes = _my_units(info, job)
    stop = StopRequest().install(STOPPING_ONCE_LOADED)
    reached = Reached()
    try:
        _load_and_extract(info, job, prepare, stop, mine, writes, sharded=sharded, reached=reached)
    except KeyboardInterrupt:  # a second signal in a process started by hand: where it was
        raise stopped_at_once(
            job.out,
            reached.stage,
            replaces=prepare is not None,
            before=job.done_before,
            now=reached.committed,
        ) from None
    finally:
        stop.restore()


def _load_and_extract(
    info: RankInfo,
    job: Job,
    prepare: Callable[[], object] | None,
    stop: StopRequest,
    mine: tuple[int, ...],
    writes: bool,
    *,
    sharded: bool,
    reached: Reached,
) -> None:
    """`rank_main`'s work, with the stop signals going to `stop`: a signal while the target
    loads stops every rank once all have loaded, before --out is prepared; one after, between
    parts. `reached` follows how far it got."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job.target)
    read = reader_reading_ahead(job, tokenizer, mine)
    replaces = prepare is not None
    model = _loaded(info, job, stop, sharded=sharded, replaces=replaces)
    reached.stage = "preparing" if replaces else "loaded"
    _prepared(info, job, prepare, stop)
    reached.stage = "prepared"
    stop.what = "finishing the parts in progress, then stopping"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if job.store == "int4" and info.device.type == "cuda" and job.compile != "none":
        # Before the target's start-up probe, which counts the graphs made after it as
        # recompilations. `--compile none` keeps the encoder eager too.
        seconds = prepare_encoder(model.config.get_text_config().hidden_size, info.device)
        log.info("rank %d: the int4 encoder compiled in %.1f s", info.rank, seconds)
    group = cpu_group() if sharded else None
    if sharded and info.is_main:
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
        sharded=Sharded(model, functools.partial(agree_max, group=group)) if sharded else None,
    )
    capture = LayerCapture(model, job.layer_ids, pad_id=pad, layout=layout, sharded=sharded)
    log.info("rank %d: the target runs %s", info.rank, capture.layout.describe())
    counters = reached.counters = RankCounters(job.progress_dir, info.rank)
    bar = None
    if job.draw_bar and info.is_main:
        bar = SummedBar(
            job.progress_dir,
            total=job.pending_rows,
            unit_key="done_rows",
            desc="extract",
            expected_tokens=job.expected_tokens,
        )
        counters.listener = bar.refresh
    threads = writer_threads(job, info)
    clock = ForwardClock(capture.body)  # after LayerCapture's mask probe
    lockstep = LockStep(group, stop) if sharded else None
    switch_interval = sys.getswitchinterval()
    try:
        pipeline = PartPipeline(
            job,
            info.device,
            capture,
            threads=threads,
            counters=counters,
            clock=clock,
            writes=writes,
            before_forward=lockstep.before_forward if lockstep is not None else None,
        )
        sys.setswitchinterval(job.switch_interval_s)
        log.info(
            "rank %d: %s on %s, %d writer threads, GIL switch interval %g ms",
            info.rank,
            f"{len(mine)} part{'s' if len(mine) != 1 else ''}",
            info.device,
            threads,
            sys.getswitchinterval() * 1e3,
        )
        start = time.perf_counter()
        reached.stage = "extracting"
        with disk_full_message(job):
            try:
                done = run_units(
                    pipeline,
                    mine,
                    read=read,
                    after_part=bar.refresh if bar is not None else None,
                    stop=lockstep or stop,
                )
                if lockstep is not None:
                    dummy = [np.full(1, pad, dtype=np.int64)]
                    lockstep.drain(lambda: capture.run(dummy, device=info.device))
                if info.device.type == "cuda":
                    torch.cuda.synchronize(info.device)
                forwards = time.perf_counter() - start
                pipeline.mark_forwards_end()
            except BaseException:
                pipeline.close(failed=True)  # its own failure, if any, is the one raised
                raise
            finally:
                pipeline.close()
        tokens, seconds = counters.counts["tokens"], time.perf_counter() - start
        _report_rate(info.rank, tokens, seconds, forwards)
        if pipeline.end is not None:  # every commit succeeded, or close would have raised
            log.info("rank %d: %s", info.rank, describe_end(pipeline.end))
        log.info("rank %d: %s", info.rank, clock.take().describe())
        _report_graphs(info.rank, capture.layout)
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
    if done < len(mine):
        signal_name = (lockstep or stop).signal_name
        raise Stopped(
            f"stopped by {signal_name}: rank {info.rank} committed {done} of its "
            f"{len(mine)} parts in this run, and no part was left half-written; rerun the same "
            "command to resume."
        )


def _loaded(
    info: RankInfo, job: Job, stop: StopRequest, *, sharded: bool, replaces: bool
) -> torch.nn.Module:
    """This rank's target, once every rank holds its own: a failure on any (memory, damaged
    weights, an unsupported model) raises TargetLoadFailed on every rank with the first failing
    rank's message, and a signal on any while they loaded Stopped. A sharded target is loaded
    by its ranks together, through collectives of transformers' own, so a rank that fails there
    raises at once: the others, waiting in a collective it never joins, are ended by the
    launcher and never agree that all loaded."""
    model, failure = None, None
    try:
        model = load_target(
            job.target,
            device=info.device,
            last_layer=max(job.layer_ids),
            sharding=engine_kwargs(job.layout) if sharded else None,
        )
    except Exception as e:  # whatever it is, the other ranks must hear of it
        log.debug("rank %d: the target did not load", info.rank, exc_info=True)
        failure = load_failure(job.target, info.device, e)
    report = (failure, stop.signal_name)
    ranks = [report] if sharded and failure else all_gather_objects(report)
    failures = [f for f, _ in ranks if f is not None]
    if failures:
        many = f" ({len(failures)} of {info.world_size} ranks)" if info.world_size > 1 else ""
        kept = f"; the cache in --out {job.out} was not touched" if replaces else ""
        raise TargetLoadFailed(f"{failures[0]}{many}{kept}")
    signals = [s for _, s in ranks if s is not None]
    if signals:
        raise stopped_while_loading(job.out, signals[0], replaces=replaces, before=job.done_before)
    return model


def _prepared(
    info: RankInfo, job: Job, prepare: Callable[[], object] | None, stop: StopRequest
) -> None:
    """`prepare` run by rank 0 while the other ranks wait, unless a signal reached it since
    all loaded (the cache to replace then stays); its failure or that stop raised on every
    rank."""
    prepared_unless_stopped(
        info.is_main,
        functools.partial(_prepare_or_say_why, job.out, prepare) if prepare is not None else None,
        signal_name=stop.signal_name,
        stopped=functools.partial(stopped_before_preparing, job.out),
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


def _my_units(info: RankInfo, job: Job) -> tuple[tuple[int, ...], bool]:
    """This rank's units, and whether it writes them: one model per rank takes every
    world-size-th unit; under a sharded layout each input group takes its share, and only the
    group's first rank writes (the others run the same forwards for their slices)."""
    if job.layout is None or not job.layout.sharded:
        return job.units[info.rank :: info.world_size], True
    group, writes = job.layout.group(info.rank)
    return job.units[group :: job.layout.groups], writes


def _report_rate(rank: int, tokens: int, seconds: float, forwards: float) -> None:
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
