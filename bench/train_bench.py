"""Drafter training step time, context tokens/s and MFU on random batches already on the device.

    python bench/train_bench.py --shape qwen3-8b --attention flex --compile model --steps 20

Builds the product's `Trainer` (train/loop.py) for a 5-layer drafter of the shape (hidden,
intermediate, heads and vocabulary from the target config, default capture layers), with
random weights and random target heads (written once under --workdir, where the trainer loads
them from), and runs its optimizer step (`Trainer.train_step`: bf16 autocast, forward_loss
with the chunked lm_head + CE under checkpointing, backward, loss normalisation, gradient
clipping, fused AdamW on fp32 weights) on a few random micro-batches already on the device:
--batch sequences of --seq-len tokens, --anchors blocks of 16. --attention and --compile left
out take the product's defaults for the device (flex and model on CUDA), set up exactly as
`train_rank` does (`configure_compile`, then `Trainer.prepare`'s torch.compile wrap).

Prints one JSON line (and writes --json): the first step's wall time (compilation included)
apart from the steady state (the mean over --steps after --warmup steps, timed with CUDA events
between steps, perf_counter on CPU), context tokens/s, achieved TFLOP/s, MFU against the
datasheet peak and against a bf16 8192^3 matmul timed in the same run (`ceiling_tflops`,
`mfu_of_ceiling`), peak GPU memory.

--drafter-type dflash2 times the DFlash2 drafter (same attention and settings; the convolutions
and the selector's loss added, `train/drafters/dflash2.py`, `train/drafters/dflash2_loss.py`).
--drafter-type dspark times DSpark (its Markov and confidence heads and its three-term loss,
`train/drafters/dspark_loss.py`, reading one more cached layer, the target's last); its block is
7 unless --block-size says otherwise: `--block-size 16` compares it with DFlash at the same
block tokens. --loss kl|tv|mix times DFlash's loss against the target's distribution (one more
cached layer, the target's last, through its lm_head at the distinct rows each loss chunk reads,
no gradient; counted so by `mean_target_rows`).

Model FLOPs and MFU: `bench/train_flops.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import drafter_setup as ds  # noqa: E402  (also puts the project root on sys.path)
from forward_modes import matmul_tflops  # noqa: E402
from train_flops import flops_summary, mean_context_keys, mean_target_rows, step_flops  # noqa: E402

from train.config import TrainConfig  # noqa: E402
from train.data.catalog import PartInfo  # noqa: E402
from train.drafters import dflash2_fused as selector_fused  # noqa: E402
from train.drafters.dflash import num_parameters  # noqa: E402
from train.drafters.mask import flex_bwd_options  # noqa: E402
from train.loop import Trainer  # noqa: E402
from train.run import resolve_devices  # noqa: E402

log = logging.getLogger("train_bench")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Step boundaries: CUDA events on the GPU (no synchronisation between steps), plain
    perf_counter on the CPU, where every step is synchronous anyway."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (synchronises the GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(self.marks)]
        return [b - a for a, b in itertools.pairwise(self.marks)]


def run_steps(trainer: Trainer, n: int) -> tuple[list[float], float, float]:
    """`n` optimizer steps of the trainer (after `Trainer.prepare`): (seconds per step, wall
    seconds, seconds waited for data as the trainer itself counts them)."""
    clock = StepClock(trainer.device)
    synchronize(trainer.device)
    start, waited = time.perf_counter(), 0.0
    clock.mark()
    for _ in range(n):
        waited += trainer.train_step()
        clock.mark()
    per_step = clock.intervals()
    return per_step, time.perf_counter() - start, waited


def time_training(trainer: Trainer, *, warmup: int, steps: int) -> dict[str, Any]:
    """First step (compilation included), warm-up, then `steps` timed steps."""
    _, first, _ = run_steps(trainer, 1)
    log.info("first step (compilation included): %.1f s", first)
    if warmup > 1:
        run_steps(trainer, warmup - 1)
    per_step, wall, waited = run_steps(trainer, steps)
    mean = sum(per_step) / len(per_step)
    return {
        "first_step_s": first,
        "step_ms": 1e3 * mean,
        "step_ms_median": 1e3 * sorted(per_step)[len(per_step) // 2],
        "step_ms_max": 1e3 * max(per_step),
        "timed_wall_s": wall,
        "data_wait_fraction": waited / wall,
    }


def device_facts(device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "peak_gpu_GB": torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        "torch": torch.__version__,
    }


def bench_training(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The whole measurement of one (shape, attention, compile) setting."""
    cache = args.workdir / args.shape
    ds.write_target_files(cache, args.shape, device)
    total = 1 + max(args.warmup - 1, 0) + args.steps + args.profile_steps
    # Metadata of a cache the in-memory items stand for (the plan needs it; nothing is read).
    parts = [PartInfo(path="in-memory", lengths=(args.seq_len,) * (args.batch * total))]
    trainer = ds.make_trainer(
        args.shape,
        cache,
        parts,
        device=device,
        attention=args.attention,
        compile=args.compile,
        grad_ckpt=args.grad_ckpt,
        ce=args.ce,
        ce_chunk_blocks=args.ce_chunk_blocks,
        drafter_type=args.drafter_type,
        block_size=args.block_size,
        loss=args.loss,
        optimizer=args.optimizer,
        steps=total,
        seq_len=args.seq_len,
        anchors=args.anchors,
        batch_tokens=args.batch * args.seq_len,
    )
    cfg = trainer.prep.drafter
    if args.flex_bwd:
        trainer.model.use_flex_options(
            flex_bwd_options(tuple(int(x) for x in args.flex_bwd.split(",")))
        )
    items = ds.random_items(
        cfg,
        count=args.pool,
        batch=args.batch,
        seq_len=args.seq_len,
        device=device,
        loss=args.loss,
    )
    trainer.prepare(ds.feed(trainer, itertools.cycle(items)))
    timing = time_training(trainer, warmup=args.warmup, steps=args.steps)
    kernels = profile_kernels(trainer, args.profile_steps) if args.profile_steps else None
    keys = mean_context_keys(
        ds.prompt_mask(1, args.seq_len)[0], anchors=args.anchors, block_size=cfg.block_size
    )
    target_rows = mean_target_rows(
        ds.prompt_mask(args.batch, args.seq_len),
        anchors=args.anchors,
        block_size=cfg.block_size,
        chunk_rows=trainer.cfg.ce_chunk_blocks * cfg.block_size,
        shift=int(cfg.anchor_predicts),
    )
    flops = step_flops(
        cfg,
        batch=args.batch,
        seq_len=args.seq_len,
        anchors=args.anchors,
        keys_per_query=keys,
        loss=trainer.cfg.loss,
        target_rows=target_rows,
    )
    defaults = resolve_devices(TrainConfig(data=cache, out=cache), device.type)
    return {
        "bench": "train",
        "shape": args.shape,
        "drafter_type": cfg.drafter_type,
        "attention": trainer.cfg.attention,
        "compile": trainer.cfg.compile,
        "grad_ckpt": trainer.cfg.grad_ckpt,
        "ce": trainer.cfg.ce,
        "ce_chunk_blocks": trainer.cfg.ce_chunk_blocks,
        "loss": trainer.cfg.loss,
        "optimizer": trainer.cfg.optimizer,
        "flex_options": trainer.model.layers[0].self_attn.flex_options,
        "selector_topk_kernel": selector_fused.TOPK_KERNEL,
        "is_default": all(
            getattr(trainer.cfg, k) == getattr(defaults, k)
            for k in (
                "attention",
                "compile",
                "grad_ckpt",
                "ce",
                "ce_chunk_blocks",
                "loss",
                "optimizer",
            )
        )
        and not args.flex_bwd
        and selector_fused.TOPK_KERNEL == DEFAULT_TOPK_KERNEL,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "block_size": cfg.block_size,
        "drafter_layers": cfg.num_layers,
        "drafter_params": num_parameters(trainer.model),
        "keys_per_query": keys,
        "target_rows": target_rows,
        "warmup": args.warmup,
        "steps": args.steps,
        **timing,
        **flops_summary(
            flops,
            timing["step_ms"] / 1e3,
            tokens=args.batch * args.seq_len,
            ceiling_tflops=matmul_tflops(device),
        ),
        **device_facts(device),
        **({"kernels": kernels} if kernels else {}),
    }


