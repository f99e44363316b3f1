"""`run(cfg)`: validate everything, prepare the output, launch one process per device, commit."""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from extract.config import ExtractConfig
from extract.data import RowIndex
from extract.estimate import CacheEstimate, SpaceError, check_space
from extract.fit import LOAD_TIMEOUT, layout_for
from extract.job import Job
from extract.outdir import (
    clear_cache,
    foreign_entries,
    listing,
    only_leftovers,
    part_entries,
    protected_reason,
    to_clear,
)
from extract.parallel import Layout, describe_engine, layout_record
from extract.plan import ExtractError, plan_manifest
from extract.rejects import nothing_kept
from extract.target import TargetError, write_target_files
from extract.worker import rank_main
from shared.cache import missing_or_resized
from shared.dist import (
    DEFAULT_TIMEOUT,
    DeviceSpec,
    RankInfo,
    barrier,
    launch,
    main_first,
    parse_gpus,
    takes_output_lock,
    under_torchrun,
)
from shared.fsio import atomic_write_json, os_error_text, remove_stale_tmp
from shared.lock import LockHeld, output_lock
from shared.manifest import (
    MANIFEST,
    CacheMismatch,
    Manifest,
    drop_parts,
    read_manifest,
    update_manifest,
    write_manifest,
)
from shared.manifest_checks import identity_mismatches
from shared.progress import counter_files
from shared.ranks import usable_cpus
from shared.space import used_bytes
from shared.stopping import resume_command
from shared.target_files import target_checksums, target_problems

log = logging.getLogger(__name__)
PROGRESS_DIR = ".progress"


def existing_state(cfg: ExtractConfig, planned: Manifest) -> Manifest | None:
    """The cache to resume, None for a fresh start; raises if --out holds something else.
    `--overwrite` replaces only a folder holding nothing but this tool's entries, and never the
    working directory or a folder holding the data or the target. A cache of other settings
    with no committed part (a start that failed before its first) is replaced without it."""
    out = cfg.out
    if not out.exists() or only_leftovers(out):
        return None
    if (out / MANIFEST).is_file():
        try:
            old = read_manifest(out)
        except CacheMismatch as e:
            old, problems = None, e.problems
        else:
            problems = identity_mismatches(old, planned)
        if not problems:
            return old
    else:
        old, problems = None, ["it holds no manifest.json"]
    foreign = foreign_entries(out)
    inputs = [Path(s.path) for s in planned.sources] + [Path(planned.target.path)]
    protected = protected_reason(out, inputs)
    if foreign or protected:
        why = protected or f"it holds files this tool did not write: {listing(foreign)}"
        raise ExtractError(
            f"--out {out} is not a cache this tool may replace: {why}.\n"
            "Choose a new or empty folder for --out (nothing was deleted)."
        )
    if cfg.overwrite:
        return None
    lines = "\n".join(f"  - {p}" for p in problems)
    if old is not None and not old.parts and not part_entries(out):
        # A start that failed before its first commit (a target that did not load): nothing
        # there to lose or to resume.
        log.info(
            "%s holds no committed part of the cache of other settings it records:\n%s\n"
            "starting it again with this run's",
            out,
            lines,
        )
        return None
    damaged = ("is not valid JSON", "is malformed")
    if any(d in p for p in problems for d in damaged):  # not another cache's: its record cut
        raise ExtractError(
            f"--out {out}: its {MANIFEST} cannot be read, so what its parts hold is unknown:\n"
            f"{lines}\nRestore {out / MANIFEST} (from a backup or a copy of the cache) and "
            "rerun the same command, or give --overwrite to extract the cache again."
        )
    raise ExtractError(
        f"--out {out} holds a different cache:\n{lines}\n"
        "Use the same settings to resume it, another --out, or --overwrite to replace it."
    )


def _init_output(cfg: ExtractConfig, planned: Manifest, resume: Manifest | None) -> None:
    if resume is None:
        clear_cache(cfg.out)
        cfg.out.mkdir(parents=True, exist_ok=True)
        _write_target(cfg.out, planned.target.path)
        write_manifest(
            cfg.out, dataclasses.replace(planned, target_files=target_checksums(cfg.out))
        )
    shutil.rmtree(cfg.out / PROGRESS_DIR, ignore_errors=True)
    for left in remove_stale_tmp(cfg.out):
        log.info("removed %s, left by a killed write", left)
    atomic_write_json(cfg.out / "extract_config.json", planned.config)


