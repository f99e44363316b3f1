"""How far a row's states move with the shape of the forward that computes them, layer by layer.

`python -m extract.verify` compares stored states (computed in a padded batch, premade masks)
with a fresh forward of the row alone (the model's own masks). In bf16 on a GPU the two differ by
rounding: a batch of another shape runs other GEMM and attention kernel tilings. This prints, for
every target layer, the relative error ||a - b|| / ||b|| of the rows' states between

- `batch`: the rows right-padded in one batch with premade masks, as extraction runs them;
- `alone`: each row alone with the model's own masks, as verify runs it;
- `fp32`: each row alone in fp32 with the same (bf16-rounded) weights: the rounding-free value;

so that verify's tolerance can be set from what bf16 itself does at each depth, rather than from
one shallow model. Random weights (`bench/shapes.py`).

    python bench/verify_noise.py --shape qwen3.6-27b          # one H200: about 110 GB in fp32
    python bench/verify_noise.py --shape tiny-hybrid --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import random_model  # noqa: E402
from extract.capture import LayerCapture  # noqa: E402
from extract.layer_check import layer_errors  # noqa: E402
from extract.target import build_target_layer_ids  # noqa: E402

# One batch of similar lengths, as extraction's length-sorted batching forms them.
LENGTHS = (1536, 1400, 1311, 1207, 1024, 900)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def states_alone(capture: LayerCapture, rows, device) -> list[torch.Tensor]:
    """[n, K, H] per row, each row run alone, on the CPU in fp32."""
    return [capture.run([r], device=device).float().cpu() for r in rows]


def states_batch(capture: LayerCapture, rows, device) -> list[torch.Tensor]:
    out = capture.run(rows, device=device).float().cpu()
    return list(out.split([len(r) for r in rows]))


def per_layer(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Relative error per layer over all rows' tokens (verify's own measure)."""
    return layer_errors(torch.cat(a), torch.cat(b))


def overall(a: list[torch.Tensor], b: list[torch.Tensor], slots: list[int]) -> list[float]:
    """Verify's figure per row: all of `slots`' layers of one row at once."""
    return [rel(x[:, slots], y[:, slots]) for x, y in zip(a, b, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.6-27b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-fp32", action="store_true", help="Skip the fp32 reference.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    dtype = torch.float32 if not args.no_fp32 else torch.bfloat16
    model = random_model(args.shape, device=args.device, dtype=dtype)
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    rows = [rng.integers(0, vocab, n).astype(np.int64) for n in LENGTHS]
    all_ids = list(range(layers))
    result: dict = {"shape": args.shape, "lengths": list(LENGTHS), "layers": layers}
    if not args.no_fp32:
        with torch.no_grad():  # the fp32 model computes with exactly the bf16 weights
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        capture = LayerCapture(model, all_ids, own_masks=True)
        fp32 = states_alone(capture, rows, device)
        capture.close()
        model.to(torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    capture = LayerCapture(model, all_ids, own_masks=True)
    alone = states_alone(capture, rows, device)
    capture.close()
    capture = LayerCapture(model, all_ids)  # premade masks, as extraction
    batch = states_batch(capture, rows, device)
    premade_alone = states_alone(capture, rows, device)
    capture.close()
    result["batch_vs_alone"] = per_layer(batch, alone)
    result["premade_alone_vs_alone"] = per_layer(premade_alone, alone)
    if not args.no_fp32:
        result["alone_vs_fp32"] = per_layer(alone, fp32)
        result["batch_vs_fp32"] = per_layer(batch, fp32)
    default = build_target_layer_ids(layers, 5)
    result["default_layers"] = default
    result["verify_batch_vs_alone"] = overall(batch, alone, default)
    if not args.no_fp32:
        result["verify_alone_vs_fp32"] = overall(alone, fp32, default)
    cols = [k for k in result if isinstance(result[k], list) and len(result[k]) == layers]
    print("layer  " + "  ".join(f"{c:>22}" for c in cols))
    for i in range(layers):
        mark = "*" if i in default else " "
        print(f"{i:>4}{mark}  " + "  ".join(f"{result[c][i]:>22.2e}" for c in cols))
    print(f"verify's figure on layers {default} (per row):")
    for k in ("verify_batch_vs_alone", "verify_alone_vs_fp32"):
        if k in result:
            print(f"  {k}: " + " ".join(f"{e:.2e}" for e in result[k]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
