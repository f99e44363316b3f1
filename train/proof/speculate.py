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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch
from huggingface_hub.errors import StrictDataclassError  # transformers' config validation
from safetensors import SafetensorError
from torch import nn

from shared.cli import build, click_options, option
from shared.dist import parse_device
from shared.logs import setup_logging
from shared.manifest import MANIFEST, CacheMismatch, read_manifest
from shared.models import resolve_target_name
from shared.target_files import TARGET_DIR
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter
from train.export import CONFIG_FILE
from train.export_load import export_config, load_export, weights_problem
from train.metrics import json_line
from train.proof.dspark_decode import format_sampled, sampled_summary
from train.proof.lossless import compare_with_greedy, format_report, greedy_baselines
from train.proof.target_check import other_target_warning

log = logging.getLogger(__spec__.name if __spec__ else __name__)  # not "__main__" under -m


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
    max_new_tokens: int = option(
        128, help="tokens to generate per prompt (fewer at eos), 2 or more"
    )
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
    full_blocks: bool = option(
        False,
        flag="--full-blocks",
        help="draft every block whole and cut the output at --max-new-tokens (vLLM's and "
        "llama.cpp's last blocks) instead of shortening the last blocks (z-lab's)",
    )
    shard: str | None = option(
        None,
        help="K/N: decode only the K-th (from 1) of N contiguous shares of the prompts, to run N "
        "processes side by side on one device; `python -m train.proof.tau` joins their --json "
        "outputs given in K's order",
    )

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError(
                f"max_new_tokens: must be >= 2 (the first new token comes from the prompt's "
                f"forward, drafting starts at the second), got {self.max_new_tokens}"
            )
        for name, low in (("warmup", 0), ("temperature", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}: must be >= {low}, got {getattr(self, name)}")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise ValueError(
                f"confidence_threshold: must be in [0, 1], got {self.confidence_threshold}"
            )
        if self.shard is not None:
            parse_shard(self.shard)  # before any work


def parse_shard(shard: str) -> tuple[int, int]:
    """(K, N) of "K/N"; ValueError unless 1 <= K <= N."""
    k, sep, n = shard.partition("/")
    if not (sep and k.isdecimal() and n.isdecimal() and 1 <= int(k) <= int(n)):
        raise ValueError(f"shard: must be K/N with 1 <= K <= N (e.g. 2/8), got {shard!r}")
    return int(k), int(n)


def shard_range(shard: str, count: int) -> range:
    """The prompt indices of share K of N ("K/N", K from 1) of `count` prompts: contiguous,
    the first count % N shares one longer, so the shares in K's order are the prompts in order.

    >>> [list(shard_range(f"{k}/3", 7)) for k in (1, 2, 3)]
    [[0, 1, 2], [3, 4], [5, 6]]
    """
    k, n = parse_shard(shard)
    k -= 1
    base, extra = divmod(count, n)
    start = k * base + min(k, extra)
    return range(start, start + base + (k < extra))


def load_prompts(path: Path, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt in the JSON file; SpeculateError names a bad entry's index."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpeculateError(f"--prompts {path}: not a readable JSON file ({e})") from None
    if not isinstance(entries, list) or not entries:
        raise SpeculateError(f"--prompts {path}: expected a non-empty JSON list of prompts")
    try:
        return [_prompt_ids(entry, n, tokenizer, vocab_size) for n, entry in enumerate(entries)]
    except SpeculateError as e:
        raise SpeculateError(f"--prompts {path}: {e}") from None


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
    for d in cfg.drafter:
        if (d / "export").is_dir() or (d / "checkpoints").is_dir():
            raise SpeculateError(f"--drafter {d} is a run folder: give its export, {d / 'export'}")
        if (d / "meta.json").is_file() and (d / "state.pt").is_file():
            raise SpeculateError(
                f"--drafter {d} is a checkpoint: export it first (python -m train.export {d} "
                "OUT_DIR) and give OUT_DIR"
            )
    refuse_cache_as_target(Path(cfg.target))
    if not Path(cfg.target).is_dir():  # a hub id is taken from the local cache only
        try:
            AutoConfig.from_pretrained(cfg.target, local_files_only=True)
        except (OSError, ValueError):
            raise SpeculateError(
                f"--target {cfg.target}: no such folder, nor a model of that name in the local "
                "Hugging Face cache"
            ) from None
    device = pick_device(cfg.device)
    files = [(cfg.prompts, "--prompts")] + [(d / CONFIG_FILE, "--drafter") for d in cfg.drafter]
    for path, what in files:
        if Path(path).is_dir():
            raise SpeculateError(f"{what}: {path} is a folder, not a file")
        if not Path(path).is_file():
            raise SpeculateError(f"{what}: {path} does not exist")
    try:
        drafter_cfgs = [export_config(d) for d in cfg.drafter]
    except ValueError as e:
        raise SpeculateError(f"--drafter {e}") from None
    try:
        target_config = AutoConfig.from_pretrained(cfg.target)
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as e:
        raise SpeculateError(
            f"--target {cfg.target}: cannot read its config or tokenizer ({e})"
        ) from None
    for path, drafter_cfg in zip(cfg.drafter, drafter_cfgs, strict=True):
        if problem := weights_problem(path, drafter_cfg):
            raise SpeculateError(f"--drafter {problem}")
        problems = fit_problems(drafter_cfg, target_config)
        which = f" ({path})" if len(cfg.drafter) > 1 else ""
        if problems:
            raise SpeculateError(
                f"the drafter ({path}) does not fit the target {cfg.target}:\n  - "
                + "\n  - ".join(problems)
                + "\ngive the target its training cache was extracted from (the cache's "
                "manifest.json names it)"
            )
        if warning := other_target_warning(path, cfg.target):
            log.warning("%s", warning)
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
    dtype = DTYPES.get(cfg.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(device).eval()
    except (OSError, ValueError, SafetensorError) as e:  # a weight file cut short: the latter
        raise SpeculateError(f"--target {cfg.target}: cannot load its weights ({e})") from None
    drafters = [load_export(d)[0].to(device, dtype).eval() for d in cfg.drafter]
    eos = getattr(target.generation_config, "eos_token_id", None)
    eos = {tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos])} - {None}
    return target, drafters, prompts, sorted(eos)


