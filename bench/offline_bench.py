"""What the offline pipeline saves per drafter step: the target forward the online one reruns.

    python bench/offline_bench.py --shape qwen3.6-27b

On one device, in one process:
  1. the capture forward of extraction: a random target of the shape built up to its last
     captured layer (as extraction builds it), `extract.capture.LayerCapture` hooks on the
     default 5 layers, --target-batch rows of --seq-len tokens per forward, one warm-up forward
     (kernel selection, flash-linear-attention autotuning) then --repeats timed ones;
  2. the drafter's training step exactly as train_bench.py measures it (the product's Trainer
     on random micro-batches in GPU memory of one --seq-len sequence; datapath_bench.py measures
     how close streaming from the cache comes to that).
An online step pays the target forward of its sequence plus the drafter step; the offline step
pays the drafter step only. Prints ratio = (target per sequence + drafter step) / drafter step
(DESIGN section 6 suggests ~2.3x on the Qwen3.6-27B shape at 512 anchors). The target stays
resident while the drafter is timed when both fit; if they do not, the target is freed first
and `co_resident` is false: the two are then timed one after the other. With --drafter-json
(a train_bench.py result of the same setting, same GPU) the drafter step is taken from it
rather than compiled and timed again, and `co_resident` is null.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import drafter_setup as ds  # noqa: E402  (also puts the project root on sys.path)
import train_bench as tb  # noqa: E402
from shapes import random_model  # noqa: E402

from extract.capture import LayerCapture  # noqa: E402
from extract.target import build_target_layer_ids  # noqa: E402

log = logging.getLogger("offline_bench")


def time_capture(
    shape: str, *, device: torch.device, rows: int, seq_len: int, repeats: int
) -> tuple[dict[str, Any], LayerCapture]:
    """Seconds of one capture forward of `rows` x `seq_len` tokens (mean over `repeats`)."""
    n_layers = ds.SHAPES[shape]["num_hidden_layers"]
    layer_ids = build_target_layer_ids(n_layers, 5)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build_start = time.perf_counter()
    model = random_model(shape, device=str(device), dtype=dtype, last_layer=max(layer_ids))
    tb.synchronize(device)
    build_s = time.perf_counter() - build_start
    capture = LayerCapture(model, layer_ids)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, model.config.vocab_size, seq_len) for _ in range(rows)]
    tb.synchronize(device)
    first = time.perf_counter()
    capture.run(batch, device=device)  # warm-up
    tb.synchronize(device)
    first = time.perf_counter() - first
    clock = tb.StepClock(device)
    clock.mark()
    for _ in range(repeats):
        packed = capture.run(batch, device=device)
        clock.mark()
    forward_s = sum(clock.intervals()) / repeats
    return {
        "target_layers_built": max(layer_ids) + 1,
        "target_layers": n_layers,
        "captured_layers": layer_ids,
        "target_build_s": build_s,
        "target_first_forward_s": first,
        "target_forward_s": forward_s,
        "target_rows": rows,
        "target_tok_s": rows * seq_len / forward_s,
        "captured_shape": list(packed.shape),
    }, capture


def drop(capture: LayerCapture) -> None:
    capture.close()
    capture.model = capture.body = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def earlier_drafter_step(args: argparse.Namespace) -> dict[str, Any] | None:
    """train_bench's result from --drafter-json when it measured this very setting."""
    path = args.drafter_json
    if path is None or not path.is_file():
        return None
    found = json.loads(path.read_text())
    wanted = {"shape": args.shape, "seq_len": args.seq_len, "anchors": args.anchors, "batch": 1}
    wanted.update({k: getattr(args, k) for k in ("attention", "compile") if getattr(args, k)})
    if any(found.get(k) != v for k, v in wanted.items()):
        log.warning("%s measured another setting than %s: timing the drafter here", path, wanted)
        return None
    return {**found, "from": str(path)}


def bench_offline(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    target, capture = time_capture(
        args.shape,
        device=device,
        rows=args.target_batch,
        seq_len=args.seq_len,
        repeats=args.repeats,
    )
    drafter = earlier_drafter_step(args)
    co_resident: bool | None = None  # None: the drafter step comes from another process
    if drafter is None:
        co_resident = True
        try:
            drafter = tb.bench_training(args, device)
        except torch.cuda.OutOfMemoryError:
            log.warning("the target and the trainer do not fit together: timing them one by one")
            co_resident = False
            drop(capture)
            drafter = tb.bench_training(args, device)
    per_sequence = target["target_forward_s"] / args.target_batch
    step = drafter["step_ms"] / 1e3
    return {
        "bench": "offline",
        "shape": args.shape,
        "seq_len": args.seq_len,
        "anchors": args.anchors,
        "ratio": (per_sequence + step) / step,
        "target_ms_per_sequence": 1e3 * per_sequence,
        "drafter_step_ms": drafter["step_ms"],
        "co_resident": co_resident,
        **target,
        "drafter": {k: v for k, v in drafter.items() if k not in ("bench", "shape")},
        **tb.device_facts(device),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ds.add_drafter_args(p)
    p.set_defaults(shape="qwen3.6-27b", steps=10, warmup=3)
    p.add_argument("--target-batch", type=int, default=2, help="rows per capture forward")
    p.add_argument("--repeats", type=int, default=3, help="timed capture forwards")
    p.add_argument(
        "--drafter-json",
        type=Path,
        default=None,
        help="train_bench.py result of the same setting on this GPU: reuse its drafter step "
        "instead of timing (and compiling) it again",
    )
    args = ds.finish_args(p.parse_args())
    args.batch, args.pool = 1, 4
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tb.emit(bench_offline(args, device), args.json)


if __name__ == "__main__":
    main()
