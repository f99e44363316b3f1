"""Training throughput streaming from a real cache on local disk vs batches already on the GPU.

    python bench/datapath_bench.py --shape qwen3-8b --steps 20

First writes a cache under --workdir with the shared part writer (zarr parts, the extraction
codec: Blosc zstd + crc32c; parts written on threads as extraction does), its manifest and the
target files: random bf16 hidden states of the shape's 5 captured layers, samples of --seq-len
tokens, one per micro-batch, enough for the warm-up and timed steps. The parts are then dropped
from the page cache (posix_fadvise DONTNEED after fsync), so streaming reads the disk as a fresh
run would. Then, in one process and with one product `Trainer` (as train_bench.py builds it):

  A. warm-up + timed optimizer steps fed by the product's loader (`Trainer.loader`: PlanDataset
     over the parts `load_catalog` finds, DataLoader with --workers forkserver processes and
     pinned memory, `device_batch` non-blocking copies), keeping every micro-batch it hands over;
  B. the same micro-batches, moved to the GPU beforehand, replayed through the same steps.

Prints the streaming throughput divided by the in-memory one (goal >= 0.97), the fraction of the
streaming steps' wall time spent waiting for the loader (the trainer's own `data_wait` count),
and bytes per token on disk. Random states do not compress like real activations (DESIGN's
bf16-like synthetic data: 1.42x), so a real cache reads another number of bytes per token.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import drafter_setup as ds  # noqa: E402  (also puts the project root on sys.path)
import train_bench as tb  # noqa: E402

from shared.cache import open_part_writer, part_name  # noqa: E402
from shared.codec import codec_description  # noqa: E402
from shared.dist import usable_cpus  # noqa: E402
from shared.manifest import (  # noqa: E402
    Manifest,
    PartRecord,
    SourceFile,
    TargetInfo,
    read_manifest,
    write_manifest,
)
from train.data.catalog import load_catalog  # noqa: E402
from train.drafters.config import DrafterConfig  # noqa: E402

log = logging.getLogger("datapath_bench")


def write_part(
    cache: Path, part: int, *, samples: int, cfg: DrafterConfig, seq_len: int, device: torch.device
) -> PartRecord:
    """One zarr part of `samples` random samples through the shared writer."""
    k, h = cfg.num_context_layers, cfg.hidden_size
    gen = torch.Generator().manual_seed(part)
    writer = open_part_writer(
        cache,
        part,
        fmt="zarr",
        store="bf16",
        num_layers=k,
        hidden_size=h,
        lengths=[seq_len] * samples,
    )
    with writer:
        for n in range(samples):
            ids = torch.randint(0, cfg.mask_token_id, (seq_len,), generator=gen)
            hidden = torch.randn((seq_len, k, h), dtype=torch.bfloat16, device=device)
            writer.write(
                n,
                sample_index=part * samples + n,
                input_ids=ids,
                loss_mask=ds.prompt_mask(1, seq_len)[0],
                hidden=hidden.cpu(),
            )
        stats = writer.commit()
    return PartRecord.committed(
        stats,
        name=part_name(part, "zarr"),
        unit=part,
        rows=range(part * samples, (part + 1) * samples),
    )


def write_cache(
    cache: Path, shape: str, *, samples: int, per_part: int, seq_len: int, device: torch.device
) -> Manifest:
    """A complete cache of at least `samples` samples: parts, manifest, target files."""
    cfg = ds.drafter_config(shape)
    ds.write_target_files(cache, shape, device)
    num_parts = -(-samples // per_part)
    with ThreadPoolExecutor(max_workers=min(num_parts, usable_cpus())) as pool:
        records = list(
            pool.map(
                lambda p: write_part(
                    cache, p, samples=per_part, cfg=cfg, seq_len=seq_len, device=device
                ),
                range(num_parts),
            )
        )
    target = ds.SHAPES[shape]
    manifest = Manifest(
        format="zarr",
        store="bf16",
        codec=codec_description("bf16"),
        target=TargetInfo(
            path=f"random:{shape}",
            revision="random",
            model_type=target["model_type"],
            num_layers=target["num_hidden_layers"],
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            tokenizer_vocab_size=cfg.vocab_size - ds.SPARE_ROWS,
        ),
        tokenizer_sha256="-",
        chat_template_sha256="-",
        layer_ids=cfg.target_layer_ids,
        max_length=seq_len,
        rows_per_part=per_part,
        sources=(SourceFile(path="random", sha256="-", rows=num_parts * per_part),),
        total_rows=num_parts * per_part,
        parts=tuple(records),
    )
    write_manifest(cache, manifest)
    return manifest


def drop_page_cache(paths: list[Path]) -> int:
    """Drop the cached pages of every file under `paths` so the next read comes from the disk
    (no privileges needed for files we can open); returns the bytes covered."""
    total = 0
    for root in paths:
        for path in [root, *root.rglob("*")] if root.is_dir() else [root]:
            if not path.is_file():
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            total += path.stat().st_size
    return total


def remove_parts(cache: Path) -> None:
    """Delete the parts and the manifest; keep the target files for the next benchmark."""
    (cache / "manifest.json").unlink(missing_ok=True)
    for path in cache.glob("part-*"):
        shutil.rmtree(path, ignore_errors=True)


def recording(source: Iterator[dict[str, Any]], kept: list[dict[str, Any]]):
    """Pass the loader's items through, keeping the real micro-batches for the replay."""
    for item in source:
        if item["real"]:
            kept.append(item)
        yield item


