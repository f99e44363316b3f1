"""How far a sharded layout's states are from one process's, per layer, in a given dtype.

    python bench/parallel_noise.py --family qwen3 --parallel tp=2 --dtype bfloat16

Builds the tiny random target of `--family` (tests/families.py), runs one row through it in one
process and, on `--procs` CPU processes (gloo), through transformers' distributed loading of the
layout, and prints ||sharded - one|| / ||one|| of every decoder layer's output (the last after the
final norm, as extraction stores it). On CPUs; the layout's inputs are the same on every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def states(model, ids: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    return [h.float() for h in out.hidden_states[1:]]


def rank(r: int, world: int, target: str, kwargs: dict, dtype: str, ids, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dist.init_process_group("gloo", rank=r, world_size=world)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=getattr(torch, dtype), distributed_config=DistributedConfig(**kwargs)
    ).eval()
    out = states(model, ids)
    if r == 0:
        queue.put([h.numpy() for h in out])
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="qwen3")
    p.add_argument("--parallel", default="tp=2")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from extract.parallel import engine_kwargs, parse_layout
    from tests.families import build_family

    target = str(build_family(Path(tempfile.mkdtemp()) / args.family, args.family))
    kwargs = engine_kwargs(parse_layout(args.parallel, args.procs))
    ids = torch.randint(0, 400, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    one = states(
        AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, args.dtype)).eval(), ids
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=rank, args=(r, args.procs, target, kwargs, args.dtype, ids, queue))
        for r in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    sharded = [torch.from_numpy(h) for h in queue.get()]
    for proc in procs:
        proc.join()
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(sharded, one, strict=True)]
    print(f"{args.family} {args.parallel} {args.dtype}, {args.tokens} tokens, per layer:")
    print(" ".join(f"{e:.2e}" for e in errors))


if __name__ == "__main__":
    main()
