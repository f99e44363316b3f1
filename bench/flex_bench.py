"""flex_attention forward and backward of one drafter layer, per kernel configuration.

    python bench/flex_bench.py --shape qwen3.6-27b

The attention of one drafter layer exactly as a training step runs it: queries of 512 blocks of 16,
keys and values of the 3072 context tokens then the block tokens, the product's BlockMask
(`train.drafters.mask.build_masks` on anchors drawn by `train.drafters.anchors.sample_anchors`),
GQA, bf16, compiled flex_attention. Times, side by side in one process, the forward alone and
forward + backward for Inductor's own choice ("default"), for
`train.drafters.mask.flex_kernel_options` (what the product passes, "product"), for each candidate
in CANDIDATES, and optionally with Inductor's autotuning over its configuration list ("--autotune":
minutes of compilation). Prints one row per configuration with its ratio to the default, and writes
--json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import drafter_setup as ds  # noqa: E402  (also puts the project root on sys.path)

from train.drafters.anchors import sample_anchors  # noqa: E402
from train.drafters.mask import build_masks, flex_bwd_options, flex_kernel_options  # noqa: E402

# Backward block sizes (M1, N1, M2, N2), warps, stages: each must divide the mask's 128-row
# blocks, N1 a multiple of M1 and M2 a multiple of N2 (the kernel's static assertions).
CANDIDATES: dict[str, tuple[int, int, int, int, int, int]] = {
    "bwd-32-64-64-32-w4-s2": (32, 64, 64, 32, 4, 2),
    "bwd-32-64-64-32-w4-s3": (32, 64, 64, 32, 4, 3),
    "bwd-64-64-64-64-w8-s1": (64, 64, 64, 64, 8, 1),
    "bwd-64-64-64-64-w8-s2": (64, 64, 64, 64, 8, 2),
    "bwd-32-128-128-32-w8-s2": (32, 128, 128, 32, 8, 2),
    "bwd-64-128-128-64-w8-s1": (64, 128, 128, 64, 8, 1),
    "bwd-32-32-32-32-w4-s3": (32, 32, 32, 32, 4, 3),
    # Around Inductor's sm90 default for head_dim <= 128, (64, 128, 128, 64, 8 warps, 3 stages):
    "bwd-64-128-128-64-w8-s2": (64, 128, 128, 64, 8, 2),
    "bwd-64-64-64-64-w4-s3": (64, 64, 64, 64, 4, 3),
    "bwd-64-64-64-64-w8-s3": (64, 64, 64, 64, 8, 3),
}


def layer_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """q [1, heads, Q, D], k/v [1, kv heads, S + Q, D] and the BlockMask of one step."""
    cfg = ds.drafter_config(args.shape)
    seq, anchors = args.seq_len, args.anchors
    gen = torch.Generator().manual_seed(0)  # on the CPU, as the trainer's
    mask_BS = ds.prompt_mask(1, seq).to(device)
    doc_ids_BS = torch.zeros(1, seq, dtype=torch.int32, device=device)  # one sample per row
    anchors_BN, keep_BN = sample_anchors(mask_BS, doc_ids_BS, num_anchors=anchors, generator=gen)
    masks = build_masks(
        anchors_BN,
        keep_BN,
        context_len=seq,
        block_size=cfg.block_size,
        layer_types=("full_attention",),
        sliding_window=None,
        attention="flex",
    )
    q_len = anchors_BN.shape[1] * cfg.block_size
    d = cfg.head_dim

    def rand(heads: int, length: int) -> torch.Tensor:
        t = torch.randn(1, heads, length, d, device=device, dtype=torch.bfloat16)
        return t.requires_grad_(True)

    return {
        "q": rand(cfg.num_attention_heads, q_len),
        "k": rand(cfg.num_key_value_heads, seq + q_len),
        "v": rand(cfg.num_key_value_heads, seq + q_len),
        "mask": masks["full_attention"],
        "head_dim": d,
    }


def time_config(
    fn, inputs: dict[str, Any], options: dict | None, repeats: int, reference: list | None
) -> tuple[dict, list[torch.Tensor]]:
    """Forward ms and forward + backward ms (CUDA events, after two untimed runs), and the
    gradients of q, k, v; with `reference` gradients, the largest difference to them relative
    to their largest magnitude."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    kwargs = dict(block_mask=inputs["mask"], scale=inputs["head_dim"] ** -0.5, enable_gqa=True)
    if options:
        kwargs["kernel_options"] = options
    gen = torch.Generator(q.device).manual_seed(1)
    grad = torch.randn(q.shape, generator=gen, device=q.device, dtype=q.dtype)

    def fwd_bwd() -> list[torch.Tensor]:
        out = fn(q, k, v, **kwargs)
        return list(torch.autograd.grad(out, (q, k, v), grad))

    def fwd() -> None:
        with torch.no_grad():
            fn(q, k, v, **kwargs)

    out = {}
    for name, step in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        for _ in range(2):
            step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) / repeats
    grads = [g.float() for g in fwd_bwd()]
    if reference is not None:
        out["grad_rel_diff"] = max(
            float((g - r).abs().max() / r.abs().max())
            for g, r in zip(grads, reference, strict=True)
        )
    return out, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--candidates", default="all", help="comma-separated CANDIDATES names, or all")
    p.add_argument("--autotune", action="store_true", help="also Inductor's autotuning")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("flex_bench.py needs a CUDA device (flex_attention has no CPU backward)")
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device("cuda")
    inputs = layer_inputs(args, device)
    names = list(CANDIDATES) if args.candidates == "all" else args.candidates.split(",")
    configs: dict[str, dict | None] = {"default": None}
    configs["product"] = flex_kernel_options(inputs["head_dim"], device)
    configs.update({n: flex_bwd_options(CANDIDATES[n]) for n in names})
    rows, reference = [], None
    for name, options in configs.items():
        if name == "product" and options is None:
            continue  # the product leaves this head_dim to Inductor: the default row
        torch._dynamo.reset()
        fn = torch.compile(flex_attention)
        try:
            timing, grads = time_config(fn, inputs, options, args.repeats, reference)
            reference = grads if reference is None else reference
            rows.append({"config": name, "options": options, **timing})
        except Exception as e:  # a configuration that does not fit (shared memory): listed
            rows.append(
                {"config": name, "options": options, "error": f"{type(e).__name__}: {e}"[:300]}
            )
        print(json.dumps(rows[-1]), flush=True)
    if args.autotune:
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
        timing, _ = time_config(fn, inputs, None, args.repeats, reference)
        rows.append({"config": "autotune", "options": None, **timing})
        print(json.dumps(rows[-1]), flush=True)
    base_bwd = rows[0]["fwd_bwd_ms"] - rows[0]["fwd_ms"]
    for r in rows:
        if "error" in r:
            print(f"{r['config']:<26} failed: {r['error'][:100]}")
            continue
        r["bwd_vs_default"] = (r["fwd_bwd_ms"] - r["fwd_ms"]) / base_bwd
        print(
            f"{r['config']:<26} fwd {r['fwd_ms']:7.2f} ms  fwd+bwd {r['fwd_bwd_ms']:7.2f} ms  "
            f"backward / default backward {r['bwd_vs_default']:.3f}, gradients differ by "
            f"{r.get('grad_rel_diff', 0.0):.1e} of their largest magnitude"
        )
    res = {
        "bench": "flex",
        "shape": args.shape,
        "q_shape": list(inputs["q"].shape),
        "kv_shape": list(inputs["k"].shape),
        "rows": rows,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
    }
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