def past_positions(prompts: list[list[int]], max_new_tokens: int, text_config: Any) -> str | None:
    """Why some decodings would run past the target's positions (max_position_embeddings), or
    None: their tokens there are the target's extrapolation, not what it was trained for.

    >>> from types import SimpleNamespace
    >>> print(past_positions([[1] * 10, [1] * 3], 4, SimpleNamespace(max_position_embeddings=12)))
    ... # doctest: +ELLIPSIS
    1 of 2 prompts run past the target's 12 positions ... (the longest, prompt 0, to 14): ...
    """
    limit = getattr(text_config, "max_position_embeddings", None)
    if not limit:
        return None
    ends = [len(p) + max_new_tokens for p in prompts]
    over = [i for i, n in enumerate(ends) if n > limit]
    if not over:
        return None
    worst = max(over, key=ends.__getitem__)
    return (
        f"{len(over)} of {len(prompts)} prompts run past the target's {limit} positions with "
        f"--max-new-tokens {max_new_tokens} (the longest, prompt {worst}, to {ends[worst]}): "
        "their tau measures an extrapolation; give shorter prompts or fewer new tokens"
    )


def refuse_cache_as_target(path: Path) -> None:
    """SpeculateError where `path` is a hidden-state cache or its target/ folder (a tokenizer
    and embeddings, no weights), naming the target the cache was extracted from."""
    cache = path.parent if path.name == TARGET_DIR else path
    if not (cache / MANIFEST).is_file() or not (cache / TARGET_DIR).is_dir():
        return
    what = "a hidden-state cache" if cache == path else "a cache's target/ folder (no weights)"
    try:
        extracted = f", {read_manifest(cache).target.path}"
    except CacheMismatch:
        extracted = ""
    raise SpeculateError(
        f"--target {path} is {what}: give the target model it was extracted from{extracted}"
    )


def pick_device(name: str | None) -> torch.device:
    """`shared.dist.parse_device`, its ValueError a SpeculateError."""
    try:
        return parse_device(name)
    except ValueError as e:
        raise SpeculateError(str(e)) from None


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
    share = range(len(prompts)) if cfg.shard is None else shard_range(cfg.shard, len(prompts))
    if not share:
        raise click.ClickException(
            f"--shard {cfg.shard}: no prompt falls in this share of {len(prompts)}; give N <= "
            f"{len(prompts)}"
        )
    prompts = prompts[share.start : share.stop]
    if problem := past_positions(prompts, cfg.max_new_tokens, target.config.get_text_config()):
        log.warning("%s", problem)
    limits = dict(max_new_tokens=cfg.max_new_tokens, eos_ids=eos)
    sampled = cfg.temperature > 0  # no single right output: tau alone, no greedy comparison
    baselines = None if sampled else greedy_baselines(target, prompts, **limits, warmup=cfg.warmup)
    options = dict(
        temperature=cfg.temperature,
        confidence_threshold=cfg.confidence_threshold,
        full_blocks=cfg.full_blocks,
    )
    summaries = []
    for path, drafter in zip(cfg.drafter, drafters, strict=True):
        if sampled:
            summary = sampled_summary(target, drafter, prompts, **limits, **options, seed=cfg.seed)
        else:
            summary = compare_with_greedy(
                target, drafter, prompts, **limits, warmup=cfg.warmup, baselines=baselines,
                options=options, first_index=share.start,
                desc="speculative decoding" + (f", {path}" if len(drafters) > 1 else ""),
            )  # fmt: skip
        summaries.append(
            {"drafter": str(path), **summary, "full_blocks": cfg.full_blocks, "shard": cfg.shard}
        )
        if len(drafters) > 1:
            click.echo(f"drafter {path}:")
        click.echo(format_sampled(summary) if sampled else format_report(summary))
    if cfg.as_json:  # one line per drafter, in --drafter's order
        for summary in summaries:
            click.echo(json_line(summary))  # strict JSON: a figure with nothing to measure, null


if __name__ == "__main__":
    main()
