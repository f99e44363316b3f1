"""How far ahead of the device the thread that launches the target's forwards runs, and what
holds it back.

    python bench/forward_lead.py --shape qwen3-8b [--rows 5 --length 3072] [--json PATH]

Extraction keeps the device busy only if the launching thread leaves each forward call well
before the device has run it: then the work it does between forwards (the captured states'
payload, the staging copy, the writers' tasks, the next batch's inputs) hides behind queued
kernels. `extract.forward_clock` found the launching thread inside the forward calls about as
long as the device ran them, in the plain pass too (31.1 s of host time against 31.3 s of device
time, 8B shape, 1M tokens, H200), where launching alone takes seconds: the device paces the host,
which then runs only a bounded queue ahead, and extraction's between-forward work left the
device idle 1.2 s over 69 forwards. This measures that lead on one repeated
batch of the random-weight target (its decoder, premade masks, pinned inputs: as extraction
runs it), then profiles one forward and lists the CUDA runtime calls that blocked the host
longest (a full launch queue shows as a long cudaLaunchKernel, a read-back as a
cudaStreamSynchronize or cudaMemcpy), with torch's sync debug mode counting the syncs torch
knows of. Random weights: real shapes and speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_inputs import long_tailed_lengths  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

from extract.batching import make_batches  # noqa: E402
from extract.capture import DeviceInputs  # noqa: E402
from extract.layouts import padded_inputs  # noqa: E402
from extract.masks import choose_masks, forward_kwargs  # noqa: E402


def leads(body, batches: list[np.ndarray], masks, device: torch.device, n: int) -> list[dict]:
    """Per forward (n of them, cycling through `batches`): host seconds inside the call, device
    seconds of the forward, and the lead (how long the device still ran it after the host left
    the call)."""
    inputs, cuda, out = DeviceInputs(device), device.type == "cuda", []
    with torch.inference_mode():
        for i in range(n):
            (ids,) = inputs.send(torch.from_numpy(batches[i % len(batches)]))
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            body(**forward_kwargs(ids, masks))
            t1 = time.perf_counter()
            if cuda:
                end.record()
                end.synchronize()
            t2 = time.perf_counter()
            device_s = start.elapsed_time(end) / 1e3 if cuda else t1 - t0
            out.append({"host_s": t1 - t0, "device_s": device_s, "lead_s": t2 - t1})
    return out


def blocking_calls(body, batches: list[np.ndarray], masks, device: torch.device, top: int) -> dict:
    """Profiled forwards, one per batch: the CUDA runtime calls by longest single duration (in
    all of them), and the syncs torch's sync debug mode reports."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    inputs = DeviceInputs(device)
    if cuda:
        torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            # CUDA activity: CUPTI records the runtime calls (cudaLaunchKernel, ...) with it only
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with torch.inference_mode(), profile(activities=activities) as prof:
                for ids_BL in batches:
                    (ids,) = inputs.send(torch.from_numpy(ids_BL))
                    with record_function("forward"):
                        body(**forward_kwargs(ids, masks))
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message)]
    if cuda:
        torch.cuda.synchronize(device)
    events = prof.events()
    forwards = [e.time_range for e in events if e.name == "forward"]
    rows: dict[str, dict] = {}
    for e in events:  # host-side calls inside the forwards (not the profiler's closing sync)
        inside = any(f.start <= e.time_range.start <= f.end for f in forwards)
        if e.device_type != DeviceType.CPU or not inside or not e.name.startswith("cu"):
            continue
        r = rows.setdefault(e.name, {"name": e.name, "calls": 0, "total_ms": 0.0, "max_ms": 0.0})
        ms = e.time_range.elapsed_us() / 1e3
        r["calls"] += 1
        r["total_ms"] += ms
        r["max_ms"] = max(r["max_ms"], ms)
    ranked = sorted(rows.values(), key=lambda r: -r["max_ms"])[:top]
    return {"runtime_calls": ranked, "sync_warnings": len(syncs), "first_syncs": syncs[:5]}


def mixed_batches(vocab: int, count: int, batch_tokens: int, *, short: bool) -> list[np.ndarray]:
    """`count` right-padded id batches of bench/e2e_gpu.py's long-tailed length mix, packed as
    extraction packs them (longest first within a part of 128 rows, rows x longest <=
    batch_tokens)."""
    hi, rng = 256 if short else 3072, np.random.default_rng(1)
    lengths = long_tailed_lengths(4 * count * batch_tokens, seed=1, lo=64, hi=hi)
    out: list[np.ndarray] = []
    for start in range(0, len(lengths), 128):
        part = sorted(lengths[start : start + 128], reverse=True)
        for batch in make_batches(part, batch_tokens=batch_tokens):
            rows = [rng.integers(0, vocab - 300, part[i], dtype=np.int64) for i in batch]
            out.append(padded_inputs(rows, pad_id=0)[0])
            if len(out) == count:
                return out
    return out


