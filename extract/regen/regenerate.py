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

This module plans the run and hands it to its route: locally, one process per device
(`extract.regen.local`; the generation itself is in `extract.regen.generation`), a running
inference server with `--server URL` (`extract.regen.served`), or vLLM in this process with
`--engine vllm` (`extract.regen.engine`), all into the same chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from extract.data import RowIndex
from extract.regen import local
from extract.regen.config import RegenConfig, RegenError
from extract.regen.job import Job
from extract.regen.state import RegenState, existing_state, parts_dir
from extract.regen.stops import WHILE_CONTACTING, signals_stop, stop_while_planning, stops_said
from extract.regen.turns import THINKING_KWARGS
from shared.cli import to_json
from shared.dist import DeviceSpec, parse_gpus, under_torchrun

log = logging.getLogger(__name__)


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


def run(cfg: RegenConfig) -> RegenState:
    """Regenerate the assistant turns described by `cfg`; returns the final state. What needs
    no target (--data, --out, --gpus) is checked before the target is materialized, and all
    that needs no server before a --server is contacted. Ctrl-C or SIGTERM while it is planned
    (the rows indexed, the target's settings read) stops it saying that nothing was written;
    after that, where no handler of its route's own takes them (between them, or as the output
    is merged), saying what the output holds."""
    with stop_while_planning(cfg.out):
        cfg, spec, plan = _planned(cfg)
    with stops_said(plan.job, plan.settings, unknown=_server_decides(cfg)):
        if cfg.server is not None:
            return _served(cfg, plan)
        if cfg.engine == "vllm":
            from extract.regen.engine import generate

            if cfg.gpus is None and spec.kind == "cuda":  # tensor parallel only where asked for
                spec = DeviceSpec("cuda", spec.devices[:1])
            return generate(cfg, plan.settings, plan.config, plan.job, spec)
        return local.generate(cfg, plan.settings, plan.config, plan.job, spec)


def _planned(cfg: RegenConfig) -> tuple[RegenConfig, DeviceSpec, _Plan]:
    """`cfg` with its --data (the demo's where none is given) and its target's folder, its
    devices and its plan."""
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
        return cfg, spec, _plan(cfg, spec, rows)
    except (TargetError, ValueError) as e:  # ModelError and SourceError are ValueErrors
        raise RegenError(str(e)) from None


def _target(target: str | None) -> str:
    """The folder of `target`: a named real target materialized (on first use), None the
    embedded tiny demo target."""
    if target is None:
        from extract.tiny import tiny_target

        return str(tiny_target())
    from extract.models import resolve_target

    return resolve_target(target)


def _server_decides(cfg: RegenConfig) -> frozenset[str]:
    """The settings that a --server run learns from its server: its model, and its context
    length where --max-length is not given; none on the other routes."""
    if cfg.server is None:
        return frozenset()
    return frozenset({"server_model"} if cfg.max_length else {"server_model", "max_length"})


def _served(cfg: RegenConfig, plan: _Plan) -> RegenState:
    """The --server route: --out refused before the server is contacted wherever the settings
    known without it already differ from its own, then the server's model and context length
    completing the plan. Ctrl-C or SIGTERM while the output's state is read says, as where it
    is planned, that nothing was written; while the server is first contacted, that the run
    stopped then and what the output holds."""
    from extract.regen.served import connect, serve

    decided = _server_decides(cfg)
    with stop_while_planning(cfg.out):
        existing_state(cfg.out, plan.settings, overwrite=cfg.overwrite, unknown=decided)
    with signals_stop(WHILE_CONTACTING):
        client, (model, length) = connect(cfg)
    max_length = cfg.max_length or length or plan.job.max_length
    settings = {**plan.settings, "max_length": max_length, "server_model": model}
    config = {**plan.config, "max_length": max_length}
    job = dataclasses.replace(plan.job, max_length=max_length)
    return serve(cfg, settings, config, job, client)