def _write_target(out: Path, target: str) -> None:
    from transformers import AutoTokenizer

    write_target_files(Path(target), AutoTokenizer.from_pretrained(target), out)


def checked_resume(out: Path, resume: Manifest, *, write: bool = True) -> Manifest:
    """The cache to resume after checking what it lists: `target/` is rewritten when it differs
    from its record (or has none), and parts that are missing or of another size are dropped
    from the manifest, so that this run extracts them again. With `write` False (the other
    ranks under torchrun) nothing is written: the same parts are dropped in memory only."""
    damaged = missing_or_resized(out, resume.parts)
    if not write:
        return drop_parts(resume, {p.split(":", 1)[0] for p in damaged})
    problems = target_problems(out, resume.target_files)
    if problems or not resume.target_files:
        for p in problems:
            log.warning("%s: %s: writing target/ again", out, p)
        _write_target(out, resume.target.path)
        files = target_checksums(out)
        resume = update_manifest(out, lambda m: dataclasses.replace(m, target_files=files))
    if damaged:
        for p in damaged:
            log.warning("%s: %s: extracting it again", out, p)
        names = {p.split(":", 1)[0] for p in damaged}
        resume = update_manifest(out, lambda m: drop_parts(m, names))
    return resume


def idle_ranks(spec: DeviceSpec, parts: int, *, sharded: bool) -> list[str]:
    """Warnings for processes that will wait rather than work: more than the parts to do (one
    model per process), or more CPU processes than usable cores."""
    out = []
    if not sharded and 0 < parts < spec.nprocs:
        out.append(
            f"{spec.nprocs} processes for {parts} parts to do: {spec.nprocs - parts} will have "
            "nothing to do (a smaller --rows-per-part makes more parts)"
        )
    cores = usable_cpus()
    if spec.kind == "cpu" and spec.nprocs > cores:
        out.append(
            f"--gpus cpu:{spec.nprocs} runs {spec.nprocs} processes on {cores} usable cores: "
            f"they share them, which is slower than cpu:{cores}"
        )
    return out


def _finalize(out: Path) -> Manifest:
    def close(m: Manifest) -> Manifest:
        done = m.done_units() >= set(range(m.num_units))
        # A cache without a single sample cannot train anything: never "complete".
        return dataclasses.replace(m, complete=done and m.totals()["rows_kept"] > 0)

    return update_manifest(out, close)


def _entry(
    info: RankInfo,
    job: Job,
    cfg: ExtractConfig,
    planned: Manifest,
    resume: Manifest | None,
    prepare: Callable[[], None] | None,
) -> None:
    """Torchrun path: rank 0 prepares the output while the others wait (a cache to replace:
    `prepare`, once every rank holds its target); rank 0 commits."""
    with main_first(info):
        if info.is_main and prepare is None:
            _init_output(cfg, planned, resume)
    rank_main(info, job, prepare)
    barrier()
    if info.is_main:
        _finalize(cfg.out)


def run(
    cfg: ExtractConfig, *, started: Callable[[tuple[int, ...]], object] | None = None
) -> Manifest:
    """Extract the cache described by `cfg`; returns the final manifest. `started(units)` is
    called once planning (and a resume's check of the parts there) is done and the extraction of
    `units`, the parts not yet committed, begins: the summary times the two, and rates this
    run's parts alone."""
    try:
        spec: DeviceSpec = parse_gpus(cfg.gpus)
        planned, index, estimate = plan_manifest(cfg)
        layout = layout_for(cfg, spec, planned)
    except (TargetError, ValueError) as e:
        raise ExtractError(str(e)) from None
    if layout.sharded:  # the resolved layout and what ran it, next to the request
        planned = dataclasses.replace(
            planned,
            config={**planned.config, "parallel": str(layout), "engine": describe_engine(layout)},
        )
    try:
        with output_lock(cfg.out, resume_command("extract"), enabled=takes_output_lock()):
            manifest = _run_locked(cfg, spec, planned, index, estimate, layout, started)
            if _kept_nothing(manifest):
                # Committed parts without a single sample: nothing worth keeping or resuming.
                if takes_output_lock():
                    clear_cache(cfg.out)
                t = manifest.totals()
                first = [r for p in manifest.parts for r in p.rejected_rows]
                raise ExtractError(
                    nothing_kept(t["rows_read"], t["rejected"], first, cfg.out, then="")
                )
    except (LockHeld, TargetError, SpaceError) as e:
        raise ExtractError(str(e)) from None
    except OSError as e:  # e.g. --out /proc/x as root: mkdir fails although "writable"
        raise ExtractError(os_error_text(e, cfg.out)) from None
    return manifest


