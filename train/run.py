"""Stage two's entry point: check the cache and the run folder, resolve defaults, launch ranks.

Everything that can refuse the run does so here, before any process starts or any file is
written: a cache that cannot serve the requested drafter (every problem listed in one
`CacheMismatch`), an invalid device list, or an existing run folder holding a different run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from safetensors import safe_open

from shared.dist import (
    DeviceSpec,
    launch,
    parse_gpus,
    takes_output_lock,
    torchrun_world_size,
    under_torchrun,
)
from shared.fsio import unwritable_reason, within
from shared.lock import LockHeld, output_lock
from shared.manifest import (
    LAST_LAYER_WARNING,
    CacheMismatch,
    Manifest,
    check_compatible,
    repair_commands,
)
from shared.target_files import (
    EMBED_FILE,
    EMBED_KEY,
    read_target_config,
    target_dir,
    target_problems,
    unused_special_token,
)
from train.config import TrainConfig
from train.data.follow import CacheView, changed_parts, read_view
from train.data.loader import layer_positions, load_catalog
from train.data.plan import PlanSpec, holdout_lengths, plan_rows
from train.drafters.anchors import default_gamma
from train.drafters.config import DFLASH2_FIELDS, LOGIT_FIELDS, DrafterConfig
from train.drafters.objective import TARGET_LOSSES
from train.follow_start import await_first_step, await_manifest, holdout, start_following
from train.loop import EXPORT_DIR, train_rank
from train.prepared import FollowPlan, Prepared
from train.run_dir import RunError, prepare_run_dir, resumed_plan
from train.warm_start import init_from_problems

log = logging.getLogger(__name__)


def ascending_layers(ids: tuple[int, ...]) -> tuple[int, ...]:
    """`ids` sorted: SGLang and vLLM feed a drafter its target states in layer order whatever
    `target_layer_ids` says, so a drafter trained on another order would get permuted features
    there. The cache's order does not matter (`layer_positions` picks the stored layers)."""
    if list(ids) != sorted(ids):
        log.info(
            "--target-layers %s: trained in ascending order %s (the order serving engines use)",
            ",".join(map(str, ids)),
            ",".join(map(str, sorted(ids))),
        )
    return tuple(sorted(ids))


def run(cfg: TrainConfig) -> Path:
    """Train as `cfg` says; return the export folder."""
    try:
        spec = parse_gpus(cfg.gpus)
    except ValueError as e:
        raise RunError(str(e)) from None
    problem = unwritable_reason(cfg.out)
    if problem:
        raise RunError(f"--out {cfg.out}: {problem}")
    manifest = await_manifest(cfg)
    if within(cfg.out, cfg.data):
        raise RunError(
            f"--out {cfg.out} is inside the cache --data {cfg.data}: give a run folder "
            "of its own (e.g. runs/NAME): the cache holds only what extraction wrote"
        )
    saved = resumed_plan(cfg)
    view = None
    # A run follows an extraction on a cache not yet complete, and keeps following (the plan is
    # its checkpoint's) once it is; --no-follow and an unfollowed checkpoint refuse it.
    follows = saved["follow"] if saved is not None else not manifest.complete
    if follows and (cfg.follow or manifest.complete):
        changed = changed_parts(saved.get("parts", []) if saved else [], manifest)
        if changed:
            raise RunError("\n".join([f"{cfg.data} changed under the run {cfg.out}:", *changed]))
        view = read_view(cfg.data, manifest)
    cfg, prep = prepare(cfg, manifest, device_kind=spec.kind, view=view)
    if cfg.init_from is not None:  # before the run folder is written: its fix is the command's
        problems = init_from_problems(cfg.init_from, prep.drafter)
        if problems:
            raise RunError("--init-from does not fit the drafter:\n  - " + "\n  - ".join(problems))
    try:
        with output_lock(cfg.out, "python -m train", enabled=takes_output_lock()):
            estimate = saved.get("rows_estimate") if saved else None
            return _run_locked(cfg, prep, manifest, spec, estimate)
    except LockHeld as e:
        raise RunError(str(e)) from None
    except OSError as e:  # creating --out or a file in it (e.g. --out /proc/x, a full disk)
        where = e.filename or cfg.out
        raise RunError(f"--out {cfg.out}: cannot write {where} ({e.strerror or e})") from None


