"""Every store on a bf16 cache's own states: bytes on disk, error per layer, coding speed.

    python bench/store_bench.py --cache CACHE [--max-samples N] [--device cpu|cuda] [--json F]

Reads the cache's first N samples (bf16, any codec), codes each sample as the writers do (64
rows of one layer per chunk, a sample's last chunk zero-padded) with each store and prints:
- bytes on disk of the hidden payload against raw bf16 of the real tokens (the ids, masks and
  shard indexes of a real cache add about 0.2% of raw bf16: compare a cache's manifest);
- relative error per token and layer, ||decoded - bf16|| / ||bf16||: mean, 99th percentile and
  max over ordinary tokens; for massive-activation tokens (max |h| over 20x the layer's median
  token max, as `bench/fp8_error.py`) the mean over the whole vector and over the rest (the
  vector without its 4 largest |values|: the channels besides the massive ones); the largest
  per-sample error of a layer (what `python -m extract.verify` measures) over all samples;
- encode and decode speed on `--device` (GB/s of raw bf16: states on the device to records on
  the device and back) and the host codec's compress / decompress speed on one thread.

Besides the stores (`bf16`: `planes`, lossless; `fp8`; `int4`: `shared.int4`, its defaults),
variants of the 4-bit code show what each of its parts buys (bytes counted as their
records would take on disk): no fp8 for massive tokens, one clip, no exact top-k, groups of 32;
and without rotation, top-k or fp8 (its codes and scales before entropy coding).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numcodecs.blosc
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.cache import open_part  # noqa: E402
from shared.codec import CHUNK_ROWS, blosc_compressor  # noqa: E402
from shared.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402
from shared.fsio import atomic_write_json  # noqa: E402
from shared.int4 import (  # noqa: E402
    Int4Scheme,
    decode_int4,
    encode_int4,
    quantize_groups_NGC,
    scale_of,
)
from shared.int4_frames import int4_frames, int4_unframe  # noqa: E402
from shared.manifest import read_manifest  # noqa: E402
from shared.planes import planes_compress, planes_decompress  # noqa: E402

MASSIVE = 20.0  # as bench/fp8_error.py


def read_states(cache: Path, max_samples: int) -> list[torch.Tensor]:
    """bf16 [T, K, H] of the first `max_samples` samples."""
    manifest = read_manifest(cache)
    if manifest.store != "bf16":
        raise SystemExit(f"{cache}: store {manifest.store}; the reference must be a bf16 cache")
    out = []
    for rec in manifest.parts:
        reader = open_part(cache / rec.name)
        for s in reader.iter_samples():
            if len(out) == max_samples:
                return out
            out.append(s.hidden_tensor("cpu"))
    return out


def chunks_of(payload: np.ndarray) -> list[np.ndarray]:
    """[T, K, W] -> the writer's chunks: per layer, 64 rows, the last zero-padded."""
    out = []
    for k in range(payload.shape[1]):
        for row in range(0, len(payload), CHUNK_ROWS):
            block = np.zeros((CHUNK_ROWS, payload.shape[2]), payload.dtype)
            part = payload[row : row + CHUNK_ROWS, k]
            block[: len(part)] = part
            out.append(block)
    return out


@dataclasses.dataclass
class Store:
    """encode: bf16 [T, K, H] on the device -> payload tensors; decode: the inverse (float32);
    disk: payload numpy arrays -> stored bytes (None: count the payload's own bytes); host
    compress / decompress of one chunk for the speed figure."""

    encode: Callable
    decode: Callable
    disk: Callable | None = None
    compress: Callable | None = None
    decompress: Callable | None = None


def int4_disk(split: int) -> Callable:
    def disk(payload: dict) -> int:
        return sum(sum(map(len, int4_frames(c, split))) for c in chunks_of(payload["q"]))

    return disk


def fp8_disk(payload: dict) -> int:
    blosc = blosc_compressor(1)
    scales = payload["scale"].astype(np.float32)  # a float32 per token and layer (Blosc)
    return sum(len(blosc(c)) for c in chunks_of(payload["q"])) + len(
        blosc_compressor(4)(np.ascontiguousarray(scales))
    )


