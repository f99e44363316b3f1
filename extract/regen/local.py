"""The local route of `python -m extract.regen`: the target loaded with Hugging Face
transformers in one process per device (this one, several spawned by `--gpus`, or torchrun's
ranks), each regenerating its share of the pending chunks (`extract.regen.generation`) and
committing them.

Nothing is written before every rank holds its target: what is to do is read from the output as
it is (`extract.regen.driver.to_do`), the ranks with chunks load the target, all ranks agree
that all of them loaded (a failure on any, or a signal while they loaded, stops every rank with
one message), and only then does rank 0 prepare the output (under --overwrite: replace it) while
the others wait, unless a signal reached it since (then every rank stops with that message). An
output with nothing to do is resumed without loading the target.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from extract.data import Rejected
from extract.regen.config import Chat, RegenConfig, RegenError, iter_chats
from extract.regen.driver import prepare, to_do
from extract.regen.generation import BatchGenerator, regenerate_chats
from extract.regen.job import Job, finish_output
from extract.regen.report import RowBar
from extract.regen.state import DISK_FULL_RERUN, PROGRESS_DIR, RegenState, commit_chunk, read_state
from extract.regen.stops import (
    BEFORE_PREPARING,
    WHILE_LOADING,
    WHILE_PREPARING,
    resumed_complete,
    stop_while_planning,
    stopped_before_any_chunk,
    stops_said,
)
from extract.stops import prepared_unless_stopped
from extract.target import load_failure
from shared.dist import (
    DeviceSpec,
    RankInfo,
    all_gather_objects,
    barrier,
    broadcast_object,
    launch,
    under_torchrun,
)
from shared.logs import setup_logging
from shared.progress import RankCounters, counter_files
from shared.space import full_disk_stops
from shared.stopping import Stopped, StopRequest, StopRun

log = logging.getLogger(__name__)


class TargetNotLoaded(StopRun):
    """The target failed to load on a rank: raised on every rank, the output untouched."""


class OutputNotPrepared(StopRun):
    """Rank 0 could not prepare the output (a file there that cannot be removed, say, or a
    second signal while it removed an old one): raised on every rank."""


# What the first stop signal starts, in words: before the output is prepared, and after.
STOPPING_BEFORE_ANY_CHUNK = "stopping once the target has loaded, before any chunk (again: at once)"
STOPPING_AFTER_THE_CHUNK = "finishing the chunk in progress, then stopping (again: at once)"
# What a second signal says (a rank started by hand raises KeyboardInterrupt on it).
AT_ONCE = "stopped at once (its chunk dropped)"


def generate(
    cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job, spec: DeviceSpec
) -> RegenState:
    """The local run on `spec` (or torchrun's ranks): the pending chunks regenerated, merged."""
    try:
        if under_torchrun():
            with stops_said(job, settings, at_once=AT_ONCE):
                launch(_torchrun_entry, (cfg, settings, config, job), spec)
            return read_state(job.parts)
        spawned = spec.nprocs > 1
        with stop_while_planning(cfg.out):
            job = dataclasses.replace(job, chunks=to_do(cfg, settings, job), draw_bar=not spawned)
        if not job.chunks:  # complete: no target to load
            return resumed_complete(cfg, settings, config, job, where=str(spec))
        bar = None
        if spawned:  # the earlier run's counters stay until rank 0 prepares the output
            folder = job.parts / PROGRESS_DIR
            bar = RowBar(folder, total=job.pending_rows, earlier=counter_files(folder))
        try:
            with stops_said(job, settings, at_once=AT_ONCE):
                args = (cfg, settings, config, job)
                launch(rank_main, args, spec, monitor=bar.refresh if bar else None)
        finally:
            if bar is not None:
                bar.close()
    except (TargetNotLoaded, OutputNotPrepared) as e:
        raise RegenError(str(e)) from None
    return finish_output(cfg.out, job, regenerated=True)


def _torchrun_entry(
    info: RankInfo, cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job
) -> None:
    """Torchrun path: rank 0 reads what is to do (or its refusal, raised on every rank), the
    ranks regenerate it; rank 0 merges."""
    pending: tuple[int, ...] | RegenError | None = None
    if info.is_main:
        try:
            pending = to_do(cfg, settings, job)
        except RegenError as e:
            pending = e
    pending = broadcast_object(pending)
    if isinstance(pending, RegenError):
        raise pending
    job = rank_main(info, cfg, settings, config, dataclasses.replace(job, chunks=pending))
    barrier()
    if info.is_main:  # the ranks' handlers gone: a Ctrl-C here is a first one, no chunk dropped
        with stops_said(job, settings):
            finish_output(cfg.out, job, regenerated=bool(job.chunks))
    barrier()  # every rank returns the final state


def rank_main(
    info: RankInfo, cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job
) -> Job:
    """One process: its target loaded where `job.chunks` (the chunks to do) gives it some;
    every rank loaded, the output prepared (rank 0) and its chunks regenerated and committed.
    The prepared job."""
    setup_logging(info.rank, verbose=job.verbose)
    mine = job.chunks[info.rank :: info.world_size]
    if mine and info.device.type == "cpu":
        # Share the cores the process may use (OMP_NUM_THREADS, or all) among the CPU ranks:
        # oversubscribed intra-op threads spin and run ~10x slower.
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))
    stop = StopRequest().install(STOPPING_BEFORE_ANY_CHUNK)
    try:
        gen = _loaded(info, job, mine, stop, cfg)
        job = _prepared(info, cfg, settings, config, job, stop)
        stop.what = STOPPING_AFTER_THE_CHUNK
        with full_disk_stops(job.parts, rerun=DISK_FULL_RERUN):  # a rank's: passed on as such
            done = _regenerate(info, job, mine, gen, stop) if gen is not None else 0
    finally:
        stop.restore()
    if done < len(mine):
        raise Stopped(
            f"stopped by {stop.signal_name}: rank {info.rank} committed {done} of its "
            f"{len(mine)} chunks in this run"
        )
    return job


