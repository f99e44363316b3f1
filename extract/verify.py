"""`python -m extract.verify CACHE`: checksums, counts, and a re-run of the target on samples.

Exits non-zero on any mismatch, naming the part. Stored states are compared with fresh ones by
relative error ||stored - fresh|| / ||fresh|| per sample: bf16 storage rounds to 8 mantissa bits
and batching changes GPU reductions slightly (tolerance 2e-2); fp8 e4m3 keeps 3 bits (8e-2).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import torch

from shared.cache import open_part, verify_part
from shared.dist import usable_cpus
from shared.lock import LockHeld, output_lock
from shared.manifest import (
    CacheMismatch,
    Manifest,
    PartRecord,
    drop_parts,
    read_manifest,
    update_manifest,
)
from shared.target_files import TARGET_DIR, target_problems

log = logging.getLogger(__name__)
TOLERANCE = {"bf16": 2e-2, "fp8": 8e-2}


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
    path = cache / rec.name
    if not path.exists():
        return [f"{rec.name}: listed in the manifest but missing on disk"]
    problems = [f"{rec.name}: {p}" for p in verify_part(path, rec.checksum, threads=shard_threads)]
    try:
        reader = open_part(path)
    except (OSError, ValueError, KeyError) as e:
        return [*problems, f"{rec.name}: cannot be opened ({e})"]
    if reader.num_samples != rec.rows_kept:
        problems.append(f"{rec.name}: {reader.num_samples} samples, manifest says {rec.rows_kept}")
    if int(reader.tokens) != rec.tokens:
        problems.append(f"{rec.name}: {reader.tokens} tokens, manifest says {rec.tokens}")
    return problems


def rerun_samples(
    cache: Path, manifest: Manifest, *, samples: int, seed: int, device: torch.device
) -> list[str]:
    """Re-run the target on `samples` random stored samples and compare the states."""
    from extract.capture import LayerCapture
    from extract.target import load_target

    picks = [(rec, n) for rec in manifest.parts for n in range(rec.rows_kept)]
    picks = random.Random(seed).sample(picks, min(samples, len(picks)))
    if not picks:
        return []
    model = load_target(manifest.target.path, device=device, last_layer=max(manifest.layer_ids))
    # The model's own masks: an independent check of the premade ones extraction passes.
    capture = LayerCapture(model, manifest.layer_ids, own_masks=True)
    problems, tol = [], TOLERANCE[manifest.store]
    for rec, n in picks:
        reader = open_part(cache / rec.name)
        # wds parts stream only: walk to the n-th sample.
        sample = (
            reader.read(n)
            if manifest.format == "zarr"
            else next(itertools.islice(reader.iter_samples(), n, None))
        )
        fresh = capture.run([sample.input_ids], device=device).float().cpu()
        stored = sample.hidden_tensor(torch.device("cpu")).float()
        err = ((stored - fresh).norm() / fresh.norm().clamp_min(1e-12)).item()
        log.info(
            "%s sample %d (row %d): relative error %.2e", rec.name, n, sample.sample_index, err
        )
        if not err <= tol:
            problems.append(
                f"{rec.name}: sample {n} (source row {sample.sample_index}) differs "
                f"from a fresh forward: relative error {err:.3g} > {tol}"
            )
    capture.close()
    return problems


def repair_manifest(cache: Path, problems: list[str]) -> str:
    """Drop the parts named in `problems` from the manifest, and mark the cache incomplete
    when `target/` is damaged: the same extract command then redoes exactly those (it
    rewrites a damaged `target/` on resume). Returns what was done, as a sentence."""
    names = {p.split(":", 1)[0] for p in problems if p.startswith("part-")}
    target_damaged = any(p.startswith(f"{TARGET_DIR}/") for p in problems)

    def change(m: Manifest) -> Manifest:
        m = drop_parts(m, names)
        return dataclasses.replace(m, complete=False) if target_damaged else m

    with output_lock(cache, "python -m extract.verify --repair"):
        update_manifest(cache, change)
    done = f"dropped {len(names)} damaged parts from the manifest" if names else ""
    if target_damaged:
        done += (", and " if done else "") + "marked target/ to be written again"
    return done + ": rerun the same extract command to redo them"


@click.command()
@click.argument("cache", type=click.Path(path_type=Path))
@click.option("--samples", default=4, show_default=True, help="Samples to re-run the target on.")
@click.option("--seed", default=0, show_default=True, help="Which samples.")
@click.option("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if present).")
@click.option(
    "--repair",
    is_flag=True,
    help="Drop damaged parts from the manifest, so that the same extract command redoes them.",
)
def main(cache: Path, samples: int, seed: int, device: str | None, repair: bool) -> None:
    """Check every part of CACHE and its target/ files against its manifest; exit 1 on any
    mismatch."""
    from shared.logs import setup_logging

    setup_logging()
    try:
        manifest = read_manifest(cache)
    except CacheMismatch as e:
        raise click.ClickException(str(e)) from None
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    problems = target_problems(cache, manifest.target_files) + check_parts(cache, manifest)
    if repair and problems:
        for p in problems:
            click.echo(f"MISMATCH {p}", err=True)
        try:
            click.echo(f"repaired: {repair_manifest(cache, problems)}")
        except LockHeld as e:
            raise click.ClickException(str(e)) from None
        sys.exit(1)
    if not manifest.complete:
        problems.append(
            f"the cache is incomplete ({len(manifest.parts)}/{manifest.num_units} "
            "parts): rerun the extract command to finish it"
        )
    if samples and not problems:
        if Path(manifest.target.path).exists():
            problems += rerun_samples(cache, manifest, samples=samples, seed=seed, device=dev)
        else:
            log.warning("target %s not found here: skipping the re-run check", manifest.target.path)
    for p in problems:
        click.echo(f"MISMATCH {p}", err=True)
    click.echo(f"{len(manifest.parts)} parts checked, {len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
