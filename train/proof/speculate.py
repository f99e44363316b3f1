"""`python -m train.proof.speculate --target PATH --drafter runs/NAME/export --prompts prompts.json`

Runs speculative decoding (`train.proof.decode`, DSpark's `train.proof.dspark_decode`) and plain
greedy decoding of the target over the prompts, checks that both give the same tokens, and reports
tau (accepted drafts + 1 per verify step, as `dflash.model.dflash_generate` reports it), per-prompt
figures and tokens/s. `--drafter` repeated compares drafters of one target on the same prompts,
the target and its greedy decoding run once for all. DSpark also decodes sampled (`--temperature`:
tau alone) and with a confidence cut (`--confidence-threshold`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from shared.cli import build, click_options, option
from shared.logs import setup_logging
from shared.models import resolve_target_name
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.export import CONFIG_FILE, config_from_hf, load_export
from train.proof.decode import Result, greedy, pooled_tau_se
from train.proof.dspark_decode import decode, format_sampled, sampled_summary

log = logging.getLogger(__name__)


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SpeculateError(ValueError):
    """The inputs cannot be used as given (files, prompts, drafter vs target); says why."""


@dataclass(frozen=True, kw_only=True)
class SpeculateConfig:
    target: str = option(
        help="target model folder (Hugging Face format, with its tokenizer), or a named real "
        "target materialized by `python -m extract.models NAME`"
    )
    drafter: tuple[Path, ...] = option(
        help="exported drafter folder, e.g. runs/NAME/export; repeat it for several drafters of "
        "the same target (one greedy decoding serves them all)"
    )
    prompts: Path = option(
        help="JSON list of prompts: strings (a user message through the chat template), chat "
        "`messages` lists, or lists of token ids"
    )
    max_new_tokens: int = option(128, help="tokens to generate per prompt (fewer at eos)")
    device: str | None = option(None, help="torch device; default cuda if available, else cpu")
    dtype: str = option("auto", choices=("auto", *DTYPES), help="auto: bf16 on CUDA, else fp32")
    warmup: int = option(1, help="untimed runs of both decoders on the first prompt")
    as_json: bool = option(
        False, flag="--json", help="print a one-line JSON summary last (one per drafter)"
    )
    temperature: float = option(
        0.0, help="dspark: sample at this temperature (0: greedy, checked against greedy)"
    )
    confidence_threshold: float | None = option(
        None, help="dspark: cut each block before the first draft whose confidence is below this"
    )
    seed: int = option(0, help="seed of the sampling (--temperature above 0)")

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("warmup", 0), ("temperature", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise ValueError("confidence_threshold must be in [0, 1]")


def load_prompts(path: Path, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt in the JSON file; SpeculateError names a bad entry's index."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpeculateError(f"--prompts {path}: not a readable JSON file ({e})") from None
    if not isinstance(entries, list) or not entries:
        raise SpeculateError(f"--prompts {path}: expected a non-empty JSON list of prompts")
    return [_prompt_ids(entry, n, tokenizer, vocab_size) for n, entry in enumerate(entries)]


def _prompt_ids(entry: Any, n: int, tokenizer: Any, vocab_size: int) -> list[int]:
    entry = entry["messages"] if isinstance(entry, dict) and "messages" in entry else entry
    if isinstance(entry, list) and entry and all(type(t) is int for t in entry):
        bad = [t for t in entry if not 0 <= t < vocab_size]
        if bad:
            raise SpeculateError(f"prompt {n}: token ids {bad[:5]} outside [0, {vocab_size})")
        return entry
    messages = [{"role": "user", "content": entry}] if isinstance(entry, str) else entry
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages)
    ):
        raise SpeculateError(
            f"prompt {n}: expected a string, a list of {{role, content}} messages or a "
            f"non-empty list of token ids, got {json.dumps(entry)[:80]}"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise SpeculateError(f"prompt {n}: the target's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises its own error types for a template's complaints
        raise SpeculateError(f"prompt {n}: the chat template failed ({e})") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fit_problems(cfg: DrafterConfig, target_config: Any) -> list[str]:
    """Why a drafter cannot run on a target (hidden size, layers, vocabulary); empty if it can."""
    text = target_config.get_text_config()
    layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
    checks = [
        (cfg.hidden_size == hidden, f"drafter hidden size {cfg.hidden_size}, target {hidden}"),
        (
            all(0 <= i < layers for i in cfg.target_layer_ids),
            f"drafter target layers {list(cfg.target_layer_ids)} not in a {layers}-layer target",
        ),
        (
            cfg.num_target_layers == layers,
            f"drafter made for a {cfg.num_target_layers}-layer target, this one has {layers}",
        ),
        (cfg.vocab_size == vocab, f"drafter vocabulary {cfg.vocab_size} rows, target {vocab}"),
    ]
    return [problem for ok, problem in checks if not ok]


def load(
    cfg: SpeculateConfig,
) -> tuple[nn.Module, list[DFlashDrafter], list[list[int]], list[int]]:
    """(target, drafters in --drafter's order, prompt ids, eos ids) on the configured device;
    SpeculateError on misfit, naming the drafter when there are several. Every drafter is
    checked before the target loads.

    Stops at the tokenizer's eos and at the target's generation_config eos ids.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        cfg = dataclasses.replace(cfg, target=resolve_target_name(cfg.target))
    except ValueError as e:
        raise SpeculateError(str(e)) from None
    files = [(cfg.prompts, "--prompts")] + [(d / CONFIG_FILE, "--drafter") for d in cfg.drafter]
    for path, what in files:
        if not Path(path).is_file():
            raise SpeculateError(f"{what}: {path} does not exist")
    try:
        target_config = AutoConfig.from_pretrained(cfg.target)
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
        drafter_cfgs = [
            config_from_hf(json.loads((d / CONFIG_FILE).read_text())) for d in cfg.drafter
        ]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpeculateError(f"cannot read the target or the drafter config: {e}") from None
    for path, drafter_cfg in zip(cfg.drafter, drafter_cfgs, strict=True):
        problems = fit_problems(drafter_cfg, target_config)
        which = f" ({path})" if len(cfg.drafter) > 1 else ""
        if problems:
            raise SpeculateError(
                f"the drafter{which} does not fit the target:\n  - " + "\n  - ".join(problems)
            )
        dspark = cfg.temperature > 0 or cfg.confidence_threshold is not None
        if dspark and drafter_cfg.drafter_type != "dspark":
            raise SpeculateError(
                f"--temperature and --confidence-threshold decode DSpark drafters only; the "
                f"drafter{which} is {drafter_cfg.drafter_type}"
            )
        if target_config.get_text_config().num_hidden_layers - 1 in drafter_cfg.target_layer_ids:
            log.warning(
                "the drafter%s reads the last target layer: SGLang and vLLM cannot serve it "
                "(they capture the input of layer i + 1, which does not exist for it)",
                which,
            )
    prompts = load_prompts(cfg.prompts, tokenizer, target_config.get_text_config().vocab_size)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES.get(cfg.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(device).eval()
    drafters = [load_export(d)[0].to(device, dtype).eval() for d in cfg.drafter]
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = {tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos])} - {None}
    return target, drafters, prompts, sorted(eos)


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
    return [greedy(target, ids, **kwargs) for ids in prompts]


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
) -> dict[str, Any]:
    """Speculative vs plain greedy decoding of every prompt: tau, losslessness, tokens/s.
    `baselines`: the prompts' greedy decodings already made (`greedy_baselines`, same prompts
    and limits), else they are made here. `options`: a DSpark drafter's (a confidence cut)."""
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
    for n, (ids, base) in enumerate(zip(prompts, baselines, strict=True)):
        spec = decode(target, drafter, ids, **kwargs_spec)
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
            )
        )
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
        f"tau {summary['tau']:.3f} +- {summary.get('tau_se', math.nan):.3f} over "
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


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click_options(SpeculateConfig)
def main(**kwargs: Any) -> None:
    """Speculative decoding with a target and an exported drafter, checked against greedy."""
    cfg = build(SpeculateConfig, kwargs)
    setup_logging(0)
    try:
        target, drafters, prompts, eos = load(cfg)
    except SpeculateError as e:
        raise click.ClickException(str(e)) from None
    limits = dict(max_new_tokens=cfg.max_new_tokens, eos_ids=eos)
    sampled = cfg.temperature > 0  # no single right output: tau alone, no greedy comparison
    baselines = None if sampled else greedy_baselines(target, prompts, **limits, warmup=cfg.warmup)
    options = dict(temperature=cfg.temperature, confidence_threshold=cfg.confidence_threshold)
    summaries = []
    for path, drafter in zip(cfg.drafter, drafters, strict=True):
        if sampled:
            summary = sampled_summary(target, drafter, prompts, **limits, **options, seed=cfg.seed)
        else:
            summary = compare_with_greedy(
                target, drafter, prompts, **limits, warmup=cfg.warmup, baselines=baselines,
                options=options,
            )  # fmt: skip
        summaries.append({"drafter": str(path), **summary})
        if len(drafters) > 1:
            click.echo(f"drafter {path}:")
        click.echo(format_sampled(summary) if sampled else format_report(summary))
    if cfg.as_json:  # one line per drafter, in --drafter's order
        for summary in summaries:
            click.echo(json.dumps(summary))


if __name__ == "__main__":
    main()
