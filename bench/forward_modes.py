"""The target's plain forward over the same rows, eager and compiled, against the matmul ceiling.

    python bench/forward_modes.py --shape qwen3-8b --tokens 300000 [--target-layers N] [--json F]

- eager: padded batches, each part sorted by length and cut as `python -m extract --compile none`
  cuts it (Hugging Face eager forward, premade masks);
- compiled: packed rows as the product's default on a GPU runs them (`extract.layouts
  .choose_layout`: document-masked flex_attention, every layer compiled), its compilation timed
  apart (it happens in the start-up probe);
- the bf16 matmul ceiling (8192^3, measured in the same process), and each mode's MFU by count:
  2 x the decoder layers' parameters per real token, plus the causal attention of each sample
  (4 x heads x head_dim x L(L+1)/2 per full-attention layer); a linear-attention layer's
  recurrent core is not counted (its projections are). Padding is never counted as work.
Each mode: one warm-up on two batches, then the faster of two passes over all rows. No capture
hooks, no copies: what the target alone costs. Random weights (real speed, not real values).
`bench/e2e_gpu.py` reports the same two modes beside extraction through the CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e_inputs import long_tailed_lengths  # noqa: E402

import extract.packed_attention as pa  # noqa: E402
from extract.batching import length_order  # noqa: E402
from extract.capture import DeviceInputs  # noqa: E402
from extract.layouts import PaddedLayout, choose_layout  # noqa: E402
from extract.packing import chunk_size  # noqa: E402
from extract.target import build_target_layer_ids, decoder_layers  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """bf16 TFLOP/s of an n^3 matmul on `device` (the best of three timings of `reps`)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2 * n**3 / best / 1e12


def forward_flops(body: torch.nn.Module, lengths: list[int]) -> float:
    """FLOPs of the forward of rows of `lengths` through `body`'s (kept) decoder layers."""
    params = sum(p.numel() for p in decoder_layers(body).parameters())
    return 2.0 * params * sum(lengths) + attention_flops(body, lengths)


def attention_flops(body: torch.nn.Module, lengths: list[int]) -> float:
    """The part of forward_flops that is each sample's causal attention (full-attention layers)."""
    layers = decoder_layers(body)
    cfg = body.config
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers)
    full = sum(t == "full_attention" for t in types[: len(layers)])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = cfg.num_attention_heads * head_dim
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return 4.0 * full * width * pairs


def part_order(rows: list, rows_per_part: int) -> list[list]:
    """Rows as extraction runs them: parts of `rows_per_part`, each sorted longest first."""
    parts = []
    for u in range(0, len(rows), rows_per_part):
        part = rows[u : u + rows_per_part]
        parts.append([part[i] for i in length_order([len(r) for r in part])])
    return parts


def timed_passes(body, layout, parts: list[list], batch_tokens: int, device) -> dict[str, Any]:  # noqa: ANN001
    """The faster of two passes of `layout`'s batches over `parts` (after a warm-up)."""
    inputs = DeviceInputs(device)
    batches = [
        [part[i] for i in b]
        for part in parts
        for b in layout.batches([len(r) for r in part], batch_tokens=batch_tokens)
    ]

    def run(todo: list) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            for rows in todo:
                kwargs, _ = layout.inputs(rows, inputs.send)
                body(**kwargs)
        sync(device)
        return time.perf_counter() - start

    run(batches[:2])
    passes = [run(batches), run(batches)]
    out = {"seconds": min(passes), "passes_s": passes, "forwards": len(batches)}
    mid = len(batches) // 2
    with torch.inference_mode():  # three rows' real tokens, to compare the modes' outputs
        states = []
        for rows in batches[mid : mid + 3]:
            kwargs, index = layout.inputs(rows, inputs.send)
            states.append(body(**kwargs).last_hidden_state.flatten(0, -2)[index])
    out["_states"] = torch.cat(states)
    if PROFILE and device.type == "cuda":
        out["kernels"] = kernel_split(lambda: run(batches[:3]))
    return out