def profile_kernels(trainer: Trainer, steps: int, *, top: int = 30) -> dict[str, Any]:
    """Device time per step by kernel over `steps` profiled steps (after the timed ones): the
    `top` kernels by total time, and the step's summed kernel time (gaps between kernels are
    the difference to the measured step time). On the CPU: operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run_steps(trainer, steps)

    def self_us(e: Any) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    rows = [e for e in prof.key_averages() if self_us(e) > 0]
    rows.sort(key=self_us, reverse=True)
    total_us = sum(self_us(e) for e in rows)
    return {
        "kernel_ms_per_step": total_us / 1e3 / steps,
        "top": [
            {
                "name": e.key[:120],
                "ms_per_step": round(self_us(e) / 1e3 / steps, 3),
                "calls_per_step": e.count / steps,
                "share": round(self_us(e) / total_us, 4),
            }
            for e in rows[:top]
        ],
    }


def sync_sites(trainer: Trainer, steps: int) -> dict[str, int]:
    """Where `steps` optimizer steps make the host wait for the device (torch's sync debug
    mode, CUDA only): {innermost project frame "path:line function": count}. A wait inside a
    step stops the host from queueing ahead, so the device idles while it queues the rest."""
    if trainer.device.type != "cuda":
        return {}
    import traceback
    import warnings

    root, sites = str(Path(__file__).resolve().parent.parent), {}

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        key = "?"
        if frames:
            f = frames[-1]
            key = f"{f.filename[len(root) + 1 :]}:{f.lineno} {f.name} <- "
            key += f"{filename.rsplit('/', 1)[-1]}:{lineno}"
        sites[key] = sites.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            run_steps(trainer, steps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites


def emit(result: dict[str, Any], path: Path | None) -> None:
    """One JSON line on stdout; the same, indented, to `path`."""
    print(json.dumps(result), flush=True)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))


DEFAULT_TOPK_KERNEL = selector_fused.TOPK_KERNEL  # before --selector-topk-kernel changes it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ds.add_drafter_args(p)
    p.add_argument("--batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--pool", type=int, default=4, help="distinct random batches, cycled")
    p.add_argument(
        "--flex-bwd",
        default=None,
        help="M1,N1,M2,N2,warps,stages: flex_attention backward blocks instead of the product's",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after the timed steps, profile this many and list the kernels by device time",
    )
    p.add_argument(
        "--selector-topk-kernel",
        choices=sorted(selector_fused.TOPK_KERNELS),
        default=DEFAULT_TOPK_KERNEL,
        help="DFlash2's fused selector loss: the top-K by the blocks' maxima (train.drafters.topk) "
        "or by one torch.topk (train.drafters.dflash2_fused.TOPK_KERNEL)",
    )
    args = ds.finish_args(p.parse_args())
    selector_fused.TOPK_KERNEL = args.selector_topk_kernel
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    emit(bench_training(args, device), args.json)


if __name__ == "__main__":
    main()
