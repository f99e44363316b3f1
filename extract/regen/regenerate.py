"""`python -m extract.regen`: the target's own greedy answers as training data.

A drafter learns the target's distribution only from the target's outputs, so the assistant
turns of a chat dataset are replaced, turn by turn, by the target's greedy continuation of the
conversation so far (system and user turns kept, earlier assistant turns already replaced),
until eos or `--max-new-tokens`. Output rows are OpenAI `messages` rows plus `source_row` (the
global row number) and `turns_at_limit` (indices of the messages cut by `--max-new-tokens`).

Rows are cut into fixed chunks (`--rows-per-chunk`) spread over the ranks; each chunk is written
to `OUT.parts/chunk-NNNNNN.jsonl` and recorded in `OUT.parts/state.json` (see
`extract.regen.state`); OUT is the chunks concatenated in row order, replaced atomically at the
end. Chunk files are kept, so a later run with more rows only generates the new ones.

This module plans the run and drives one process per device; the generation itself is in
`extract.regen.generation`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from extract.data import Rejected, RowIndex
from extract.regen.config import Chat, RegenConfig, RegenError, iter_chats
from extract.regen.generation import GreedyGenerator, regenerate_chats
from extract.regen.report import RowBar
from extract.regen.state import (
    PROGRESS_DIR,
    RegenState,
    chunk_rows,
    commit_chunk,
    existing_state,
    init_output,
    merge_chunks,
    parts_dir,
    pending_chunks,
    read_state,
    update_state,
)
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

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """What every process needs; picklable, identical on all ranks."""

    target: str
    files: tuple[Path, ...]
    index: RowIndex  # seek points into `files`, so a rank reads only its rows
    parts: Path
    rows_per_chunk: int
    total_rows: int
    max_new_tokens: int
    max_length: int | None
    batch_size: int
    chunks: tuple[int, ...] = ()  # pending chunks, sorted; rank r takes chunks[r::world]
    draw_bar: bool = True  # rank 0 draws the bar itself (no launching parent to do it)
    verbose: bool = False

    @property
    def num_chunks(self) -> int:
        return -(-self.total_rows // self.rows_per_chunk)

    def chunk_rows(self, chunk: int) -> range:
        return chunk_rows(chunk, rows_per_chunk=self.rows_per_chunk, total_rows=self.total_rows)

    def pending(self, state: RegenState) -> tuple[int, ...]:
        return pending_chunks(
            state, self.parts, rows_per_chunk=self.rows_per_chunk, total_rows=self.total_rows
        )

    @property
    def pending_rows(self) -> int:
        return sum(len(self.chunk_rows(c)) for c in self.chunks)


def rank_main(info: RankInfo, job: Job) -> None:
    """One process: load the target on its device, regenerate and commit its chunks."""
    setup_logging(info.rank, verbose=job.verbose)
    mine = job.chunks[info.rank :: info.world_size]
    if not mine:
        return
    from transformers import AutoTokenizer

    from extract.target import load_target, read_config, text_config

    if info.device.type == "cpu":
        # Share the cores the process may use (OMP_NUM_THREADS, or all) among the CPU ranks:
        # oversubscribed intra-op threads spin and run ~10x slower.
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))
    tokenizer = AutoTokenizer.from_pretrained(job.target)
    layers = int(text_config(read_config(job.target))["num_hidden_layers"])
    model = load_target(job.target, device=info.device, last_layer=layers - 1)
    gen = GreedyGenerator(
        model, tokenizer, max_new_tokens=job.max_new_tokens, max_length=job.max_length
    )
    counters = RankCounters(job.parts / PROGRESS_DIR, info.rank)
    bar = RowBar(counters.path.parent, total=job.pending_rows) if job.draw_bar else None
    bar = bar if info.is_main else None

    def progress(rows: int, new_tokens: int) -> None:
        counters.add(rows=rows, new_tokens=new_tokens)
        if bar is not None:
            bar.refresh()

    log.info("rank %d: %d chunks on %s", info.rank, len(mine), info.device)
    try:
        for chunk in mine:
            rows = job.chunk_rows(chunk)
            items = list(iter_chats(job.files, rows, job.index))
            bad = [x for x in items if isinstance(x, Rejected)]
            progress(len(bad), 0)
            chats = [x for x in items if isinstance(x, Chat)]
            result = regenerate_chats(chats, gen, batch_size=job.batch_size, progress=progress)
            result.rejected = sorted([*bad, *result.rejected], key=lambda r: r.row)
            commit_chunk(job.parts, chunk, rows, result)
            counters.flush()
    finally:
        counters.close()
        if bar is not None:
            bar.close()


@dataclass(frozen=True)
class _Plan:
    settings: dict[str, Any]  # must match to resume
    config: dict[str, Any]  # the resolved options, recorded
    job: Job


def _plan(cfg: RegenConfig, spec: DeviceSpec) -> _Plan:
    """Validate the request and work out its settings; writes nothing."""
    from transformers import AutoTokenizer

    from extract.data import index_rows, source_fingerprint, template_fingerprint
    from extract.sources import check_table, source_kind
    from extract.target import content_hash, read_config, text_config

    config = read_config(cfg.target)
    missing = [str(f) for f in cfg.data if not Path(f).exists()]
    if missing:
        raise RegenError(f"--data: no such file: {', '.join(missing)}")
    for path in cfg.data:  # a folder, a DatasetDict or a table without a chat column: refused
        if source_kind(path) != "jsonl":
            check_table(path)
    if cfg.out.is_dir():
        raise RegenError(f"--out {cfg.out} is a folder; give a .jsonl file path")
    if any(cfg.out.resolve() == Path(f).resolve() for f in cfg.data):
        raise RegenError(f"--out {cfg.out} is one of the --data files")
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    except (OSError, ValueError) as e:
        raise RegenError(f"--target {cfg.target}: cannot load its tokenizer ({e})") from None
    index = index_rows(list(cfg.data))
    total = sum(index.counts) if cfg.max_rows is None else min(sum(index.counts), cfg.max_rows)
    max_length = cfg.max_length or text_config(config).get("max_position_embeddings")
    prints = template_fingerprint(tokenizer)
    settings = {
        "target_revision": content_hash(Path(cfg.target)),
        "tokenizer_sha256": prints["tokenizer"],
        "chat_template_sha256": prints["chat_template"],
        "sources_sha256": [source_fingerprint(f) for f in cfg.data],
        "decoding": "greedy",
        "dtype": "bfloat16" if spec.kind == "cuda" else "float32",
        "max_new_tokens": cfg.max_new_tokens,
        "max_length": max_length,
        "rows_per_chunk": cfg.rows_per_chunk,
    }
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
        verbose=cfg.verbose,
    )
    resolved = {**to_json(cfg), "max_length": max_length, "total_rows": total}
    return _Plan(settings=settings, config=resolved, job=job)


def _finish(out: Path, job: Job, *, regenerated: bool) -> RegenState:
    state = read_state(job.parts)
    left = job.pending(state)
    if left:
        log.error("%d chunks are not done (first: %d); run again to resume", len(left), left[0])
        return state
    if regenerated or state.merged_rows != job.total_rows or not out.is_file():
        merge_chunks(out, job.parts, job.num_chunks)
        state = update_state(
            job.parts, lambda s: dataclasses.replace(s, merged_rows=job.total_rows)
        )
        log.info("wrote %s: rows 0..%d of the source", out, job.total_rows - 1)
    return state


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
        _finish(cfg.out, job, regenerated=bool(job.chunks))
    barrier()  # every rank returns the final state


def run(cfg: RegenConfig) -> RegenState:
    """Regenerate the assistant turns described by `cfg`; returns the final state."""
    from extract.target import TargetError

    if cfg.target is not None:  # a named real target is materialized on first use
        from extract.models import ModelError, resolve_target

        try:
            cfg = dataclasses.replace(cfg, target=resolve_target(cfg.target))
        except ModelError as e:
            raise RegenError(str(e)) from None
    if cfg.target is None or not cfg.data:  # the embedded demo, as in `python -m extract`
        from extract.data import demo_dataset
        from extract.tiny import tiny_target

        target = cfg.target if cfg.target is not None else str(tiny_target())
        cfg = dataclasses.replace(cfg, target=target, data=cfg.data or (demo_dataset(),))
    try:
        spec = parse_gpus(cfg.gpus)
        plan = _plan(cfg, spec)
    except (TargetError, ValueError) as e:
        raise RegenError(str(e)) from None
    if under_torchrun():
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
            launch(rank_main, (job,), spec, monitor=bar.refresh if bar else None)
        finally:
            if bar is not None:
                bar.close()
    return _finish(cfg.out, job, regenerated=bool(job.chunks))