def planes_disk(payload: dict) -> int:
    return sum(len(planes_compress(c.view(np.uint16))) for c in chunks_of(payload["bits"]))


def stores(hidden: int) -> dict[str, Store]:
    scheme = Int4Scheme(hidden=hidden)

    def variant(**kw) -> Store:  # noqa: ANN003
        s = dataclasses.replace(scheme, **kw)
        return Store(
            lambda h: {"q": encode_int4(h, s)},
            lambda p: decode_int4(p["q"], s, torch.float32),
            int4_disk(s.int4_bytes),
        )

    out = {
        "bf16 (planes)": Store(
            lambda h: {"bits": h.view(torch.int16)},
            lambda p: p["bits"].view(torch.bfloat16).float(),
            planes_disk,
            lambda c: planes_compress(c.view(np.uint16)),
            planes_decompress,
        ),
        "fp8": Store(
            lambda h: dict(zip(("q", "scale"), quantize_fp8(h), strict=True)),
            lambda p: dequantize_fp8(p["q"], p["scale"], torch.float32),
            fp8_disk,
            blosc_compressor(1),
            numcodecs.blosc.decompress,
        ),
        "int4": Store(
            lambda h: {"q": encode_int4(h, scheme)},
            lambda p: decode_int4(p["q"], scheme, torch.float32),
            int4_disk(scheme.int4_bytes),
            lambda c: b"".join(int4_frames(c, scheme.int4_bytes)),
            lambda b: int4_unframe(b, scheme.width),
        ),
        "int4, no fp8 for massive": variant(massive_energy=2.0, fp8_above=1e9),
        "int4, one clip": variant(clips=1),
        "int4, 3 clips": variant(clips=3),
        "int4, top-3": variant(topk=3),
        "int4, top-4": variant(topk=4),
        "int4, no exact top-k": variant(topk=0, massive_energy=2.0),
        "int4, groups of 32": variant(group=32),
    }
    out["int4, no rotation, top-k or fp8"] = Store(
        lambda h: {"x": h.view(torch.int16)},
        lambda p: plain_int4(p["x"].view(torch.bfloat16).float(), scheme.group),
        lambda p: p["x"].size // 2 + p["x"].size // scheme.group * 2,  # codes, scales
    )
    return out


def plain_int4(x: torch.Tensor, group: int) -> torch.Tensor:
    """Groups coded as the store codes them, without rotation, top-k or fp8 (error only)."""
    g = x.unflatten(-1, (-1, group))
    q, b, _ = quantize_groups_NGC(g, 1)
    return ((q + 0.5) * scale_of(b).unsqueeze(-1)).flatten(-2)


def errors(ref: torch.Tensor, got: torch.Tensor, sample_of: torch.Tensor) -> list[dict]:
    """Per layer: the figures listed in the module docstring (ref, got float32 [N, K, H])."""
    out = []
    for k in range(ref.shape[1]):
        a, b = ref[:, k], got[:, k]
        diff = b - a
        rel = diff.norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)
        amax = a.abs().amax(-1)
        massive = amax > MASSIVE * amax.median()
        top = a.abs().topk(4, dim=-1).indices
        rest = torch.ones_like(a).scatter_(-1, top, 0.0)
        rest_rel = (diff * rest).norm(dim=-1) / (a * rest).norm(dim=-1).clamp_min(1e-12)
        sq = torch.zeros(int(sample_of.max()) + 1).index_add_(0, sample_of, diff.square().sum(-1))
        ref_sq = torch.zeros_like(sq).index_add_(0, sample_of, a.square().sum(-1))
        plain = rel[~massive]
        e = {
            "mean": plain.mean().item(),
            "p99": plain.quantile(0.99).item() if len(plain) < 1 << 24 else None,
            "max": plain.max().item(),
            "massive_tokens": int(massive.sum()),
            "sample_max": (sq / ref_sq.clamp_min(1e-24)).sqrt().max().item(),
        }
        if massive.any():
            e["massive_mean"] = rel[massive].mean().item()
            e["massive_rest_mean"] = rest_rel[massive].mean().item()
        out.append(e)
    return out


