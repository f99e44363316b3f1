"""`python -m extract.verify CACHE`: checksums, counts, and a re-run of the target on samples.

Exits non-zero on any mismatch, naming the part. Stored states are compared with a fresh forward
of the sample alone, layer by layer, by relative error ||stored - fresh|| / ||fresh||
(`extract.layer_check`). Storage rounds (bf16 keeps 8 mantissa bits: at least 2e-2 is allowed;
fp8 e4m3 keeps 3: 8e-2; int4 codes 16 levels: 0.15, see `TOLERANCE` there), and on a GPU a
forward of another batch shape rounds differently, by more at each layer: in a 64-layer bf16
model the states of one row in a batch and alone differ by 0.25% at layer 0 and 5.3% at layer 61
(`bench/verify_noise.py`, Qwen3.6-27B shape, random weights, H200). So verify also runs the
sample in other arrangements and measures how far those fresh forwards differ from it alone at
each layer: in a padded batch of extraction's size, and, where extraction on this device packs
rows (`--packing`, `--compile`: compiled on a GPU by default), in a packed row of the cache's
size run the same way. A stored layer may differ from the fresh one by `FLOOR_FACTOR` times the
larger difference, where that is more than the storage tolerance. A wrong row, target, layer or
mask moves the states by far more. (Packed rows are proven against rows alone when extraction
starts, `extract.layouts`, so this allowance never hides a wrong mask.)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import click

from extract.layer_check import compare_layers
from shared.lock import LockHeld, holder_running, output_lock, read_holder
from shared.manifest import (
    CacheMismatch,
    Manifest,
    PartRecord,
    drop_parts,
    read_manifest,
    repair_commands,
    update_manifest,
)
from shared.ranks import usable_cpus
from shared.stopping import resume_command

if TYPE_CHECKING:  # torch and the cache's readers are imported where they are used: `--help`
    import torch  # and a missing cache answer at once

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m
# The full batch: copies of the sample up to the cache's batch size, at most this many rows.
FLOOR_ROWS = 256


def check_parts(cache: Path, manifest: Manifest, threads: int | None = None) -> list[str]:
    """Checksums, decodability and counts of every listed part, in the manifest's order.

    Parts are checked on `threads` threads at once (default: the usable cores), and the chunks
    of each part on the cores left over (a cache of few large parts): the work is reading files,
    crc32c and decompression, which release the GIL, so a large cache is checked at the disk's
    or the cores' speed rather than one core's."""
    parts = manifest.parts
    cores = threads or usable_cpus()
    threads = max(1, min(len(parts), cores))
    shard_threads = max(1, cores // threads)  # few large parts: their chunks side by side
    done, lock = [0], threading.Lock()

    def one(rec: PartRecord) -> list[str]:
        problems = _check_part(cache, rec, shard_threads)
        with lock:
            done[0] += 1
            if done[0] % max(1, len(parts) // 10) == 0 or done[0] == len(parts):
                log.info("checked %d/%d parts", done[0], len(parts))
        return problems

    with ThreadPoolExecutor(threads, thread_name_prefix="verify") as pool:
        return [p for problems in pool.map(one, parts) for p in problems]


def _check_part(cache: Path, rec: PartRecord, shard_threads: int) -> list[str]:
    from shared.cache import open_part, verify_part

    path = cache / rec.name
    if not path.exists():
        return [f"{rec.name}: listed in the manifest but missing on disk"]
    problems = [f"{rec.name}: {p}" for p in verify_part(path, rec.checksum, threads=shard_threads)]
    try:
        reader = open_part(path)
    except (OSError, ValueError, KeyError) as e:
        # Said once: the chunk or member check's "cannot open" is this error in other words,
        # and what else it found (an array missing) says why already.
        opened = f"{rec.name}: cannot open: "
        kept = [p for p in problems if not p.startswith(opened)]
        said = [p for p in kept if not p.startswith(f"{rec.name}: checksum ")]
        return kept if said else [*kept, f"{rec.name}: cannot be opened ({e})"]
    if reader.num_samples != rec.rows_kept:
        problems.append(f"{rec.name}: {reader.num_samples} samples, manifest says {rec.rows_kept}")
    if int(reader.tokens) != rec.tokens:
        problems.append(f"{rec.name}: {reader.tokens} tokens, manifest says {rec.tokens}")
    return problems


def rerun_samples(
    cache: Path, manifest: Manifest, *, samples: int, seed: int, device: torch.device
) -> list[str]:
    """Re-run the target on `samples` random stored samples and compare the states."""
    import torch

    from extract.capture import LayerCapture
    from extract.target import load_target
    from shared.cache import open_part

    picks = [(rec, n) for rec in manifest.parts for n in range(rec.rows_kept)]
    picks = random.Random(seed).sample(picks, min(samples, len(picks)))
    if not picks:
        return []
    batch_tokens = int(manifest.config.get("batch_tokens", 16384))
    log.info(
        "re-running the target on %d stored samples on %s, each alone and in a batch of %s "
        "tokens (slow on a CPU; --samples 0 skips it)",
        len(picks),
        device,
        f"{batch_tokens:,}",
    )
    model = load_target(manifest.target.path, device=device, last_layer=max(manifest.layer_ids))
    # The model's own masks: an independent check of the premade ones extraction passes.
    capture = LayerCapture(model, manifest.layer_ids, own_masks=True)
    runs = []
    for i, (rec, n) in enumerate(picks):
        reader = open_part(cache / rec.name)
        # wds parts stream only: walk to sample n (numbered as its zarr twin, not in tar order).
        sample = (
            reader.read(n)
            if manifest.format == "zarr"
            else next(s for _, s in reader.iter_indexed(only={n}))
        )
        ids = sample.input_ids
        fresh = capture.run([ids], device=device).float().cpu()
        batched = capture.run(full_batch(ids, batch_tokens), device=device)[: len(ids)]
        runs.append((rec, n, sample, fresh, batched.float().cpu()))
        log.info("re-ran %d/%d samples", i + 1, len(picks))
    capture.close()
    packed = packed_runs(model, manifest, [r[2].input_ids for r in runs], device)
    problems = []
    for (rec, n, sample, fresh, batched), in_packed in zip(runs, packed, strict=True):
        check = compare_layers(
            sample.hidden_tensor(torch.device("cpu")).float(),
            fresh,
            batched,
            manifest.layer_ids,
            manifest.store,
            packed=in_packed,
            sharded=rec.layout is not None,
        )
        where = f"sample {n} (source row {sample.sample_index})"
        log.info("%s %s: %s", rec.name, where, check.summary())
        # "part: problem", as every other problem reads.
        problems += [
            f"{rec.name}: {where} differs from a fresh forward {p}" for p in check.problems
        ]
    return problems


def packed_runs(model, manifest: Manifest, samples: list, device: torch.device) -> list:  # noqa: ANN001
    """Each sample's states in a packed row of the cache's size filled with its copies, run as
    extraction runs packed rows on `device` (None each where it would not pack)."""
    import functools

    from extract.capture import LayerCapture
    from extract.layouts import choose_layout, forward_mode
    from extract.packing import chunk_size

    config = manifest.config
    compiled, packed = forward_mode(
        config.get("compile", "none"), config.get("packing", "off"), device.type
    )
    if not packed:
        return [None] * len(samples)
    chunk = chunk_size(int(config.get("batch_tokens", 16384)), manifest.max_length)
    attention = config.get("attention", "auto")
    layout = functools.partial(
        choose_layout,
        packed=True,
        compile_layers=compiled,
        chunk_tokens=chunk,
        pad_id=0,
        attention=None if attention == "auto" else attention,
    )
    capture = LayerCapture(model, manifest.layer_ids, layout=layout)
    try:
        if capture.layout.name != "packed":
            return [None] * len(samples)
        return [
            capture.run([ids] * max(1, chunk // len(ids)), device=device)[: len(ids)].float().cpu()
            for ids in samples
        ]
    finally:
        capture.close()
        if capture.layout.name == "packed":
            capture.layout.uninstall()


def _no_rerun(manifest: Manifest, device: torch.device) -> str | None:
    """Why the target cannot be re-run here (not found; too large for one `device`: the
    re-run loads it whole), or None."""
    from extract.fit import device_memory, plan_layout
    from extract.parallel import LayoutError

    target = Path(manifest.target.path)
    if not target.exists():
        return f"target {target} not found here"
    try:
        devices = (device.index or 0,) if device.type == "cuda" else (0,)
        memory = device_memory(device.type, devices)
        plan_layout(
            "none",
            target,
            num_layers=manifest.target.num_layers,
            world=1,
            device=device.type,
            memory=memory,
        )
    except LayoutError as e:
        return f"the re-run loads the whole target on {device}, which it does not fit ({e})"
    return None


def full_batch(ids, batch_tokens: int) -> list:  # noqa: ANN001
    """Copies of one sample's ids filling a batch of `batch_tokens` (2 to `FLOOR_ROWS` rows):
    the GPU runs the shapes of an extraction batch rather than of one row.

    >>> len(full_batch([1, 2, 3], 10)), len(full_batch([1, 2, 3], 4))
    (3, 2)
    """
    return [ids] * min(FLOOR_ROWS, max(2, batch_tokens // max(1, len(ids))))


def repair_manifest(cache: Path, problems: list[str]) -> str:
    """Drop the parts named in `problems` from the manifest, and mark the cache incomplete
    when `target/` is damaged: the extract command that wrote the cache then redoes exactly
    those (it rewrites a damaged `target/` on resume). Returns what was done, and that
    command, as a sentence."""
    from shared.target_files import TARGET_DIR

    names = {p.split(":", 1)[0] for p in problems if p.startswith("part-")}
    target_damaged = any(p.startswith(f"{TARGET_DIR}/") for p in problems)

    def change(m: Manifest) -> Manifest:
        m = drop_parts(m, names)
        return dataclasses.replace(m, complete=False) if target_damaged else m

    with output_lock(cache, resume_command("extract.verify")):
        manifest = update_manifest(cache, change)
    parts = f"{len(names)} damaged part{'s' * (len(names) != 1)}"
    done = f"dropped {parts} from the manifest" if names else ""
    if target_damaged:
        done += (", and " if done else "") + "marked target/ to be written again"
    return f"{done}: run `{manifest.extract_command(cache)}` to write them again"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("cache", type=click.Path(path_type=Path))
@click.option(
    "--samples",
    default=4,
    show_default=True,
    type=click.IntRange(min=0),
    help="Samples to re-run the target on (0: none).",
)
@click.option("--seed", default=0, show_default=True, help="Which samples.")
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present).")
@click.option(
    "--repair",
    is_flag=True,
    help="Drop damaged parts from the manifest, so that the extract command redoes them.",
)
def main(cache: Path, samples: int, seed: int, device: str | None, repair: bool) -> None:
    """Check every part of CACHE and its target/ files against its manifest; exit 1 on any
    mismatch."""
    from shared.logs import setup_logging
    from shared.target_files import target_problems

    setup_logging()
    from shared.dist import parse_device

    try:
        manifest = read_manifest(cache)
        dev = parse_device(device)  # before the parts are read: a typo is told at once
    except (CacheMismatch, ValueError) as e:
        raise click.ClickException(str(e)) from None
    damaged = target_problems(cache, manifest.target_files) + check_parts(cache, manifest)
    if repair and damaged:
        for p in damaged:
            click.echo(f"MISMATCH {p}", err=True)
        try:
            click.echo(f"repaired: {repair_manifest(cache, damaged)}")
        except LockHeld as e:
            raise click.ClickException(str(e)) from None
        sys.exit(1)
    problems, skipped = damaged + unfinished(cache, manifest), None
    if samples and not problems and (skipped := _no_rerun(manifest, dev)) is None:
        problems += _rerun(cache, manifest, samples=samples, seed=seed, device=dev)
    for p in problems:
        click.echo(f"MISMATCH {p}", err=True)
    parts, found = len(manifest.parts), len(problems)
    unchecked = "" if skipped is None else f"; the states not re-run: {skipped}"
    click.echo(
        f"{parts} part{'s' * (parts != 1)} checked, {found} problem{'s' * (found != 1)}{unchecked}"
    )
    if damaged:
        click.echo(f"to repair: {repair_commands(cache, manifest)}", err=True)
    sys.exit(1 if problems else 0)


def unfinished(cache: Path, manifest: Manifest) -> list[str]:
    """The cache's work units not listed in its manifest, as a problem (none: []), also where
    the manifest says complete (one edited by hand, or cut)."""
    unlisted = sorted(set(range(manifest.num_units)) - manifest.done_units())
    if manifest.complete and not unlisted:
        return []
    from shared.part import part_name  # (imports torch: not for --help)

    said = ", though it says complete" if manifest.complete else ""
    names = [part_name(u, manifest.format) for u in unlisted[:MAX_NAMED]]
    names += [f"{len(unlisted) - MAX_NAMED} more"] if len(unlisted) > MAX_NAMED else []
    todo = f"run `{manifest.extract_command(cache)}` to finish it"
    holder = read_holder(cache)  # an extraction still writing it: the command would be refused
    running = None if holder is None else holder_running(holder)
    if holder is not None and running is not False:
        who = f"pid {holder.get('pid')} on {holder.get('host')}"
        todo = (
            f"an extraction is writing it ({who}): verify it once that has finished"
            if running
            else f"its lock names {who}, which cannot be checked from here: once that has "
            f"finished, {todo}"
        )
    listed = f"{manifest.num_units - len(unlisted)}/{manifest.num_units} parts listed"
    if not unlisted:  # every part there, the end not recorded (or target/ to write again)
        return [f"the cache is incomplete ({listed}, the cache not marked complete): {todo}"]
    return [f"the cache is incomplete ({listed}{said}; not listed: {', '.join(names)}): {todo}"]


MAX_NAMED = 5  # parts named in a message; the rest counted


def _rerun(
    cache: Path, manifest: Manifest, *, samples: int, seed: int, device: torch.device
) -> list[str]:
    from extract.target import TargetError, weight_files

    try:
        weight_files(Path(manifest.target.path))  # each weight file's header, before its bytes
    except TargetError as e:
        return [_target_problem(manifest, e)]
    changed = _changed_target(manifest)  # said first: the re-run's mismatches follow from it
    first = [changed] if changed is not None else []
    try:
        return first + rerun_samples(cache, manifest, samples=samples, seed=seed, device=device)
    except TargetError as e:  # a file cut short past its header
        return [*first, _target_problem(manifest, e)]


def _target_problem(manifest: Manifest, error: Exception) -> str:
    """A target that cannot be loaded, said as verify's problem (the error names it as
    extraction's --target)."""
    why = str(error).removeprefix(f"--target {manifest.target.path}: ")
    return f"the target {manifest.target.path} cannot be re-run: {why}"


def _changed_target(manifest: Manifest) -> str | None:
    """Why the target at the recorded path is not the one extracted (its weights' sampled bytes
    differ from the record), or None (the same, or a cache with no such record)."""
    from extract.target import TargetError, weights_sample

    recorded = manifest.target.weights_sample
    if recorded is None:
        return None
    try:
        now = weights_sample(Path(manifest.target.path))
    except (TargetError, OSError) as e:
        return f"the target {manifest.target.path} cannot be read: {e}"
    if now == recorded:
        return None
    return (
        f"the target at {manifest.target.path} is not the one this cache was extracted from: "
        "its weights' sampled bytes differ from those recorded, so the re-run below compares "
        "the cache with another checkpoint's states (or fails, if they do not load). Put the "
        "extracted checkpoint back there to check the states, or extract again for this one."
    )


if __name__ == "__main__":
    main()
