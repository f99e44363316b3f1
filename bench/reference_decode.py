"""z-lab's reference decoding loop (`dflash.model.dflash_generate`, dflash 0.1.0) on exported
DFlash drafters, printing the JSON lines of `train.proof.speculate --json`, so that
`python -m train.proof.tau` reads, joins and compares either decoder's outputs.

    python bench/reference_decode.py --target T --drafter EXPORT [--drafter ...] \
        --prompts PROMPTS.json [--max-new-tokens 64] [--shard K/N] [--device cpu]

Greedy, float32 on a CPU (bf16 on CUDA, as `train.proof.speculate`). The reference's
`return_stats` clock calls `torch.cuda.synchronize()`, which a CPU-only torch refuses: in this
process it is the plain clock (the package is not changed). The target, prompts and stop ids
are loaded as `train.proof.speculate` loads them, and every decoding is checked against the
target's plain greedy output (`train.proof.decode.greedy`): a drafter whose reference decoding
leaves greedy is reported, as ours are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.proof.lossless import greedy_baselines  # noqa: E402
from train.proof.speculate import SpeculateConfig, load, shard_range  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", type=Path, action="append", required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default=None, help="default cuda where there is one, else cpu")
    p.add_argument("--shard", default=None, help="K/N, as train.proof.speculate's --shard")
    return p.parse_args(argv)


def reference_module():
    """dflash.model with its stats clock usable without CUDA; SystemExit saying what to install."""
    try:
        import dflash.model as ref
    except ImportError:
        raise SystemExit(
            "bench/reference_decode.py needs z-lab's reference package: "
            "pip install --no-deps dflash==0.1.0"
        ) from None
    if not torch.cuda.is_available():
        ref._cuda_time = time.perf_counter
    return ref


def decode_one(ref, drafter, target, ids: list[int], *, max_new_tokens: int, eos: list[int]):
    """(acceptance lengths, new token ids) of one prompt through the reference loop."""
    device = next(target.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    out = ref.dflash_generate(drafter, target, input_ids, max_new_tokens, eos, return_stats=True)
    return list(out.acceptance_lengths), out.output_ids[0, len(ids) :].tolist()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    ref = reference_module()
    cfg = SpeculateConfig(
        target=a.target,
        drafter=tuple(a.drafter),
        prompts=a.prompts,
        max_new_tokens=a.max_new_tokens,
        device=a.device,
        shard=a.shard,
    )
    target, _, prompts, eos = load(cfg)
    share = range(len(prompts)) if a.shard is None else shard_range(a.shard, len(prompts))
    prompts = prompts[share.start : share.stop]
    dtype = next(target.parameters()).dtype
    baselines = greedy_baselines(target, prompts, max_new_tokens=a.max_new_tokens, eos_ids=eos)
    for path in a.drafter:
        drafter = ref.DFlashDraftModel.from_pretrained(str(path), dtype=dtype)
        drafter = drafter.to(next(target.parameters()).device).eval()
        rows = []
        for n, (ids, base) in enumerate(zip(prompts, baselines, strict=True), start=share.start):
            lengths, new = decode_one(
                ref, drafter, target, list(ids), max_new_tokens=a.max_new_tokens, eos=eos
            )
            same = new[: len(base.new_ids)] == list(base.new_ids)
            rows.append(
                dict(
                    index=n,
                    prompt_tokens=len(ids),
                    steps=len(lengths),
                    tau=sum(lengths) / len(lengths) if lengths else float("nan"),
                    lossless=same,
                    lengths=lengths,
                )
            )
        lengths = [x for r in rows for x in r["lengths"]]
        summary = {
            "drafter": str(path),
            "decoder": "dflash.model.dflash_generate (dflash 0.1.0)",
            "tau": sum(lengths) / len(lengths) if lengths else float("nan"),
            "lossless": all(r["lossless"] for r in rows),
            "lossless_up_to_near_ties": all(r["lossless"] for r in rows),
            "dtype": str(dtype).removeprefix("torch."),
            "max_new_tokens": a.max_new_tokens,
            "prompts": len(rows),
            "steps": len(lengths),
            "shard": a.shard,
            "per_prompt": rows,
        }
        differ = [r["index"] for r in rows if not r["lossless"]]
        print(
            f"{path}: tau {summary['tau']:.4f} over {len(rows)} prompts, "
            + (f"differs from greedy on prompts {differ}" if differ else "lossless"),
            file=sys.stderr,
        )
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