def timed(fn: Callable, device: torch.device) -> tuple[object, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def measure(name: str, store: Store, states: list[torch.Tensor], device: torch.device) -> dict:
    raw = sum(s.numel() * 2 for s in states)
    enc_s = dec_s = 0.0
    disk = 0
    refs, gots, sample_of = [], [], []
    host_chunks = []
    for n, h in enumerate(states):
        hd = h.to(device)
        payload, e = timed(lambda: store.encode(hd), device)  # noqa: B023
        back, d = timed(lambda: store.decode(payload), device)  # noqa: B023
        enc_s, dec_s = enc_s + e, dec_s + d
        host = {k: v.cpu().numpy() for k, v in payload.items()}
        disk += store.disk(host) if store.disk else sum(v.nbytes for v in host.values())
        if store.compress and len(host_chunks) < 256:
            host_chunks += chunks_of(host.get("q", host.get("bits")))[:8]
        refs.append(h.float())
        gots.append(back.float().cpu())
        sample_of.append(torch.full((len(h),), n))
    ref, got = torch.cat(refs), torch.cat(gots)
    out = {
        "store": name,
        "of_raw": disk / raw,
        "bytes_per_token": disk / len(ref),
        "encode_GBps": raw / enc_s / 1e9,
        "decode_GBps": raw / dec_s / 1e9,
        "layers": errors(ref, got, torch.cat(sample_of)),
    }
    if store.compress:
        blobs, t = timed(lambda: [store.compress(c) for c in host_chunks], torch.device("cpu"))
        _, u = timed(lambda: [store.decompress(b) for b in blobs], torch.device("cpu"))
        nbytes = len(host_chunks) * CHUNK_ROWS * ref.shape[-1] * 2  # raw bf16 of those rows
        out["host_compress_GBps"], out["host_decompress_GBps"] = nbytes / t / 1e9, nbytes / u / 1e9
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=Path, required=True, help="a bf16 cache")
    p.add_argument("--max-samples", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--stores", default=None, help="comma-separated names (default: all)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    states = read_states(args.cache, args.max_samples)
    device = torch.device(args.device)
    layers = list(read_manifest(args.cache).layer_ids)
    tokens = sum(len(s) for s in states)
    print(f"{args.cache}: {len(states)} samples, {tokens:,} tokens, layers {layers}, {device}")
    chosen = stores(states[0].shape[-1])
    if args.stores:
        chosen = {k: v for k, v in chosen.items() if k in args.stores.split(",")}
    report = []
    for name, store in chosen.items():
        r = measure(name, store, states, device)
        report.append(r)
        speed = f"encode {r['encode_GBps']:.3f} GB/s, decode {r['decode_GBps']:.3f} GB/s"
        if "host_compress_GBps" in r:
            speed += (
                f"; host compress {r['host_compress_GBps']:.3f}, "
                f"decompress {r['host_decompress_GBps']:.3f} GB/s"
            )
        print(
            f"{name}: {r['of_raw']:.4f} of raw bf16 ({r['bytes_per_token']:,.0f} B/token); {speed}"
        )
        for layer, e in zip(layers, r["layers"], strict=True):
            massive = (
                f"; {e['massive_tokens']} massive: {e['massive_mean']:.4f}, rest "
                f"{e['massive_rest_mean']:.4f}"
                if e["massive_tokens"]
                else ""
            )
            print(
                f"  layer {layer:3d}: mean {e['mean']:.4f} p99 {e['p99']:.4f} max {e['max']:.4f}"
                f"{massive}; worst sample {e['sample_max']:.4f}"
            )
    if args.json:
        atomic_write_json(args.json, {"layers": layers, "tokens": tokens, "stores": report})


if __name__ == "__main__":
    main()