def on_device(item: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in item.items()}


def bench_datapath(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Write the cache, then time the same steps streamed (A) and replayed from the GPU (B)."""
    cache = args.workdir / args.shape  # shares the target files with train_bench
    total = args.warmup + args.steps + args.profile_steps + args.sync_steps
    manifest = write_cache(
        cache,
        args.shape,
        samples=total,
        per_part=args.per_part,
        seq_len=args.seq_len,
        device=device,
    )
    # --warm keeps the parts in the page cache: the loader's own ceiling, without the disk.
    dropped = 0 if args.warm else drop_page_cache([cache / r.name for r in manifest.parts])
    parts, problems = load_catalog(cache, read_manifest(cache))
    if problems:
        raise RuntimeError(f"the written cache does not load: {problems}")
    trainer = ds.make_trainer(
        args.shape,
        cache,
        parts,
        device=device,
        attention=args.attention,
        compile=args.compile,
        grad_ckpt=args.grad_ckpt,
        ce=args.ce,
        steps=total,
        seq_len=args.seq_len,
        anchors=args.anchors,
        batch_tokens=args.seq_len,
        workers=args.workers,
    )
    kept: list[dict[str, Any]] = []
    trainer.prepare(recording(trainer.loader(), kept))
    streamed = tb.time_training(trainer, warmup=args.warmup, steps=args.steps)
    kernels = {}
    if args.profile_steps:
        kernels["stream"] = tb.profile_kernels(trainer, args.profile_steps, top=12)
    syncs = tb.sync_sites(trainer, args.sync_steps) if args.sync_steps else None
    trainer.close_loader()
    replay = [on_device(item, device) for item in kept]
    trainer.prepare(ds.feed(trainer, replay))
    in_memory = tb.time_training(trainer, warmup=args.warmup, steps=args.steps)
    if args.profile_steps:
        kernels["memory"] = tb.profile_kernels(trainer, args.profile_steps, top=12)
    return {
        "bench": "datapath",
        "shape": args.shape,
        "attention": trainer.cfg.attention,
        "compile": trainer.cfg.compile,
        "workers": trainer.cfg.workers,
        "prefetch": trainer.cfg.prefetch,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "samples": len(kept),
        "page_cache_dropped_GB": dropped / 1e9,
        **figures(streamed, in_memory, manifest, trainer.prep.drafter, args.seq_len),
        "cpu_count": usable_cpus(),
        **({"kernels": kernels} if kernels else {}),
        **({"sync_sites": syncs} if syncs is not None else {}),
        **tb.device_facts(device),
    }


def figures(
    streamed: dict[str, Any],
    in_memory: dict[str, Any],
    manifest: Manifest,
    cfg: DrafterConfig,
    seq_len: int,
) -> dict[str, Any]:
    """The ratio, the wait for data, and what the disk delivered."""
    disk_per_token = sum(p.nbytes for p in manifest.parts) / sum(p.tokens for p in manifest.parts)
    step_s = streamed["step_ms"] / 1e3
    return {
        "ratio": in_memory["step_ms"] / streamed["step_ms"],
        "data_wait_fraction": streamed["data_wait_fraction"],
        "stream_step_ms": streamed["step_ms"],
        "memory_step_ms": in_memory["step_ms"],
        "stream_context_tok_s": seq_len / step_s,
        "stream_first_step_s": streamed["first_step_s"],
        "stream_step_ms_max": streamed["step_ms_max"],
        "disk_bytes_per_token": disk_per_token,
        "compression_ratio": 2 * cfg.num_context_layers * cfg.hidden_size / disk_per_token,
        "read_MB_s": disk_per_token * seq_len / step_s / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ds.add_drafter_args(p)
    p.add_argument("--workers", type=int, default=None, help="loader processes (product default)")
    p.add_argument("--per-part", type=int, default=4, help="samples per written part")
    p.add_argument("--keep", action="store_true", help="keep the written cache")
    p.add_argument("--warm", action="store_true", help="leave the parts in the page cache")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each pass's timed steps, profile this many: device kernel time per step "
        "(the step time minus it is the device idle), the kernels by time",
    )
    p.add_argument(
        "--sync-steps",
        type=int,
        default=0,
        help="after the streamed steps, this many more in torch's sync debug mode: where a "
        "step makes the host wait for the device (CUDA only)",
    )
    args = ds.finish_args(p.parse_args())
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        result = bench_datapath(args, device)
    finally:
        if not args.keep:
            remove_parts(args.workdir / args.shape)
    tb.emit(result, args.json)


if __name__ == "__main__":
    main()