def _run_locked(
    cfg: TrainConfig, prep: Prepared, manifest: Manifest, spec: DeviceSpec, estimate: int | None
) -> Path:
    world_size = None if under_torchrun() else spec.nprocs
    world = world_size or torchrun_world_size()
    if prep.follow is None:
        check_size(cfg, prep, world)
    prepare_run_dir(cfg, prep, manifest, world_size=world_size)
    if prep.follow is not None:
        view = await_first_step(cfg, prep.follow.view, manifest, world_size=world)
        train, evals = holdout(cfg, view)
        plan = start_following(cfg, view, manifest, world_size=world, estimate=estimate)
        prep = dataclasses.replace(
            prep, parts=view.parts, train_lengths=train, eval_lengths=evals, follow=plan
        )
    log.info(
        "training a %d-layer drafter on %d parts (%d samples held out) with %s, target layers %s",
        prep.drafter.num_layers,
        len(prep.parts),
        prep.num_eval,
        spec.label,
        list(prep.drafter.target_layer_ids),
    )
    launch(train_rank, (cfg, prep), spec)
    return cfg.out / EXPORT_DIR


def resolve_devices(cfg: TrainConfig, device_kind: str) -> TrainConfig:
    """Attention, compile and loader defaults for the device kind; flex cannot train on CPU.
    Eight loader workers keep an H200 fed from a cold cache: with the 155 ms step of the
    Qwen3-8B shape, four left it waiting 13% of the time, eight 0.1% (bench/datapath_bench.py
    --workers). CPU ranks compute on the same few cores, so two."""
    cuda = device_kind == "cuda"
    attention = cfg.attention or ("flex" if cuda else "sdpa")
    if attention == "flex" and not cuda:
        raise RunError(
            "attention: flex_attention has no backward on CPU (torch 2.11-2.13); "
            "use --attention sdpa"
        )
    return cfg.replace(
        attention=attention,
        compile=cfg.compile or ("model" if cuda else "none"),
        workers=cfg.workers if cfg.workers is not None else (8 if cuda else 2),
    )


def prepare(
    cfg: TrainConfig, manifest: Manifest, *, device_kind: str, view: CacheView | None = None
) -> tuple[TrainConfig, Prepared]:
    """The resolved config and what every rank needs; CacheMismatch lists every problem.
    `view`: the committed parts of a cache the run follows while it is being written."""
    cfg = resolve_devices(cfg, device_kind)
    repair = repair_commands(cfg.data, manifest)
    wanted, read, drafter, problems = fit_cache(cfg, manifest, complete=view is None)
    if view is None:
        parts, part_problems = load_catalog(cfg.data, manifest)
        problems += [f"{p}: {repair}" for p in part_problems]
    else:
        parts = list(view.parts)
    lengths = [p.lengths for p in parts]
    num_samples = sum(map(len, lengths))
    held_parts = cfg.eval_parts or 0
    held = eval_sample_count(cfg.eval_fraction, num_samples) if cfg.eval_parts is None else 0
    units = len(parts) if view is None else view.num_units
    if units and held_parts >= units:
        problems.append(f"cannot hold out {held_parts} of {units} parts for evaluation")
    if not manifest.parts and view is None:
        problems.append("the cache holds no parts")
    if problems or drafter is None:
        raise CacheMismatch(cfg.data, problems)
    if view is None:
        train_lengths, eval_lengths = holdout_lengths(
            lengths, num_samples=held, num_parts=held_parts
        )
    else:
        train_lengths, eval_lengths = holdout(cfg, view)
    gamma = None  # unused by --slot-weights uniform and dpace
    if cfg.slot_weights == "exp":
        gamma = cfg.gamma or default_gamma(cfg.block_size, anchor_predicts=drafter.anchor_predicts)
    cfg = cfg.replace(
        target_layers=",".join(map(str, wanted)),
        layer_types=",".join(drafter.layer_types),
        sliding_window=drafter.sliding_window,
        is_causal=None if drafter.is_causal is None else str(drafter.is_causal).lower(),
        mask_token_id=drafter.mask_token_id,
        gamma=gamma,
        max_length=cfg.max_length or manifest.max_length,
        num_anchors=cfg.anchors_per_row,
    )
    prep = Prepared(
        drafter=drafter,
        parts=tuple(parts),
        train_lengths=train_lengths,
        eval_lengths=eval_lengths,
        layers=layer_positions(manifest.layer_ids, read),
        gamma=gamma,
        follow=None if view is None else FollowPlan(view, 0, manifest.identity()),
    )
    return cfg, prep


