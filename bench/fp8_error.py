"""fp8 cache error per layer, against the bf16 cache of the same rows.

    python bench/fp8_error.py --bf16 CACHE_BF16 --fp8 CACHE_FP8 [--max-samples N]

Matches samples by source row, dequantizes the fp8 states as the trainer does
(`shared.codec.dequantize_fp8`), and prints per layer the relative error of each token's state,
||fp8 - bf16|| / ||bf16||, mean and max over tokens, for all tokens and for the tokens with
massive activations (max |h| over 20x the layer's median token max), plus the largest |h|.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.cache import open_part  # noqa: E402
from shared.manifest import read_manifest  # noqa: E402

MASSIVE = 20.0  # a token is massive when its max |h| exceeds this many times the median's


def samples(cache: Path, max_samples: int, rows: set[int] | None = None) -> dict[int, torch.Tensor]:
    """States of the first `max_samples` samples by source row, or of those among `rows` (the
    parts are read in order until all are found: not the whole cache)."""
    out: dict[int, torch.Tensor] = {}
    for rec in read_manifest(cache).parts:
        for s in open_part(cache / rec.name).iter_samples():
            if len(out) == (max_samples if rows is None else len(rows)):
                return out
            if rows is None or s.sample_index in rows:
                out[s.sample_index] = s.hidden_tensor("cpu").float()  # [T, K, H]
    return out


def layer_errors(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """ref, got: [N, H] of one layer."""
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    amax = ref.abs().amax(dim=-1)
    massive = amax > MASSIVE * amax.median()
    out = {"tokens": len(rel), "mean": rel.mean().item(), "max": rel.max().item()}
    out["massive_tokens"] = int(massive.sum())
    if massive.any():
        out["massive_mean"], out["massive_max"] = (
            rel[massive].mean().item(),
            rel[massive].max().item(),
        )
    out["max_abs"] = amax.max().item()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bf16", type=Path, required=True)
    p.add_argument("--fp8", type=Path, required=True)
    p.add_argument("--max-samples", type=int, default=2000)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    layers = read_manifest(args.bf16).layer_ids
    if read_manifest(args.fp8).layer_ids != layers:
        raise SystemExit("the two caches hold different layers")
    ref = samples(args.bf16, args.max_samples)
    got = samples(args.fp8, len(ref), rows=set(ref))
    rows = sorted(set(ref) & set(got))
    if not rows:
        raise SystemExit("no source row is in both caches")
    a = torch.cat([ref[r] for r in rows])
    b = torch.cat([got[r] for r in rows])
    report = {}
    print(f"{len(rows)} samples, {len(a):,} tokens")
    for k, layer in enumerate(layers):
        e = layer_errors(a[:, k], b[:, k])
        report[layer] = e
        massive = (
            f"{e['massive_tokens']} massive tokens: mean {e['massive_mean']:.4f} max "
            f"{e['massive_max']:.4f}"
            if e["massive_tokens"]
            else "no massive tokens"
        )
        print(
            f"layer {layer:3d}: relative error mean {e['mean']:.4f} max {e['max']:.4f}; "
            f"{massive}; max |h| {e['max_abs']:.1f}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
