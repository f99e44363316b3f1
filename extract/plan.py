"""What an extract request would write, checked before anything is: `plan_manifest(cfg)`.

Resolves the target and the data, the layer ids and the output folder, loads the tokenizer and
indexes the data's rows; every problem is an `ExtractError` whose message says what to do.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from extract.config import ExtractConfig
from extract.data import RowIndex, index_rows, source_fingerprint, template_fingerprint
from extract.estimate import CacheEstimate, estimate_cache
from extract.outdir import entries
from extract.rejects import all_rejected, nothing_kept
from extract.sources import check_table, source_kind, streams
from extract.target import (
    build_target_layer_ids,
    check_layer_weights,
    check_model_type,
    read_config,
    target_info,
    text_config,
)
from shared.cli import to_json
from shared.codec import codec_description, payload_width
from shared.fsio import unwritable_reason
from shared.manifest import FORMAT_VERSION, LAST_LAYER_NOTE, Manifest, SourceFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class ExtractError(ValueError):
    """A problem with the request, found before any work; the message says what to do."""


def default_data() -> tuple[Path, ...]:
    from extract.data import demo_dataset

    return (demo_dataset(),)


def resolve_target(cfg: ExtractConfig) -> str:
    if cfg.target is not None:
        from extract.models import resolve_target as resolve_name

        return resolve_name(cfg.target)
    from extract.tiny import tiny_target

    return str(tiny_target())


def _rule_fits(num_target_layers: int, n: int) -> bool:
    """Whether the DFlash rule gives `n` distinct ids of the target's layers.

    >>> _rule_fits(36, 5), _rule_fits(4, 2), _rule_fits(2, 2), _rule_fits(2, 1)
    (True, False, False, True)
    """
    ids = build_target_layer_ids(num_target_layers, n)
    return len(set(ids)) == n and all(0 <= i < num_target_layers for i in ids)


def _layer_ids(cfg: ExtractConfig, num_target_layers: int) -> tuple[int, ...]:
    """The ids to capture, ascending: SGLang and vLLM collect a drafter's target states in layer
    order whatever its `target_layer_ids` say, so the cache (and every drafter trained on it)
    keeps that order too."""
    ids = cfg.layer_ids or tuple(build_target_layer_ids(num_target_layers, cfg.num_layers))
    if cfg.layer_ids is None and not _rule_fits(num_target_layers, cfg.num_layers):
        fits = max(n for n in range(1, num_target_layers + 1) if _rule_fits(num_target_layers, n))
        raise ExtractError(
            f"--num-layers {cfg.num_layers}: the target has {num_target_layers} decoder layers, "
            f"and the DFlash rule gives ids {list(ids)}, repeated or out of range (ids "
            f"0..{num_target_layers - 1}); use --num-layers {fits}{' or less' * (fits > 1)}, or "
            "name the ids with --layers"
        )
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ExtractError(
            f"--layers {cfg.layers!r}: ids {bad} out of range: the target has "
            f"{num_target_layers} decoder layers (ids 0..{num_target_layers - 1})"
        )
    if list(ids) != sorted(ids):
        log.info(
            "--layers %s: stored in ascending order %s (the order serving engines use)",
            ",".join(map(str, ids)),
            ",".join(map(str, sorted(ids))),
        )
    if num_target_layers - 1 in ids:
        log.info(LAST_LAYER_NOTE, num_target_layers - 1)
    return tuple(sorted(ids))


def _check_data(files: tuple[Path, ...]) -> None:
    """Every --data path is a JSONL file or a table that has a column to read."""
    missing = [str(f) for f in files if not Path(f).exists()]
    if missing:
        raise ExtractError(f"--data: no such file: {', '.join(missing)}")
    if problem := streams(files):
        raise ExtractError(problem)
    seen = [Path(f).resolve() for f in files]
    twice = sorted({str(f) for f, r in zip(files, seen, strict=True) if seen.count(r) > 1})
    if twice:
        raise ExtractError(f"--data {', '.join(twice)}: given twice, its rows would be read twice")
    for path in files:
        if source_kind(path) != "jsonl":
            check_table(path)


def plan_manifest(cfg: ExtractConfig) -> tuple[Manifest, RowIndex, CacheEstimate]:
    """The manifest this request would write (no parts yet), the row index of its data and the
    cache's expected size. Validates everything; writes nothing."""
    target = resolve_target(cfg)
    config = read_config(target)
    check_model_type(target, config)
    files = cfg.data or default_data()
    _check_data(files)
    # Recorded absolute: the manifest's commands (resume, repair) and verify's re-run of the
    # target work from any folder
    files = tuple(Path(f).absolute() for f in files)
    target = str(Path(target).absolute())
    layer_ids = _layer_ids(cfg, int(text_config(config)["num_hidden_layers"]))
    check_layer_weights(Path(target), max(layer_ids))
    context = text_config(config).get("max_position_embeddings")
    if isinstance(context, int) and cfg.max_length > context:
        log.warning(
            "--max-length %d is over the target's context (max_position_embeddings %d): rows "
            "longer than %d would be stored with states from positions it was never trained on; "
            "give --max-length %d or less",
            cfg.max_length,
            context,
            context,
            context,
        )
    try:  # the int4 code's groups must tile the hidden size
        payload_width(cfg.store, int(text_config(config)["hidden_size"]))
    except ValueError as e:
        raise ExtractError(str(e)) from None
    problem = unwritable_reason(cfg.out)
    if problem:
        raise ExtractError(f"--out {cfg.out}: {problem}")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as e:
        raise ExtractError(f"--target {target}: cannot load its tokenizer ({e})") from None
    if len(tokenizer) < 2:  # no tokenizer file there: transformers makes an empty one
        raise ExtractError(
            f"--target {target}: its tokenizer is empty ({len(tokenizer)} token): the folder "
            "holds no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); copy "
            "the model's tokenizer files beside its config.json"
        )
    index = index_rows(list(files))
    rows = index.counts
    sources = tuple(
        SourceFile(path=str(f), sha256=source_fingerprint(f), rows=n)
        for f, n in zip(files, rows, strict=True)
    )
    total = sum(rows) if cfg.max_rows is None else min(sum(rows), cfg.max_rows)
    if total == 0:
        raise ExtractError(f"--data: {', '.join(map(str, files))} holds no rows")
    estimate = estimate_cache(
        list(files),
        index,
        tokenizer,
        total=total,
        max_length=cfg.max_length,
        layers=len(layer_ids),
        hidden=int(text_config(config)["hidden_size"]),
        store=cfg.store,
        fmt=cfg.format,
    )
    if estimate.tokens_per_row == 0:  # every row sampled was rejected
        _refuse_all_rejected(cfg, files, index, tokenizer, total=total, sampled=estimate.sampled)
    prints = template_fingerprint(tokenizer)
    resolved = dataclasses.replace(
        cfg,
        target=target,
        data=tuple(Path(f) for f in files),
        layers=None if cfg.layers is None else ",".join(map(str, layer_ids)),
    )
    return (
        Manifest(
            format=cfg.format,
            store=cfg.store,
            codec=codec_description(cfg.store),
            target=target_info(target, config, len(tokenizer)),
            tokenizer_sha256=prints["tokenizer"],
            chat_template_sha256=prints["chat_template"] or "",
            layer_ids=layer_ids,
            max_length=cfg.max_length,
            rows_per_part=cfg.rows_per_part,
            sources=sources,
            total_rows=total,
            config={**to_json(resolved), "format_version": FORMAT_VERSION},
        ),
        index,
        estimate,
    )


def _refuse_all_rejected(
    cfg: ExtractConfig,
    files: tuple[Path, ...],
    index: RowIndex,
    tokenizer: PreTrainedTokenizerBase,
    *,
    total: int,
    sampled: int,
) -> None:
    """Raise when no row of the data can be kept: before the target loads, and before anything
    in --out is replaced (an --overwrite of a good cache included). Past a sample, the rows are
    read until one is kept, which extraction would read anyway."""
    if total > sampled:
        log.info(
            "the %d rows sampled were all rejected: reading the other rows of --data for one "
            "that is kept",
            sampled,
        )
    found = all_rejected(files, tokenizer, index=index, total=total, max_length=cfg.max_length)
    if found is not None:
        kept = ", and what it holds is left as it was" if entries(cfg.out) else ""
        raise ExtractError(nothing_kept(found.read, found.reasons, found.first, cfg.out, then=kept))
