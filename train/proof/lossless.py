"""The lossless check of speculative decoding: every prompt decoded speculatively and by the
target's plain greedy decoding, token for token, with tau, its standard error and tokens/s;
where the two differ, whether the target's logits of the two tokens were a near-tie in its dtype.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shared.progress import progress_bar
from train.drafters.dflash import DFlashDrafter
from train.proof.decode import Result, greedy, pooled_tau_se, se_words
from train.proof.dspark_decode import decode

log = logging.getLogger(__name__)

# Two decodings by one target in one dtype can pick different tokens where two logits are within
# rounding of each other: a verify step over a block and a one-token step sum in other orders.
# On an H200 in bf16 (SmolLM2-135M-Instruct, 32 held-out prompts x 96 tokens) 24 of 32 prompts
# diverged so, and none of 8 in float32 (README, "Real model"). A divergence counts as a
# near-tie when the target's logits of the two tokens, recomputed over the common prefix, are
# within this many of the dtype's epsilons of each other (relative to the larger).
NEAR_TIE_EPS = 4


def near_tie_tolerance(dtype: torch.dtype) -> float:
    """The relative logit gap under which a divergence in `dtype` counts as a near-tie.

    >>> near_tie_tolerance(torch.bfloat16)
    0.03125
    """
    return NEAR_TIE_EPS * torch.finfo(dtype).eps


@torch.inference_mode()
def divergence_gap(
    target: nn.Module, prompt_ids: Sequence[int], common: Sequence[int], a: int, b: int
) -> float:
    """|l_a - l_b| / max(|l_a|, |l_b|, 1) for the target's logits l of tokens `a` and `b` after
    the prompt and the `common` tokens (one forward in the target's own dtype)."""
    device = next(target.parameters()).device
    ids = torch.tensor([[*prompt_ids, *common]], dtype=torch.long, device=device)
    logits = target(ids, logits_to_keep=1).logits[0, -1].float()
    la, lb = float(logits[a]), float(logits[b])
    return abs(la - lb) / max(abs(la), abs(lb), 1.0)


def _divergence(
    target: nn.Module, prompt_ids: Sequence[int], spec: list[int], base: list[int], at: int
) -> float | None:
    """The relative logit gap of the two tokens chosen at `at`; None where one output ended."""
    if at >= min(len(spec), len(base)):
        return None
    return divergence_gap(target, prompt_ids, base[:at], base[at], spec[at])


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    diff = [n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y]
    return diff[0] if diff else (None if len(a) == len(b) else min(len(a), len(b)))


def greedy_baselines(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    warmup: int = 0,
) -> list[Result]:
    """The target's plain greedy decoding of every prompt (after `warmup` untimed runs of the
    first): the reference every drafter's speculative output is checked against."""
    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    for _ in range(warmup):  # first calls pay for kernel selection and allocator growth
        greedy(target, prompts[0], **kwargs)
    bar = progress_bar(total=len(prompts), desc="greedy decoding", unit="prompts")
    results = []
    for ids in prompts:
        results.append(greedy(target, ids, **kwargs))
        bar.update()
    bar.close()
    return results


def compare_with_greedy(
    target: nn.Module,
    drafter: DFlashDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    warmup: int = 0,
    baselines: Sequence[Result] | None = None,
    options: dict[str, Any] | None = None,
    first_index: int = 0,
    desc: str = "speculative decoding",
) -> dict[str, Any]:
    """Speculative vs plain greedy decoding of every prompt: tau, losslessness, tokens/s.
    `baselines`: the prompts' greedy decodings already made (`greedy_baselines`, same prompts
    and limits), else they are made here. `options`: passed to each decoding (`full_blocks`; a
    DSpark drafter's confidence cut). `first_index`: the first prompt's index in the list it was
    cut from (a share of it), for the rows and warnings. `desc`: its progress bar's name."""
    kwargs = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    if baselines is None:
        baselines = greedy_baselines(target, prompts, **kwargs, warmup=warmup)
    if len(baselines) != len(prompts):
        raise ValueError(f"{len(baselines)} greedy baselines for {len(prompts)} prompts")
    kwargs_spec = {**kwargs, **(options or {})}
    for _ in range(warmup):
        decode(target, drafter, prompts[0], **kwargs_spec)
    dtype = next(target.parameters()).dtype
    tolerance = near_tie_tolerance(dtype)
    rows, lengths, spec_s, base_s, base_tokens, per_prompt = [], [], 0.0, 0.0, 0, []
    bar = progress_bar(total=len(prompts), desc=desc, unit="prompts")
    for n, (ids, base) in enumerate(zip(prompts, baselines, strict=True), start=first_index):
        spec = decode(target, drafter, ids, **kwargs_spec)
        bar.update()
        mismatch = _first_mismatch(spec.new_ids, base.new_ids)
        gap = None
        if mismatch is not None:
            gap = _divergence(target, ids, spec.new_ids, base.new_ids, mismatch)
            log.warning(
                "prompt %d: speculative output differs from greedy at token %d (%s)",
                n,
                mismatch,
                _gap_words(gap, tolerance),
            )
        lengths += spec.acceptance_lengths
        per_prompt.append(spec.acceptance_lengths)
        spec_s, base_s = spec_s + spec.seconds, base_s + base.seconds
        base_tokens += len(base.new_ids)
        rows.append(
            dict(
                index=n,
                prompt_tokens=len(ids),
                new_tokens=len(spec.new_ids),
                steps=len(spec.acceptance_lengths),
                tau=spec.tau,
                lossless=mismatch is None,
                first_mismatch=mismatch,
                gap=gap,
                near_tie=gap is not None and gap <= tolerance,
                tokens_per_s=len(spec.new_ids) / max(spec.seconds, 1e-9),
                baseline_tokens_per_s=len(base.new_ids) / max(base.seconds, 1e-9),
                lengths=spec.acceptance_lengths,  # tokens made by each verify step
                new_ids=spec.new_ids,
            )
        )
    bar.close()
    new_tokens = sum(r["new_tokens"] for r in rows)
    speed, baseline = new_tokens / max(spec_s, 1e-9), base_tokens / max(base_s, 1e-9)
    return {
        "tau": sum(lengths) / len(lengths) if lengths else float("nan"),
        "tau_se": pooled_tau_se(per_prompt),
        "lossless": all(r["lossless"] for r in rows),
        "near_ties": sum(r["near_tie"] for r in rows),
        "lossless_up_to_near_ties": all(r["lossless"] or r["near_tie"] for r in rows),
        "dtype": str(dtype).removeprefix("torch."),
        "near_tie_tolerance": tolerance,
        "tokens_per_s": speed,
        "baseline_tokens_per_s": baseline,
        "speedup": speed / baseline,
        "prompts": len(rows),
        "new_tokens": new_tokens,
        "steps": len(lengths),
        "block_size": drafter.cfg.block_size,
        "max_new_tokens": max_new_tokens,
        "per_prompt": rows,
    }


def format_report(summary: dict[str, Any]) -> str:
    """A per-prompt table and a summary line."""
    lines = [
        f"{'prompt':>6} {'in':>5} {'new':>5} {'steps':>5} {'tau':>6} {'tok/s':>9} {'greedy':>9}"
    ]
    tolerance = summary["near_tie_tolerance"]
    for r in summary["per_prompt"]:
        same = ""
        if not r["lossless"]:
            same = f"  differs from greedy at token {r['first_mismatch']}"
            same += f" ({_gap_words(r['gap'], tolerance)})"
        lines.append(
            f"{r['index']:>6} {r['prompt_tokens']:>5} {r['new_tokens']:>5} {r['steps']:>5} "
            f"{r['tau']:>6.2f} {r['tokens_per_s']:>9.1f} {r['baseline_tokens_per_s']:>9.1f}{same}"
        )
    lines.append(
        f"tau {summary['tau']:.3f} {se_words(summary.get('tau_se', math.nan))} over "
        f"{summary['steps']} steps "
        f"(block {summary['block_size']}), "
        f"{summary['tokens_per_s']:.1f} tok/s vs greedy {summary['baseline_tokens_per_s']:.1f} "
        f"(x{summary['speedup']:.2f}), lossless: {_lossless_words(summary)}"
    )
    return "\n".join(lines)


def _gap_words(gap: float | None, tolerance: float) -> str:
    if gap is None:
        return "one output ended first"
    kind = "a near-tie" if gap <= tolerance else "NOT a near-tie"
    return f"{kind}: the two tokens' logits {100 * gap:.2g}% apart"


def _lossless_words(summary: dict[str, Any]) -> str:
    if summary["lossless"]:
        return "yes"
    if summary["lossless_up_to_near_ties"]:
        return (
            f"up to near-ties ({summary['near_ties']} of {summary['prompts']} prompts differ, "
            f"each where the target's logits of the two tokens are within "
            f"{100 * summary['near_tie_tolerance']:.2g}% in {summary['dtype']}; --dtype float32 "
            "checks exactly)"
        )
    return "NO"
