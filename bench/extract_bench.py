"""Extraction throughput against the pure forward of the same model on the same batches.

    python bench/extract_bench.py --shape qwen3-8b --tokens 400000 --out /tmp/bench-cache

Builds a real-shaped target with random weights on the GPU (only the layers up to the last
captured one, as extraction does), makes synthetic rows of realistic lengths, and times, side by
side in one process: (A) the plain forward of those batches, (B) the product's extraction
pipeline on the same batches (hooks, async host copy, Blosc compression on writer threads,
zarr parts written to --out on local disk and committed to a manifest), then (A) again.
Prints tokens/s of each, the ratio B / the faster A (the first pass can include one-time kernel
tuning), how long the device waited for the writer threads, bytes per token on disk (random
weights do not compress like real activations), peak host memory and peak GPU memory, and the
host seconds spent inside the forward calls of each pass (queueing kernels: if extraction's
approaches its wall time, the launching thread, not the GPU, sets the pace). Writes --json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_monitor import HostMonitor  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

import extract.capture  # noqa: E402
import extract.masks  # noqa: E402
import shared.zarr_part  # noqa: E402
from extract.batching import length_order, make_batches  # noqa: E402
from extract.capture import DeviceInputs, LayerCapture  # noqa: E402
from extract.data import Tokenized  # noqa: E402
from extract.forward_clock import ForwardClock  # noqa: E402
from extract.job import Job, default_writer_threads  # noqa: E402
from extract.layouts import padded_inputs  # noqa: E402
from extract.masks import choose_masks, forward_kwargs  # noqa: E402
from extract.pipeline import PartPipeline  # noqa: E402
from extract.sink import device_payload  # noqa: E402
from extract.target import build_target_layer_ids  # noqa: E402
from extract.units import run_units  # noqa: E402
from shared.codec import codec_description  # noqa: E402
from shared.manifest import Manifest, SourceFile, TargetInfo, read_manifest, write_manifest  # noqa: E402
from shared.progress import RankCounters  # noqa: E402


def synthetic_rows(tokens: int, vocab: int, seed: int) -> list[Tokenized]:
    """Rows with chat-like lengths (log-normal, median ~900, 128..3072) and random ids."""
    rng = np.random.default_rng(seed)
    rows, total = [], 0
    while total < tokens:
        n = int(np.clip(rng.lognormal(np.log(900), 0.7), 128, 3072))
        ids = rng.integers(0, vocab, n, dtype=np.int32)
        mask = np.zeros(n, np.uint8)
        mask[n // 4 :] = 1
        rows.append(
            Tokenized(
                row=len(rows),
                source="synthetic",
                line=len(rows) + 1,
                input_ids=ids,
                loss_mask=mask,
                truncated=False,
            )
        )
        total += n
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def extraction_batches(rows, rows_per_part: int, batch_tokens: int) -> tuple[list, list[range]]:
    """(rows in the order the pipeline runs them, forward batches as ranges of it): each part
    sorted by length and cut into batches as extraction does, so a pure forward sees the same."""
    ordered, batches = [], []
    for u in range(0, len(rows), rows_per_part):
        part = rows[u : u + rows_per_part]
        part = [part[i] for i in length_order([len(r.input_ids) for r in part])]
        base = len(ordered)
        ordered += part
        lengths = [len(r.input_ids) for r in part]
        for b in make_batches(lengths, batch_tokens=batch_tokens):
            batches.append(range(b.start + base, b.stop + base))
    return ordered, batches


def pure_forward(body, rows, batches, device, masks) -> float:
    """The plain forward of `batches`, inputs and masks given as extraction gives them."""
    inputs = DeviceInputs(device)
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids_BL, _ = padded_inputs([rows[i].input_ids for i in batch], pad_id=0)
            (ids_BL,) = inputs.send(torch.from_numpy(ids_BL))
            body(**forward_kwargs(ids_BL, masks))
    sync(device)
    return time.perf_counter() - start


def captured_forward(capture, rows, batches, device, store: str, fmt: str) -> float:
    """The forward with the capture hooks and the device-side payload (fp8 quantization or the
    planes split), nothing copied to the host and no writer: what extraction adds on the device
    alone."""
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        packed = capture.run([rows[i].input_ids for i in batch], device=device)
        device_payload(packed, store, fmt)
    sync(device)
    return time.perf_counter() - start


def extract_once(
    capture, rows, args, layer_ids, hidden, out: Path, device
) -> tuple[float, float, float]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    per_part = args.rows_per_part
    units = -(-len(rows) // per_part)
    manifest = Manifest(
        format=args.format,
        store=args.store,
        codec=codec_description(args.store),
        target=TargetInfo(
            path="random",
            revision="random",
            model_type=args.shape,
            num_layers=0,
            hidden_size=hidden,
            vocab_size=0,
            tokenizer_vocab_size=0,
        ),
        tokenizer_sha256="-",
        chat_template_sha256="-",
        layer_ids=tuple(layer_ids),
        max_length=3072,
        rows_per_part=per_part,
        sources=(SourceFile(path="synthetic", sha256="-", rows=len(rows)),),
        total_rows=len(rows),
    )
    write_manifest(out, manifest)
    job = Job(
        out=out,
        target="random",
        files=(),
        index=None,
        layer_ids=tuple(layer_ids),
        max_length=3072,
        format=args.format,
        store=args.store,
        batch_tokens=args.batch_tokens,
        compile="none",
        packing="off",
        attention="auto",
        rows_per_part=per_part,
        total_rows=len(rows),
        units=tuple(range(units)),
        writer_threads=args.writer_threads,
        progress_dir=out / ".progress",
        draw_bar=False,
    )
    counters = RankCounters(job.progress_dir, 0)
    pipe = PartPipeline(job, device, capture, threads=args.writer_threads, counters=counters)
    sync(device)
    start = time.perf_counter()
    # As `python -m extract` runs its units: each part read and opened on a reader thread.
    run_units(pipe, range(units), read=lambda u: (rows[u * per_part : (u + 1) * per_part], []))
    sync(device)
    forwards_done = time.perf_counter() - start
    pipe.close()  # the last writes and the last part's commit
    counters.close()
    return time.perf_counter() - start, forwards_done, pipe.staging.waited_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=400_000)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--rows-per-part", type=int, default=128)
    p.add_argument("--writer-threads", type=int, default=0, help="0: the product's default")
    p.add_argument("--format", default="zarr")
    p.add_argument("--store", default="bf16")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench-cache"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--writeback",
        choices=("early", "commit"),
        default="early",
        help="early (the product): each shard file's writeback starts once it is written; "
        "commit: the data stays dirty until the part's commit syncs it",
    )
    p.add_argument(
        "--inputs",
        choices=("pinned", "pageable"),
        default="pinned",
        help="pinned (the product): token ids reach the device by asynchronous copies from "
        "pinned buffers; pageable: plain copies, which wait for the previous batch (both passes)",
    )
    p.add_argument(
        "--masks",
        choices=("premade", "library"),
        default="premade",
        help="premade (the product): causal masks passed in (extract.masks); "
        "library: the model builds them, reading a device tensor back per forward (both passes)",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=Job.switch_interval_s,
        help="sys.setswitchinterval for the run (seconds; default the product's, "
        f"{Job.switch_interval_s}; Python's own is 0.005)",
    )
    args = p.parse_args()
    args.writer_threads = args.writer_threads or default_writer_threads(1)
    sys.setswitchinterval(args.switch_interval)
    shared.zarr_part.EARLY_WRITEBACK = args.writeback == "early"
    extract.capture.PINNED_INPUTS = args.inputs == "pinned"
    extract.masks.PREMADE_MASKS = args.masks == "premade"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n_layers = SHAPES[args.shape]["num_hidden_layers"]
    layer_ids = build_target_layer_ids(n_layers, 5)
    model = random_model(args.shape, device=str(device), last_layer=max(layer_ids))
    hidden = model.config.hidden_size
    rows = synthetic_rows(args.tokens, model.config.vocab_size, seed=0)
    tokens = sum(len(r.input_ids) for r in rows)
    ordered, batches = extraction_batches(rows, args.rows_per_part, args.batch_tokens)
    body = model.get_decoder()
    masks = choose_masks(body)  # as LayerCapture chooses them
    pure_forward(body, ordered, batches[:3], device, masks)  # warm-up
    clock = ForwardClock(body)
    t_a1 = pure_forward(body, ordered, batches, device, masks)
    launch_a1 = clock.take()
    capture = LayerCapture(model, layer_ids)
    clock.take()  # drop its mask probe's two forwards from the extraction pass's figures
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with HostMonitor() as host:
        t_b, t_forwards, waited = extract_once(
            capture, rows, args, layer_ids, hidden, args.out, device
        )
    launch_b = clock.take()
    t_c = captured_forward(capture, ordered, batches, device, args.store, args.format)
    launch_c = clock.take()
    capture.close()
    t_a2 = pure_forward(body, ordered, batches, device, masks)
    launch_a2 = clock.take()
    clock.close()
    nbytes = read_manifest(args.out).totals()["nbytes"]
    res = {
        "bench": "extract",
        "shape": args.shape,
        "tokens": tokens,
        "rows": len(rows),
        "layers": layer_ids,
        "batch_tokens": args.batch_tokens,
        "writer_threads": args.writer_threads,
        "format": args.format,
        "store": args.store,
        "writeback": args.writeback,
        "switch_interval_s": sys.getswitchinterval(),
        "inputs": args.inputs,
        "masks": args.masks,
        "masks_used": sorted(masks) if masks else None,
        "host_s_in_forward_calls": [t.host_s for t in (launch_a1, launch_b, launch_a2)],
        "device_s_in_forwards": [t.device_s for t in (launch_a1, launch_b, launch_a2)],
        "device_idle_s_between_forwards": [t.idle_s for t in (launch_a1, launch_b, launch_a2)],
        "captured_pass": {  # hooks and device payload, no host copy, no writers
            "seconds": t_c,
            "device_s_in_forwards": launch_c.device_s,
            "device_idle_s_between_forwards": launch_c.idle_s,
            "ratio": min(t_a1, t_a2) / t_c,
        },
        "forward_tok_s": tokens / min(t_a1, t_a2),
        "forward_s_before_after": [t_a1, t_a2],
        "extract_s": t_b,
        "extract_forwards_done_s": t_forwards,
        "ratio_before_drain": min(t_a1, t_a2) / t_forwards,
        "device_waited_for_writers_s": waited,
        "extract_tok_s": tokens / t_b,
        "ratio": min(t_a1, t_a2) / t_b,
        "disk_bytes_per_token": nbytes / tokens,
        "raw_bytes_per_token": len(layer_ids) * hidden * 2,
        "disk_MB_s": nbytes / t_b / 1e6,
        "peak_host_rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
        "peak_gpu_GB": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0,
        "host_during_extraction": host.summary(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    shutil.rmtree(args.out, ignore_errors=True)
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
