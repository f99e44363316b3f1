"""The plain forwards `bench/e2e_gpu.py` measures extraction against: the target's eager and
compiled forward of the run's rows (`bench/forward_modes.py`), the matmul ceiling, and MFU by
count; each in a spawned process of its own (`in_child`), so that extraction starts on an empty
GPU."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from extract.config import ExtractConfig
from extract.target import build_target_layer_ids


def in_child(fn, *args):  # noqa: ANN001, ANN201
    """`fn(*args)` in a fresh process: the GPU memory it used is the driver's again when it
    returns (a model freed in this process can leave a whole caching-allocator segment reserved
    behind one small live tensor, 51 GB of an 80 GB GPU for the 27B target)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def plain_forward(
    target: Path, rows_path: Path, device: torch.device, modes: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """The target's plain forward (layers up to the last captured one, no hooks) over the rows
    in each of `modes`, one after the other on one load of the target: eager (padded batches as
    `--compile none` cuts them) or compiled (packed rows, the product's default on a GPU), with
    its FLOPs by count (`bench/forward_modes.py`)."""
    from forward_modes import forward_flops, measure

    from extract.target import load_target, read_config, text_config

    defaults = ExtractConfig(out=Path("unused"))
    layers = text_config(read_config(str(target)))["num_hidden_layers"]
    last = max(build_target_layer_ids(layers, defaults.num_layers))
    rows = [np.asarray(json.loads(line)["input_ids"], np.int64) for line in open(rows_path)]
    model = load_target(str(target), device=device, last_layer=last)
    body = model.get_decoder()
    flops = forward_flops(body, [len(r) for r in rows])
    out = {}
    for mode in modes:
        figures = measure(
            body,
            rows,
            mode,
            batch_tokens=defaults.batch_tokens,
            max_length=defaults.max_length,
            rows_per_part=defaults.rows_per_part,
        )
        figures.pop("_states")  # forward_modes compares packed modes' states; not JSON
        out[mode] = {**figures, "flops": flops}
    return out


def plain_forwards(
    target: Path, rows: Path, device: torch.device, compiled: bool = True
) -> dict[str, Any]:
    """The matmul ceiling in a process of its own, then the eager and (`compiled`) the compiled
    plain forward of the rows in another, on one load of the target."""
    from forward_modes import matmul_tflops

    ceiling = in_child(matmul_tflops, device)
    # One load of the target for both (54 GB for the 27B shape); the process ends with them.
    modes = ("eager", "compiled") if compiled else ("eager",)
    both = in_child(plain_forward, target, rows, device, modes)
    # each figure as it comes, for a run cut short (the table comes at the end)
    rates = "; ".join(f"{m} plain forward {both[m]['tok_s']:,.0f} tok/s" for m in modes)
    print(f"matmul {ceiling:.0f} TFLOP/s; {rates}", flush=True)
    out = {"plain_forward": both["eager"], "ceiling_tflops": ceiling}
    return out | ({"compiled_forward": both["compiled"]} if compiled else {})


def forward_mfu(forwards: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
    """MFU by count of the plain forwards and of extraction (the plain forward's FLOPs over
    extraction's seconds), and extraction against the compiled forward (where measured)."""
    plain, compiled = forwards["plain_forward"], forwards.get("compiled_forward")
    peak = forwards["ceiling_tflops"] * 1e12
    mfu = {
        "eager": plain["flops"] / plain["seconds"] / peak,
        "extract": plain["flops"] / x["seconds"] / peak,
    }
    if compiled is None:
        return {"mfu": mfu}
    return {
        "mfu": mfu | {"compiled": compiled["flops"] / compiled["seconds"] / peak},
        "extract_vs_compiled": x["tok_s"] / compiled["tok_s"],
    }
