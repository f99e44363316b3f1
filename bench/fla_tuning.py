"""What a hybrid target's first forwards on a machine cost: flash-linear-attention tunes its
Triton kernels for every new value of their autotune keys, and some keys follow the batch shape.

    python bench/fla_tuning.py [--shape qwen3.6-27b] [--layers 4]

Builds a random-weight target of the shape's first `--layers` layers, then times one forward of
each batch shape below with a fresh Triton cache (so earlier runs' tuning results do not hide
it), printing Triton's autotuning events between them. The timed forwards come after
extraction's mask probe (`extract.masks.choose_masks`, two small forwards, which tune first).
Needs a GPU and flash-linear-attention.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Before Triton is imported: name every tuning, and tune from nothing.
os.environ["TRITON_PRINT_AUTOTUNING"] = "1"
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fla_tuning_triton_")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from e2e_inputs import write_target  # noqa: E402

from extract.masks import choose_masks, forward_kwargs  # noqa: E402
from extract.target import load_target  # noqa: E402

# Rows x length: same tokens in other shapes, a few tokens more, other batch sizes, repeats.
SHAPES = [
    (4, 1024), (4, 1040), (4, 2048), (4, 1100), (5, 1024), (8, 1024),
    (3, 1024), (4, 1024), (1, 4096), (2, 2048), (16, 256),
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-27b")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        write_target(args.shape, target, layers=args.layers, device="cuda")
        body = load_target(str(target), device=device, last_layer=args.layers).get_decoder()
        masks = choose_masks(body)
        for shape in SHAPES:
            ids = torch.randint(0, 1000, shape, device=device)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                body(**forward_kwargs(ids, masks))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            print(f"forward of {shape[0]} x {shape[1]}: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(os.environ["TRITON_CACHE_DIR"], ignore_errors=True)