def allocator_counts(device: torch.device) -> dict[str, int]:
    """The caching allocator's device allocations and frees so far (cudaMalloc / cudaFree: a
    cudaFree waits for the whole device), and its retries after a failed allocation."""
    if device.type != "cuda":
        return {"num_device_alloc": 0, "num_device_free": 0, "num_alloc_retries": 0}
    stats = torch.cuda.memory_stats(device)
    return {
        k: int(stats.get(k, 0))
        for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--rows", type=int, default=5)
    p.add_argument("--length", type=int, default=3072)
    p.add_argument("--layers", type=int, default=None, help="build the first N layers only")
    p.add_argument("--forwards", type=int, default=8, help="timed forwards after 3 warm-up ones")
    p.add_argument(
        "--mixed",
        type=int,
        default=12,
        help="also time this many batches of a long-tailed length mix (64..3072, packed to "
        "--batch-tokens as extraction packs them): a new shape every forward, as in a real run",
    )
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.shape.startswith("tiny"):
        args.length = min(args.length, 256)
    cuda = torch.cuda.is_available()  # off CUDA: a check of the script (no queue, lead 0)
    device = torch.device("cuda" if cuda else "cpu")
    last = args.layers - 1 if args.layers else None
    model = random_model(args.shape, device=device.type, last_layer=last)
    body = model.get_decoder()
    masks = choose_masks(body)
    vocab = int(body.config.vocab_size)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab - 300, args.length, dtype=np.int64) for _ in range(args.rows)]
    ids_BL, _ = padded_inputs(rows, pad_id=0)
    leads(body, [ids_BL], masks, device, 3)  # warm-up: kernels chosen, memory cached
    timed = leads(body, [ids_BL], masks, device, args.forwards)
    mixed = mixed_batches(vocab, args.mixed, args.batch_tokens, short=args.shape.startswith("tiny"))
    before = allocator_counts(device)
    varied = leads(body, mixed, masks, device, len(mixed)) if mixed else []
    allocations = {k: v - before[k] for k, v in allocator_counts(device).items()}
    result = {
        "shape": args.shape,
        "layers": int(body.config.num_hidden_layers),
        "batch": [args.rows, args.length],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "premade_masks": masks is not None,
        "forwards": timed,
        **{
            f"median_{k}": statistics.median(f[k] for f in timed)
            for k in ("host_s", "device_s", "lead_s")
        },
        "mixed_forwards": varied,
        "mixed_allocator": allocations,
        **{
            f"mixed_median_{k}": statistics.median(f[k] for f in varied) if varied else None
            for k in ("host_s", "device_s", "lead_s")
        },
        **blocking_calls(body, [ids_BL] + mixed[:3], masks, device, top=10),
    }
    print(
        f"{args.shape} ({result['layers']} layers), batch {args.rows} x {args.length}: host "
        f"{result['median_host_s'] * 1e3:.1f} ms inside a forward, device "
        f"{result['median_device_s'] * 1e3:.1f} ms, the device ran "
        f"{result['median_lead_s'] * 1e3:.1f} ms after the host left (medians of {args.forwards})"
    )
    if varied:
        print(
            f"{len(varied)} batches of mixed lengths: device ran "
            f"{result['mixed_median_lead_s'] * 1e3:.1f} ms after the host left (median; min "
            f"{min(f['lead_s'] for f in varied) * 1e3:.1f} ms), host "
            f"{result['mixed_median_host_s'] * 1e3:.1f} ms inside, device "
            f"{result['mixed_median_device_s'] * 1e3:.1f} ms; allocator meanwhile: {allocations}"
        )
    print(f"syncs torch reports in the profiled forwards: {result['sync_warnings']}")
    for s in result["first_syncs"]:
        print(f"  {s}")
    print("CUDA runtime calls by longest single call (the profiled forwards):")
    for r in result["runtime_calls"]:
        print(f"  {r['name'][:48]:<48} {r['calls']:6d} calls  max {r['max_ms']:8.2f} ms  "
              f"total {r['total_ms']:8.2f} ms")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