PROFILE = False  # --profile: where the device time of three forwards goes

# Variants of the compiled mode (`--modes compiled+runs,...`): flex_attention's kernel options,
# the document BlockMask's block size and whether it lists full blocks apart
# (`extract.packed_attention`'s FLEX_OPTIONS, MASK_BLOCK, MASK_FULL_BLOCKS), set before the
# layers compile; "compiled" is the product's default. BLOCKS_ARE_CONTIGUOUS only where the mask
# lists no full blocks (with them, a query block's key blocks are two runs).
_SAFE, _CONTIG = {"ROWS_GUARANTEED_SAFE": True}, {"BLOCKS_ARE_CONTIGUOUS": True}
_B64 = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
DEFAULT = (pa.FLEX_OPTIONS, pa.MASK_BLOCK, pa.MASK_FULL_BLOCKS)
VARIANTS: dict[str, tuple[dict, int, bool]] = {
    "compiled": DEFAULT,
    "compiled+runs": (_CONTIG, 128, False),  # no full blocks: one run of key blocks each
    "compiled+partial": ({}, 128, False),
    # wrong for document masks (NaN where a visited block shows a query no key): a diagnostic
    "compiled+safe": (_CONTIG | _SAFE, 128, False),
    "compiled+tma": ({"USE_TMA": True}, 128, True),
    "compiled+b64": (_B64, 128, True),
    "compiled+mask64": (_B64, 64, True),
    # flex_attention through flash-attention 4's CuTeDSL kernels (Inductor's FLASH backend; needs
    # the flash-attn-4 package, which the product does not install)
    "compiled+fa4": ({"BACKEND": "FLASH"}, 128, True),
}