def fit_cache(
    cfg: TrainConfig, manifest: Manifest, *, complete: bool = True, target_files: bool = True
) -> tuple[tuple[int, ...], tuple[int, ...], DrafterConfig | None, list[str]]:
    """What `cfg` reads of the cache and its drafter: (taps, layers read, drafter config or
    None, problems: every way the cache cannot serve it, with the repair where one helps).
    `target_files`: also checksum the cache's target/ files (the embedding: GBs at 8B)."""
    repair = repair_commands(cfg.data, manifest)
    damaged = target_problems(cfg.data, manifest.target_files) if target_files else []
    problems = [f"{p}: {repair}" for p in damaged]
    wanted = ascending_layers(cfg.target_layer_ids or default_taps(cfg, manifest))
    if manifest.target.num_layers - 1 in wanted:
        log.warning(LAST_LAYER_WARNING, manifest.target.num_layers - 1)
    read = wanted + last_layer(cfg, manifest, problems)
    drafter, hidden = _drafter_config(cfg, manifest, wanted, problems)
    embed_rows = _embedding_rows(cfg.data, manifest, problems)
    try:
        check_compatible(
            manifest,
            cache=cfg.data,
            layer_ids=wanted,
            hidden_size=hidden,
            vocab_size=embed_rows,
            require_complete=complete,
        )
    except CacheMismatch as e:
        problems = e.problems + problems
    return wanted, read, drafter, problems


def default_taps(cfg: TrainConfig, manifest: Manifest) -> tuple[int, ...]:
    """Without --target-layers: every cached layer; for DSpark every one but the target's last,
    which it reads as the target's own distribution (and engines cannot feed as a tap)."""
    cached, last = tuple(manifest.layer_ids), manifest.target.num_layers - 1
    taps = tuple(i for i in cached if i != last)
    if cfg.drafter_type != "dspark" or not taps or taps == cached:
        return cached
    log.info("dspark: taps %s (the cached layers but the last, %d)", list(taps), last)
    return taps


def last_layer(cfg: TrainConfig, manifest: Manifest, problems: list[str]) -> tuple[int, ...]:
    """(the target's last layer,) when the run reads the target's distribution (DSpark's
    `--dspark-loss full`, a DFlash `--loss` in TARGET_LOSSES), else (); a cache without it is a
    problem naming the extract option that adds it."""
    if cfg.drafter_type == "dspark" and cfg.dspark_loss == "full":
        needs = "--drafter-type dspark trains its L1 and confidence terms on"
        instead = "`--dspark-loss ce` (CE alone, no confidence head)"
    elif cfg.loss in TARGET_LOSSES:
        needs = f"--loss {cfg.loss} compares the drafter's distribution with the one of"
        instead = "`--loss ce` (CE on the data tokens)"
    else:
        return ()
    last, cached = manifest.target.num_layers - 1, list(manifest.layer_ids)
    if last in cached:
        return (last,)
    problems.append(
        f"{needs} the target's last hidden state (layer {last}, after the final norm), which "
        f"this cache lacks (cached layers {cached}): extract it again adding layer {last}, "
        f"`python -m extract --layers {','.join(map(str, sorted({*cached, last})))} ...`, or "
        f"train with {instead}"
    )
    return ()


def eval_sample_count(fraction: float, num_samples: int) -> int:
    """Samples held out for evaluation: the fraction rounded down, but at least one when the
    fraction is positive and the cache has two or more samples (a small cache still gets an
    honest held-out figure).

    >>> eval_sample_count(0.01, 480), eval_sample_count(0.01, 50), eval_sample_count(0.0, 50)
    (4, 1, 0)
    """
    if fraction <= 0 or num_samples < 2:
        return 0
    return min(num_samples - 1, max(1, int(fraction * num_samples)))


