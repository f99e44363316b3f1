"""Muon's step with its Newton-Schulz work split among the ranks, against every rank doing it all.

    python bench/muon_shard.py --shape qwen3-8b --gpus 0,1,2
    python bench/muon_shard.py --shape qwen3-8b --hidden 1024 --gpus cpu:2

Builds the drafter a run would build for the shape (bench/drafter_setup.py), takes its hidden
matrices (`train.optim.hidden_matrices`: what `--optimizer muon` gives to Muon), gives them the
same random gradients on every rank (as DDP's averaged gradients are) and times `--steps` optimizer
steps of `train.optim.ShardedMuon` (each matrix orthogonalised by one rank, then broadcast) and of
`torch.optim.Muon` (every rank orthogonalises every matrix), alternating, after `--warmup` of each.
`--hidden H` narrows the shape (hidden H, intermediate 3H, heads of 128) for a CPU.
Prints each one's median step in ms on rank 0, their ratio, and whether the two ended with the
same weights bit for bit. One GPU per rank (NCCL), or `cpu:N` ranks (gloo; one intra-op thread
each, so that N ranks share N cores).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from drafter_setup import drafter_config  # noqa: E402
from shapes import SHAPES  # noqa: E402

from shared.dist import RankInfo, launch, parse_gpus  # noqa: E402
from train.drafters.registry import build_drafter  # noqa: E402
from train.optim import ShardedMuon, hidden_matrices  # noqa: E402


def timed_step(opt: torch.optim.Optimizer, device: torch.device) -> float:
    """Seconds of one optimizer step, every rank finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - start


def shape_name(shape: str, hidden: int | None) -> str:
    """`shape`, or a narrower copy of it registered in SHAPES under a new name."""
    if hidden is None:
        return shape
    name = f"{shape}@{hidden}"
    SHAPES[name] = {
        **SHAPES[shape],
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_attention_heads": max(1, hidden // 128),
        "num_key_value_heads": max(1, hidden // 512),
        "head_dim": 128,
    }
    return name


def rank_main(info: RankInfo, args: argparse.Namespace) -> None:
    if info.device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = shape_name(args.shape, args.hidden)
    model = build_drafter(drafter_config(shape, num_layers=args.layers))
    hidden, _ = hidden_matrices(model.to(info.device))
    reference = [p.detach().clone().requires_grad_() for p in hidden]
    gen = torch.Generator(device=info.device).manual_seed(1)
    for a, b in zip(hidden, reference, strict=True):
        a.grad = torch.randn(a.shape, generator=gen, device=info.device) * 1e-3
        b.grad = a.grad.clone()
    sharded = ShardedMuon(hidden, lr=0.02, weight_decay=0.01)
    whole = torch.optim.Muon(reference, lr=0.02, weight_decay=0.01)
    times: dict[str, list[float]] = {"sharded": [], "whole": []}
    for i in range(args.warmup + args.steps):
        for name, opt in (("sharded", sharded), ("whole", whole)):
            seconds = timed_step(opt, info.device)
            if i >= args.warmup:
                times[name].append(seconds)
    same = all(torch.equal(a, b) for a, b in zip(hidden, reference, strict=True))
    agreed = torch.tensor([int(same)], device=info.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if info.rank == 0:
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        params = sum(p.numel() for p in hidden)
        print(
            f"{shape}, {args.layers} layers: {len(hidden)} matrices, {params / 1e6:.1f} M "
            f"parameters, {info.world_size} ranks ({info.device.type})\n"
            f"  torch.optim.Muon (every rank all matrices): {ms['whole']:.1f} ms a step\n"
            f"  ShardedMuon (each matrix on one rank, broadcast): {ms['sharded']:.1f} ms a step\n"
            f"  ratio {ms['whole'] / ms['sharded']:.2f}x; the same weights bit for bit after "
            f"{args.warmup + args.steps} steps: {'yes' if agreed.item() else 'NO'}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=5, help="drafter layers (default 5)")
    p.add_argument("--hidden", type=int, default=None, help="narrow the shape (for a CPU)")
    p.add_argument("--gpus", default="0,1", help="GPUs (one rank each) or cpu:N")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    spec = parse_gpus(args.gpus)
    if spec.nprocs < 2:
        raise SystemExit("--gpus: at least two ranks, or nothing is split")
    launch(rank_main, (args,), spec)


if __name__ == "__main__":
    main()
