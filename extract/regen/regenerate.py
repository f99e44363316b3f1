"""`python -m extract.regen`: the target's own answers as training data.

A drafter learns the target's distribution only from the target's outputs, so the assistant
turns of a chat dataset are replaced, turn by turn, by the target's continuation (greedy unless
`--temperature`) of the conversation so far (system and user turns kept, earlier assistant
turns already replaced), until eos or `--max-new-tokens`. Output rows are OpenAI `messages` rows
plus `source_row` (the global row number) and `turns_at_limit` (indices of the messages cut by
`--max-new-tokens`).

Rows are cut into fixed chunks (`--rows-per-chunk`) spread over the ranks; each chunk is written
to `OUT.parts/chunk-NNNNNN.jsonl` and recorded in `OUT.parts/state.json` (see
`extract.regen.state`); OUT is the chunks concatenated in row order, replaced atomically at the
end. Chunk files are kept, so a later run with more rows only generates the new ones. SIGINT or
SIGTERM lets each process commit its chunk in progress, then stop (a second one: at once).

This module plans the run and drives one process per device; the generation itself is in
`extract.regen.generation`. With `--server URL` a running inference server generates instead
(`extract.regen.served`), and with `--engine vllm` vLLM in this process
(`extract.regen.engine`), into the same chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from extract.data import Rejected, RowIndex
from extract.regen.config import Chat, RegenConfig, RegenError, iter_chats
from extract.regen.driver import RegenStopped
from extract.regen.generation import BatchGenerator, regenerate_chats
from extract.regen.report import RowBar
from extract.regen.state import (
    DISK_FULL_RERUN,
    PROGRESS_DIR,
    Job,
    RegenState,
    commit_chunk,
    existing_state,
    finish_output,
    init_output,
    parts_dir,
    read_state,
)
from extract.regen.turns import THINKING_KWARGS
from shared.cli import to_json
from shared.dist import (
    DeviceSpec,
    RankInfo,
    barrier,
    broadcast_object,
    launch,
    parse_gpus,
    under_torchrun,
)
from shared.logs import setup_logging
from shared.progress import RankCounters
from shared.space import full_disk_stops
from shared.stopping import Stopped, StopRequest

log = logging.getLogger(__name__)


def rank_main(info: RankInfo, job: Job) -> None:
    """One process: load the target on its device, regenerate and commit its chunks."""
    setup_logging(info.rank, verbose=job.verbose)
    mine = job.chunks[info.rank :: info.world_size]
    if not mine:
        return
    if info.device.type == "cpu":
        # Share the cores the process may use (OMP_NUM_THREADS, or all) among the CPU ranks:
        # oversubscribed intra-op threads spin and run ~10x slower.
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))
    stop = StopRequest().install("finishing the chunk in progress, then stopping (again: at once)")
    try:
        gen = _generator(job, info)  # a signal while it loads: no chunk is started
        with full_disk_stops(job.parts, rerun=DISK_FULL_RERUN):  # a rank's: passed on as such
            done = _regenerate(info, job, mine, gen, stop)
    finally:
        stop.restore()
    if done < len(mine):
        raise Stopped(
            f"stopped by {stop.signal_name}: rank {info.rank} committed {done} of its "
            f"{len(mine)} chunks in this run"
        )


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


@dataclass(frozen=True)
class _Plan:
    settings: dict[str, Any]  # must match to resume
    config: dict[str, Any]  # the resolved options, recorded
    job: Job


def _rows(cfg: RegenConfig) -> tuple[RowIndex, int]:
    """The --data rows (their index, and how many to regenerate), with --data and --out
    checked: needs neither the target nor a server, so a bad path is said before either."""
    from extract.data import index_rows
    from extract.sources import check_table, source_kind, streams

    missing = [str(f) for f in cfg.data if not Path(f).exists()]
    if missing:
        raise RegenError(f"--data: no such file: {', '.join(missing)}")
    if problem := streams(cfg.data):
        raise RegenError(problem)
    for path in cfg.data:  # a folder, a DatasetDict or a table without a chat column: refused
        if source_kind(path) != "jsonl":
            check_table(path)
    if cfg.out.is_dir():
        raise RegenError(f"--out {cfg.out} is a folder; give a .jsonl file path")
    if any(cfg.out.resolve() == Path(f).resolve() for f in cfg.data):
        raise RegenError(f"--out {cfg.out} is one of the --data files")
    index = index_rows(list(cfg.data))
    total = sum(index.counts) if cfg.max_rows is None else min(sum(index.counts), cfg.max_rows)
    if total == 0:  # as extraction refuses it, before anything is loaded or written
        raise RegenError(f"--data: {', '.join(map(str, cfg.data))} holds no rows")
    return index, total


def _plan(cfg: RegenConfig, spec: DeviceSpec, rows: tuple[RowIndex, int]) -> _Plan:
    """Validate the request and work out its settings; writes nothing. With --server, the
    settings the server decides are left to `_served`: its model (None here), and the context
    length where --max-length is not given."""
    from transformers import AutoTokenizer

    from extract.data import source_fingerprint, template_fingerprint
    from extract.target import content_hash, read_config, text_config

    config = read_config(cfg.target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    except (OSError, ValueError) as e:
        raise RegenError(f"--target {cfg.target}: cannot load its tokenizer ({e})") from None
    index, total = rows
    max_length = cfg.max_length or text_config(config)["max_position_embeddings"]
    prints = template_fingerprint(tokenizer)
    settings = {
        "target_revision": content_hash(Path(cfg.target)),
        "tokenizer_sha256": prints["tokenizer"],
        "chat_template_sha256": prints["chat_template"],
        "sources_sha256": [source_fingerprint(f) for f in cfg.data],
        "decoding": "greedy" if cfg.sampling is None else {**cfg.sampling, "seed": cfg.seed},
        "dtype": "bfloat16" if spec.kind == "cuda" else "float32",
        "max_new_tokens": cfg.max_new_tokens,
        "max_length": max_length,
        "rows_per_chunk": cfg.rows_per_chunk,
    }
    # Keys only where they differ from the first version's runs, which stay resumable.
    if cfg.server is not None:  # the server's dtype is its own
        del settings["dtype"]
        settings.update(engine="server", server_model=None)
    elif cfg.engine != "hf":
        settings["engine"] = cfg.engine
    if cfg.thinking != "auto":
        settings["thinking"] = cfg.thinking
    job = Job(
        target=cfg.target,
        files=tuple(Path(f) for f in cfg.data),
        index=index,
        parts=parts_dir(cfg.out),
        rows_per_chunk=cfg.rows_per_chunk,
        total_rows=total,
        max_new_tokens=cfg.max_new_tokens,
        max_length=max_length,
        batch_size=cfg.batch_size,
        sampling=cfg.sampling,
        seed=cfg.seed,
        template_kwargs=THINKING_KWARGS[cfg.thinking],
        verbose=cfg.verbose,
    )
    resolved = {**to_json(cfg), "max_length": max_length, "total_rows": total}
    if cfg.server is not None or cfg.engine != "hf":
        resolved["concurrency"] = cfg.in_flight
    return _Plan(settings=settings, config=resolved, job=job)


def _torchrun_entry(info: RankInfo, cfg: RegenConfig, plan: _Plan) -> None:
    """Torchrun path: rank 0 checks and prepares the output and hands out the work (or its
    refusal, raised on every rank); rank 0 merges."""
    pending: tuple[int, ...] | RegenError | None = None
    if info.is_main:
        try:
            resume = existing_state(cfg.out, plan.settings, overwrite=cfg.overwrite)
            pending = plan.job.pending(init_output(cfg.out, plan.settings, plan.config, resume))
        except RegenError as e:
            pending = e
    pending = broadcast_object(pending)
    if isinstance(pending, RegenError):
        raise pending
    job = dataclasses.replace(plan.job, chunks=pending)
    rank_main(info, job)
    barrier()
    if info.is_main:
        finish_output(cfg.out, job, regenerated=bool(job.chunks))
    barrier()  # every rank returns the final state


def run(cfg: RegenConfig) -> RegenState:
    """Regenerate the assistant turns described by `cfg`; returns the final state. What needs
    no target (--data, --out, --gpus) is checked before the target is materialized, and all
    that needs no server before a --server is contacted."""
    from extract.target import TargetError

    if not cfg.data:  # the embedded demo, as in `python -m extract`
        from extract.data import demo_dataset

        cfg = dataclasses.replace(cfg, data=(demo_dataset(),))
    if cfg.engine == "vllm" and under_torchrun():
        raise RegenError("--engine vllm: vLLM starts its own processes; run without torchrun")
    try:
        spec = parse_gpus(cfg.gpus)
        rows = _rows(cfg)
        cfg = dataclasses.replace(cfg, target=_target(cfg.target))
        plan = _plan(cfg, spec, rows)
    except (TargetError, ValueError) as e:  # ModelError and SourceError are ValueErrors
        raise RegenError(str(e)) from None
    if cfg.server is not None:
        return _served(cfg, plan)
    if cfg.engine == "vllm":
        from extract.regen.engine import generate

        if cfg.gpus is None and spec.kind == "cuda":  # tensor parallel only where asked for
            spec = DeviceSpec("cuda", spec.devices[:1])
        return generate(cfg, plan.settings, plan.config, plan.job, spec)
    if under_torchrun():
        with _stops_said(plan.job):
            launch(_torchrun_entry, (cfg, plan), spec)
        return read_state(plan.job.parts)
    resume = existing_state(cfg.out, plan.settings, overwrite=cfg.overwrite)
    spawned = spec.nprocs > 1
    state = init_output(cfg.out, plan.settings, plan.config, resume)
    job = dataclasses.replace(plan.job, chunks=plan.job.pending(state), draw_bar=not spawned)
    log.info("%s: %d of %d chunks to do on %s", cfg.out, len(job.chunks), job.num_chunks, spec)
    if job.chunks:
        bar = RowBar(job.parts / PROGRESS_DIR, total=job.pending_rows) if spawned else None
        try:
            with _stops_said(job):
                launch(rank_main, (job,), spec, monitor=bar.refresh if bar else None)
        finally:
            if bar is not None:
                bar.close()
    return finish_output(cfg.out, job, regenerated=bool(job.chunks))


def _target(target: str | None) -> str:
    """The folder of `target`: a named real target materialized (on first use), None the
    embedded tiny demo target."""
    if target is None:
        from extract.tiny import tiny_target

        return str(tiny_target())
    from extract.models import resolve_target

    return resolve_target(target)


def _served(cfg: RegenConfig, plan: _Plan) -> RegenState:
    """The --server route: --out refused before the server is contacted wherever the settings
    known without it already differ from its own, then the server's model and context length
    completing the plan."""
    from extract.regen.served import connect, serve

    decided = {"server_model"} if cfg.max_length else {"server_model", "max_length"}
    existing_state(cfg.out, plan.settings, overwrite=cfg.overwrite, unknown=decided)
    client, (model, length) = connect(cfg)
    max_length = cfg.max_length or length or plan.job.max_length
    settings = {**plan.settings, "max_length": max_length, "server_model": model}
    config = {**plan.config, "max_length": max_length}
    job = dataclasses.replace(plan.job, max_length=max_length)
    return serve(cfg, settings, config, job, client)


@contextlib.contextmanager
def _stops_said(job: Job) -> Iterator[None]:
    """A stop of the ranks (Stopped, or KeyboardInterrupt: a second Ctrl-C) as RegenStopped,
    saying what the run kept and how to resume it."""
    try:
        yield
    except (Stopped, KeyboardInterrupt) as e:
        why = str(e) if isinstance(e, Stopped) else "stopped at once (its chunk dropped)"
        left = job.pending(read_state(job.parts))
        rows = sum(len(job.chunk_rows(c)) for c in left)
        raise RegenStopped(
            f"{why}. The committed chunks are kept in {job.parts}; {len(left)} chunks ({rows:,} "
            "rows) are still to do: run the same command to resume."
        ) from None
