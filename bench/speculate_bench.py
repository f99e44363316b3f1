"""Speculative decoding step costs on a real-shaped target: draft, verify, plain decode step.

    python bench/speculate_bench.py --shape qwen3-8b --context 1024,4096

Builds the whole random target (with its lm_head) and a random 5-layer drafter of the shape on
the device (bf16 on CUDA), then for each --context length C prefills the target's cache with C
random tokens (`train.proof.decode.TargetCache`, hybrid linear-attention layers included) and the
drafter's context cache (`DraftState.extend` with C rows of random target features), and times
each call synchronised, the way `train.proof.decode.speculate()` clocks itself:

  draft   `DraftState.propose` of one block of 16 tokens, then `DraftState.extend` by --kept
          context rows: the drafter's work per verify step;
  verify  the target's work per step of `speculate()`: recurrent-state snapshot (hybrid
          targets), the forward of the 16 block tokens against the cache at positions
          C..C+15 with hidden states, drafts and argmax to the host, the context features, and
          `TargetCache.keep` of --kept tokens (a crop; on hybrid targets also the replay of the
          kept tokens from the snapshot);
  step    one plain decode step of `greedy()`: one token against the cache, argmax to the host.

Both caches are rolled back to C between calls (untimed), so every call sees context C. Prints
speedup(tau) = tau * t_step / (t_draft + t_verify) for tau in 2..7: the decode speedup a
drafter with mean acceptance length tau buys at that context. Random weights give real times
but no acceptance: tau comes from a trained drafter (`python -m train.proof.speculate`). These are
Hugging Face eager forwards at batch 1, launch-bound rather than bandwidth-bound; a serving
engine with CUDA graphs shortens t_step and t_verify, so read the speedups as this loop's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import drafter_setup as ds  # noqa: E402  (also puts the project root on sys.path)
import train_bench as tb  # noqa: E402
from shapes import random_model  # noqa: E402

from train.drafters.dflash import DFlashDrafter, init_drafter_weights  # noqa: E402
from train.proof.decode import (  # noqa: E402
    DraftState,
    TargetCache,
    begin_decoding,
    context_features,
    crop_cache,
    sync_clock,
)

log = logging.getLogger("speculate_bench")

TAUS = (2, 3, 4, 5, 6, 7)


def build(shape: str, device: torch.device) -> tuple[torch.nn.Module, DFlashDrafter]:
    """The random target (all layers, lm_head) and drafter, in the decoding dtype."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = random_model(shape, device=str(device), dtype=dtype)
    drafter = DFlashDrafter(ds.drafter_config(shape))
    init_drafter_weights(drafter, seed=0)
    return target, drafter.to(device, dtype).eval()


def median_ms(
    fn: Callable[[], None],
    after: Callable[[], None],
    *,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> float:
    """Median milliseconds of `fn` (synchronised clock), `after` run untimed after each call."""
    seconds = []
    for n in range(warmup + repeats):
        start = sync_clock(device)
        fn()
        if n >= warmup:
            seconds.append(sync_clock(device) - start)
        after()
    return 1e3 * sorted(seconds)[len(seconds) // 2]


def rollback(draft: DraftState, length: int) -> None:
    """Drop the drafter's context rows past `length`."""
    draft.keys = [k[:, :, :length] for k in draft.keys]
    draft.values = [v[:, :, :length] for v in draft.values]
    draft.length = length


def rollback_target(cache: TargetCache, length: int, base: list) -> None:
    """Crop the target's cache to `length` and restore the recurrent states saved there."""
    crop_cache(cache.cache, length)
    for states, saved in zip(cache._recurrent(), base, strict=True):
        for key, value in saved.items():
            states[key].copy_(value)


@torch.inference_mode()
def time_context(
    target: torch.nn.Module,
    drafter: DFlashDrafter,
    context: int,
    *,
    kept: int,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Median ms of a draft step, a verify step and a plain decode step at `context`."""
    cfg, device = drafter.cfg, drafter.fc.weight.device
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, cfg.mask_token_id, (context,), generator=gen)
    ids_1P, cache = begin_decoding(target, prompt, 1)
    target(ids_1P, **cache.kwargs, logits_to_keep=1)  # prefill
    base = cache.snapshot()
    embed_VH = target.get_input_embeddings().weight
    draft = DraftState(drafter, embed_VH, target.get_output_embeddings().weight)
    width = cfg.num_context_layers * cfg.hidden_size
    draft.extend(torch.randn(1, context, width, device=device, dtype=embed_VH.dtype))
    rows_1KC = torch.randn(1, kept, width, device=device, dtype=embed_VH.dtype)
    block_1Q = torch.full((1, cfg.block_size), cfg.mask_token_id, device=device)
    block_1Q[0, 0] = int(prompt[-1])
    pos_1Q = torch.arange(context, context + cfg.block_size, device=device)[None]

    def draft_step() -> None:
        block_1Q[0, 1:] = draft.propose(block_1Q)
        draft.extend(rows_1KC)

    def verify_step() -> None:  # the target's part of one step of speculate()
        snapshot = cache.snapshot()
        out = target(block_1Q, position_ids=pos_1Q, **cache.kwargs, output_hidden_states=True)
        torch.stack([block_1Q[0], out.logits[0].argmax(dim=-1)]).tolist()
        context_features(out.hidden_states, cfg.target_layer_ids)
        cache.keep(block_1Q, context, kept, snapshot)

    def decode_step() -> None:  # one step of greedy()
        out = target(block_1Q[:, :1], **cache.kwargs)
        int(out.logits[0, -1].argmax())

    kw: dict[str, Any] = dict(device=device, warmup=warmup, repeats=repeats)
    draft_ms = median_ms(draft_step, lambda: rollback(draft, context), **kw)
    verify_ms = median_ms(verify_step, lambda: rollback_target(cache, context, base), **kw)
    step_ms = median_ms(decode_step, lambda: rollback_target(cache, context, base), **kw)
    return {
        "context": context,
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "step_ms": step_ms,
        "verify_over_step": verify_ms / step_ms,
        "speedup": {str(tau): tau * step_ms / (draft_ms + verify_ms) for tau in TAUS},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(ds.SHAPES), default="qwen3-8b")
    p.add_argument("--context", default="1024,4096", help="comma-separated context lengths")
    p.add_argument(
        "--kept",
        type=int,
        default=4,
        help="tokens a verify step keeps (accepted drafts + 1): the drafter's new context rows "
        "and, on hybrid targets, the replayed tokens",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20, help="timed calls (median reported)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target, drafter = build(args.shape, device)
    rows = [
        time_context(
            target,
            drafter,
            int(c),
            kept=args.kept,
            warmup=args.warmup,
            repeats=args.repeats,
        )
        for c in args.context.split(",")
    ]
    result = {
        "bench": "speculate",
        "shape": args.shape,
        "block_size": drafter.cfg.block_size,
        "kept": args.kept,
        "repeats": args.repeats,
        "contexts": rows,
        **tb.device_facts(device),
    }
    tb.emit(result, args.json)


if __name__ == "__main__":
    main()