def kernel_split(fn) -> dict[str, Any]:  # noqa: ANN001
    """CUDA kernel time of `fn()` by kind (matmul, attention, Triton, other) and the top
    kernels, from torch.profiler."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    kinds, tops = Counter(), Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or 0
        if t <= 0:
            continue
        n = e.key.lower()
        if any(k in n for k in ("flex", "attention", "fmha", "flash")):  # before CUTLASS's names
            kind = "attention"
        elif any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_")):
            kind = "matmul"
        elif any(k in n for k in ("chunk", "recurrent", "l2norm", "cumsum", "solve_tril", "conv")):
            kind = "linear attention"
        elif "memcpy" in n or "memset" in n:
            kind = "copies"
        elif n.startswith("triton"):
            kind = "other Triton (Inductor)"
        else:
            kind = "other (eager)"
        kinds[kind] += t
        tops[e.key[:90]] += t
    total = sum(kinds.values())
    return {
        "total_ms": total / 1e3,
        "share": {k: v / total for k, v in kinds.most_common()},
        "top": [(k, v / total) for k, v in tops.most_common(10)],
    }


def measure(body, rows: list[np.ndarray], mode: str, *, batch_tokens: int, max_length: int,
            rows_per_part: int = 512, attention: str | None = None) -> dict[str, Any]:  # fmt: skip  # noqa: ANN001
    """One mode's figures over `rows` (token id arrays): tok/s, seconds, compile seconds."""
    device = next(body.parameters()).device
    parts = part_order(rows, rows_per_part)
    start = time.perf_counter()
    if mode == "eager":
        layout = PaddedLayout(body, pad_id=0)
    else:
        name = mode.split("@")[0]
        pa.FLEX_OPTIONS, pa.MASK_BLOCK, pa.MASK_FULL_BLOCKS = VARIANTS[name]
        torch._dynamo.reset()  # each variant compiles afresh
        chunk = chunk_size(batch_tokens, max_length)
        layout = choose_layout(
            body,
            packed=True,
            compile_layers=True,
            chunk_tokens=chunk,
            pad_id=0,
            attention=attention,
        )
        if layout.name != "packed":
            raise RuntimeError("the compiled forward fell back to padded batches: see the log")
    setup_s = time.perf_counter() - start
    figures = timed_passes(body, layout, parts, batch_tokens, device)
    if layout.name == "packed":
        layout.uninstall()  # the next mode starts from the model as loaded
    tokens = sum(len(r) for r in rows)
    return {
        "mode": mode,
        "layout": layout.describe(),
        "tokens": tokens,
        "tok_s": tokens / figures["seconds"],
        "setup_s": setup_s,
        "compile_s": getattr(layout, "compile_s", 0.0),
        "graphs": getattr(layout, "graphs", 0),
        **figures,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=300_000)
    p.add_argument("--target-layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument(
        "--modes",
        default="eager,compiled",
        help="eager, compiled or a variant of VARIANTS; MODE@N: packed rows of N tokens",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--profile", action="store_true", help="also split 3 forwards' kernel time")
    p.add_argument(
        "--attention",
        default=None,
        choices=("flex", "flash", "sdpa"),
        help="the compiled mode's attention kernel (extract's --attention; default: its auto)",
    )
    args = p.parse_args()
    global PROFILE
    PROFILE = args.profile
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from shapes import hf_config, random_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = args.target_layers or hf_config(args.shape).num_hidden_layers
    last = max(build_target_layer_ids(layers, 5))
    model = random_model(
        args.shape,
        device=device.type,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        last_layer=last,
    )
    body = model.get_decoder()
    lengths = long_tailed_lengths(args.tokens, seed=0)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, min(1000, body.config.vocab_size), n) for n in lengths]
    ceiling = matmul_tflops(device)
    flops = forward_flops(body, lengths)
    out: dict[str, Any] = {"shape": args.shape, "layers": last + 1, "ceiling_tflops": ceiling}
    out["attention_flops_share"] = attention_flops(body, lengths) / flops
    print(f"{flops / 1e12:,.1f} TFLOP by count, {out['attention_flops_share']:.1%} of it attention")
    reference: dict = {}  # (eager?, row size) -> the first such mode's output states
    for mode in args.modes.split(","):
        try:
            r = measure(
                body, rows, mode, max_length=3072,
                batch_tokens=int(mode.split("@")[1]) if "@" in mode else args.batch_tokens,
                attention=args.attention,
            )  # fmt: skip
        except Exception as e:  # a variant this machine cannot run: said, the others go on
            print(f"{mode}: failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
            continue
        r["mfu"] = flops / r["seconds"] / (ceiling * 1e12)
        states = r.pop("_states")
        key = (mode == "eager", tuple(mode.split("@")[1:]))
        if key not in reference:
            reference[key] = (mode, states)
        ref_mode, ref = reference[key]
        ref = ref.float()
        r["max_diff"] = ((states.float() - ref).abs().max() / ref.abs().max()).item()
        r["nonfinite"] = int((~states.isfinite()).sum())
        r["diff_from"] = ref_mode
        out[mode] = r
        print(
            f"{mode:9s} {r['tok_s']:>9,.0f} tok/s  MFU {r['mfu']:.1%} of {ceiling:.0f} TFLOP/s  "
            f"setup {r['setup_s']:.1f} s (compile {r['compile_s']:.1f} s, {r['graphs']} graphs)  "
            f"passes {', '.join(f'{s:.2f}' for s in r['passes_s'])} s  {r['layout']}  "
            f"max |diff| / max |{r['diff_from']}| {r['max_diff']:.1e}, {r['nonfinite']} not finite",
            flush=True,
        )
        if "kernels" in r:
            k = r["kernels"]
            print("  kernels:", ", ".join(f"{n} {v:.1%}" for n, v in k["share"].items()))
            for name, share in k["top"]:
                print(f"    {share:6.1%}  {name}")
    if "eager" in out:
        for mode in out:
            if mode.startswith("compiled") and "tok_s" in out[mode]:
                print(f"{mode} / eager: {out[mode]['tok_s'] / out['eager']['tok_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