def _loaded(
    info: RankInfo, job: Job, mine: tuple[int, ...], stop: StopRequest, cfg: RegenConfig
) -> BatchGenerator | None:
    """This rank's target (None where it has no chunk), once all ranks have loaded theirs: a
    failure on any (memory, damaged weights, an unsupported model, a missing device) raises
    TargetNotLoaded on every rank with the first failing rank's message, and a signal while
    they loaded Stopped, before the output is touched. A second signal in a process started
    by hand (KeyboardInterrupt) ends the load at once."""
    gen, failure = None, None
    if mine:
        try:
            gen = _generator(job, info)
        except KeyboardInterrupt:
            raise stopped_before_any_chunk("at once by a second signal", WHILE_LOADING) from None
        except Exception as e:  # whatever it is, the other ranks must hear of it
            log.debug("rank %d: the target did not load", info.rank, exc_info=True)
            failure = load_failure(job.target, info.device, e)
    ranks = all_gather_objects((failure, stop.signal_name if stop.requested else None))
    failures = [f for f, _ in ranks if f is not None]
    if failures:
        many = f" ({len(failures)} of {info.world_size} ranks)" if info.world_size > 1 else ""
        raise TargetNotLoaded(f"{failures[0]}{many}; --out {cfg.out} was not touched")
    signals = [s for _, s in ranks if s is not None]
    if signals:
        raise stopped_before_any_chunk(f"by {signals[0]}", WHILE_LOADING)
    return gen


def _prepared(
    info: RankInfo,
    cfg: RegenConfig,
    settings: dict[str, Any],
    config: dict[str, Any],
    job: Job,
    stop: StopRequest,
) -> Job:
    """The output prepared or resumed by rank 0 (`extract.regen.driver.prepare`) while the
    other ranks wait, unless a signal reached it since all loaded (the output it would replace
    then stays); its refusal or that stop raised on every rank."""
    where = str(info.device) if info.world_size == 1 else f"{info.world_size} ranks"
    return prepared_unless_stopped(
        info.is_main,
        functools.partial(_prepare_or_say_why, cfg, settings, config, job, where=where),
        signal_name=stop.signal_name,
        stopped=lambda name: stopped_before_any_chunk(f"by {name}", BEFORE_PREPARING),
    )


def _prepare_or_say_why(
    cfg: RegenConfig, settings: dict[str, Any], config: dict[str, Any], job: Job, *, where: str
) -> Job:
    """`prepare`; its refusal raised as OutputNotPrepared (a spawned rank passes on a StopRun
    only), a full disk as DiskFull, and a second signal in a process started by hand
    (KeyboardInterrupt; one while an old output is removed is a refusal) as Stopped saying
    that it came while the output was prepared."""
    try:
        return prepare(cfg, settings, config, job, where=where)
    except RegenError as e:
        raise OutputNotPrepared(str(e)) from None
    except KeyboardInterrupt:
        raise stopped_before_any_chunk("at once by a second signal", WHILE_PREPARING) from None


def _regenerate(
    info: RankInfo, job: Job, mine: tuple[int, ...], gen: BatchGenerator, stop: StopRequest
) -> int:
    """Regenerate and commit the chunks `mine` in turn until `stop`; how many were committed."""
    counters = RankCounters(job.parts / PROGRESS_DIR, info.rank)
    bar = RowBar(counters.path.parent, total=job.pending_rows) if job.draw_bar else None
    bar = bar if info.is_main else None

    def progress(rows: int, new_tokens: int) -> None:
        counters.add(rows=rows, new_tokens=new_tokens)
        if bar is not None:
            bar.refresh()

    log.info("rank %d: %d chunks on %s", info.rank, len(mine), info.device)
    done = 0
    try:
        for chunk in mine:
            if stop.requested:
                break
            rows = job.chunk_rows(chunk)
            items = list(iter_chats(job.files, rows, job.index))
            bad = [x for x in items if isinstance(x, Rejected)]
            progress(len(bad), 0)
            chats = [x for x in items if isinstance(x, Chat)]
            if job.sampling:  # one draw per chunk: the same answers after a resume
                torch.manual_seed(job.seed + chunk)
            result = regenerate_chats(chats, gen, batch_size=job.batch_size, progress=progress)
            result.rejected = sorted([*bad, *result.rejected], key=lambda r: r.row)
            commit_chunk(job.parts, chunk, rows, result)
            counters.flush()
            done += 1
    finally:
        counters.close()
        if bar is not None:
            bar.close()
    return done


def _generator(job: Job, info: RankInfo) -> BatchGenerator:
    """The target of one process on its device, with the chat template's prompter."""
    from transformers import AutoTokenizer

    from extract.target import load_target, read_config, text_config

    tokenizer = AutoTokenizer.from_pretrained(job.target)
    prompter = job.prompter(tokenizer)
    layers = int(text_config(read_config(job.target))["num_hidden_layers"])
    model = load_target(job.target, device=info.device, last_layer=layers - 1)
    return BatchGenerator(model, prompter, sampling=job.sampling)