def check_size(cfg: TrainConfig, prep: Prepared, world_size: int) -> None:
    """Refuse, before any work, a cache too small for one optimizer step on `world_size` ranks;
    log how many samples are truncated to a row."""
    spec = PlanSpec(
        lengths=prep.train_lengths,
        seed=cfg.seed,
        row_tokens=cfg.batch_tokens,
        shuffle_buffer=cfg.shuffle_buffer,
        max_length=cfg.max_length,
    )
    rows = len(plan_rows(spec, epoch=0))
    need = world_size * cfg.grad_accum
    tokens = sum(min(n, spec.clip) for ls in prep.train_lengths for n in ls)
    if rows < need:
        raise RunError(
            f"{cfg.data}: too small for one optimizer step: its {tokens:,} training tokens pack "
            f"into {rows} rows of --batch-tokens {cfg.batch_tokens}, and one step on {world_size} "
            f"rank(s) with --grad-accum {cfg.grad_accum} needs {need} rows (about "
            f"{need * cfg.batch_tokens:,} tokens). Extract more data, or lower --batch-tokens, "
            "--grad-accum or the number of devices"
        )
    longer = sum(1 for ls in prep.train_lengths for n in ls if n > spec.clip)
    if longer:
        log.warning(
            "%d training samples are longer than a row (%d tokens): truncated to it",
            longer,
            spec.clip,
        )
    log.info(
        "epoch 0: %d samples, %s tokens in %d rows of %d (%.1f%% padding)",
        sum(1 for ls in prep.train_lengths for n in ls if n > 0),
        f"{tokens:,}",
        rows,
        cfg.batch_tokens,
        100 * (1 - tokens / max(rows * cfg.batch_tokens, 1)),
    )


def _drafter_config(
    cfg: TrainConfig, manifest: Manifest, wanted: tuple[int, ...], problems: list[str]
) -> tuple[DrafterConfig | None, int | None]:
    """(the drafter's config, the hidden size it needs), None where the target config fails."""
    try:
        target_cfg = read_target_config(cfg.data)
        text = target_cfg.get("text_config") or target_cfg
        hidden = int(text["hidden_size"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        problems.append(f"target config unreadable: {e}")
        return None, None
    try:
        drafter = DrafterConfig.from_target_config(
            target_cfg,
            num_layers=cfg.drafter_layers,
            target_layer_ids=wanted,
            block_size=cfg.block_size,
            mask_token_id=cfg.mask_token_id,
            # None: the published drafters' layer types for this target (all full for most;
            # DFlash2: all sliding)
            layer_types=None if cfg.layer_types is None else cfg.layer_type_names,
            sliding_window=cfg.sliding_window,
            tokenizer_vocab_size=manifest.target.tokenizer_vocab_size,
            num_attention_heads=cfg.drafter_heads,
            num_key_value_heads=cfg.drafter_kv_heads,
            head_dim=cfg.drafter_head_dim,
            intermediate_size=cfg.drafter_intermediate,
            unused_token=unused_special_token(cfg.data),
            drafter_type=cfg.drafter_type,
            is_causal=cfg.causal,
            **family_fields(cfg),
        )
    except (ValueError, KeyError) as e:
        problems.append(f"drafter config: {e}")
        return None, hidden
    return drafter, hidden


def family_fields(cfg: TrainConfig) -> dict[str, int | float | bool]:
    """The drafter config's fields of `cfg`'s family (none for a DFlash drafter). DFlash2: its
    sizes and the logit transform only where given (else the target's, see
    `target_logit_transform`). DSpark: its heads (a confidence head only with the full loss)
    and the anchors per row, which its export records."""
    if cfg.drafter_type == "dspark":
        return {
            "markov_rank": cfg.markov_rank,
            "enable_confidence_head": cfg.with_confidence_head,
            "confidence_head_with_markov": cfg.confidence_head_with_markov,
            "num_anchors": cfg.anchors_per_row,
        }
    if cfg.drafter_type != "dflash2":
        return {}
    fields: dict[str, int | float | bool] = {name: getattr(cfg, name) for name in DFLASH2_FIELDS}
    for name in LOGIT_FIELDS:
        if getattr(cfg, name) is not None:
            fields[name] = getattr(cfg, name)
    return fields


def _embedding_rows(cache: Path, manifest: Manifest, problems: list[str]) -> int | None:
    """Rows of the cached embedding; a hidden size other than the manifest's is a problem."""
    path = target_dir(cache) / EMBED_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            rows, hidden = f.get_slice(EMBED_KEY).get_shape()
    except (OSError, KeyError, ValueError) as e:
        problems.append(f"target embedding {path} unreadable ({e})")
        return None
    if hidden != manifest.target.hidden_size:
        problems.append(
            f"target embedding has hidden size {hidden}, the manifest says "
            f"{manifest.target.hidden_size}"
        )
    return int(rows)