def _kept_nothing(manifest: Manifest) -> bool:
    return len(manifest.parts) == manifest.num_units and manifest.totals()["rows_kept"] == 0


def _run_locked(
    cfg: ExtractConfig,
    spec: DeviceSpec,
    planned: Manifest,
    index: RowIndex,
    estimate: CacheEstimate,
    layout: Layout,
    started: Callable[[tuple[int, ...]], object] | None = None,
) -> Manifest:
    resume = existing_state(cfg, planned)
    if resume is not None:
        resume = checked_resume(cfg.out, resume, write=takes_output_lock())
    done = resume.done_units() if resume is not None else set()
    pending = tuple(u for u in range(planned.num_units) if u not in done)
    pending_rows = sum(len(planned.unit_rows(u)) for u in pending)
    log.info("estimate: %s", estimate.describe())
    if cfg.space_check and pending:
        # A fresh start deletes this tool's entries in --out (an --overwrite's old cache) first
        freed = sum(used_bytes(cfg.out / n) for n in to_clear(cfg.out)) if resume is None else 0
        log.info("space: %s", check_space(cfg.out, estimate, rows=pending_rows, freed=freed))
    spawned = spec.nprocs > 1 and not under_torchrun()
    job = Job(
        out=cfg.out,
        target=planned.target.path,
        files=tuple(Path(s.path) for s in planned.sources),
        index=index,
        layer_ids=planned.layer_ids,
        max_length=cfg.max_length,
        format=cfg.format,
        store=cfg.store,
        batch_tokens=cfg.batch_tokens,
        compile=cfg.compile,
        packing=cfg.packing,
        attention=cfg.attention,
        rows_per_part=cfg.rows_per_part,
        total_rows=planned.total_rows,
        units=pending,
        done_before=planned.num_units - len(pending),
        writer_threads=cfg.writer_threads,
        switch_interval_s=cfg.switch_interval_ms / 1e3,
        staging_buffers=cfg.staging_buffers,
        progress_dir=cfg.out / PROGRESS_DIR,
        draw_bar=not spawned,
        verbose=cfg.verbose,
        layout=layout if layout.sharded else None,
        layout_record=layout_record(layout) if layout.sharded else None,
        expected_tokens=round(estimate.tokens_per_row * pending_rows),
    )
    log.info(
        "%s: %d of %d parts to do, layers %s, %s",
        cfg.out,
        len(pending),
        planned.num_units,
        list(planned.layer_ids),
        spec,
    )
    for warning in idle_ranks(spec, len(pending), sharded=layout.sharded) if pending else []:
        log.warning(warning)
    if started is not None:
        started(pending)
    if not pending:  # nothing for a rank to do: the target is not loaded
        log.info(
            "every part is committed: `python -m extract.verify %s` checks them against their "
            "checksums (with --repair it drops damaged ones, and this command then redoes them)",
            cfg.out,
        )
        if not takes_output_lock():
            return read_manifest(cfg.out)
        _init_output(cfg, planned, resume)
        return _finalize(cfg.out)
    timeout = LOAD_TIMEOUT if layout.sharded else DEFAULT_TIMEOUT
    # A cache to clear (--overwrite, or one with no part of other settings) is cleared by rank
    # 0 only once every rank holds its target: one that does not load leaves it as it was.
    replaces = resume is None and bool(to_clear(cfg.out))
    prepare = functools.partial(_init_output, cfg, planned, resume) if replaces else None
    if under_torchrun():
        launch(_entry, (job, cfg, planned, resume, prepare), spec, timeout=timeout)
        return read_manifest(cfg.out)
    if prepare is None:
        _init_output(cfg, planned, resume)
    bar = None
    if spawned:
        # a cache to replace: rank 0 clears the counter files of the run that made it
        bar = job.bar(earlier=counter_files(job.progress_dir))
    try:
        monitor = bar.refresh if bar else None
        launch(rank_main, (job, prepare), spec, monitor=monitor, timeout=timeout)
    finally:
        if bar is not None:
            bar.close()
    return _finalize(cfg.out)
