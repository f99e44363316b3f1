"""One training forward: anchors -> block inputs -> masks -> drafter -> chunked CE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.config import TrainConfig
from train.data.batch import Batch
from train.drafters.anchors import (
    block_inputs,
    block_positions,
    block_rows,
    block_targets,
    context_starts,
    loss_weights,
    sample_anchors,
)
from train.drafters.dflash import DFlashDrafter
from train.drafters.dflash2_loss import SelectorLoss, selector_step_terms
from train.drafters.dspark_loss import DSparkLoss, dspark_loss, dspark_step_terms
from train.drafters.loss import acceptance_stats, chunked_ce, fused_chunked_ce
from train.drafters.mask import build_masks
from train.drafters.objective import Objective
from train.drafters.target_loss import chunked_target_loss
from train.drafters.target_rows import TargetRows
from train.options import CE_MODES, GRAD_CKPT_MODES
from train.prepared import Prepared


@dataclass
class StepOut:
    """weighted_sum = sum(w * CE) (differentiable), weight_total = sum(w); stats from loss.py."""

    weighted_sum: torch.Tensor
    weight_total: torch.Tensor
    stats: dict[str, torch.Tensor]


def _unwrap(model: nn.Module) -> DFlashDrafter:
    """The DFlashDrafter under DDP (`.module`) or torch.compile (`._orig_mod`) wrappers."""
    while not isinstance(model, DFlashDrafter):
        inner = getattr(model, "module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            raise TypeError(f"expected a DFlashDrafter (possibly wrapped), got {type(model)}")
        model = inner
    return model


def step_options(cfg: TrainConfig, prep: Prepared, device: torch.device) -> dict[str, Any]:
    """The keyword options of `forward_loss` for a run (`cfg` resolved, `prep` from
    `train.run.prepare`) on `device`: the same for training steps and evaluations."""
    return dict(
        num_anchors=cfg.num_anchors,
        block_size=cfg.block_size,
        gamma=prep.gamma,
        mask_token_id=prep.drafter.mask_token_id,
        attention=cfg.attention,
        ce_chunk_blocks=cfg.ce_chunk_blocks,
        compile_masks=cfg.compile == "flex" and device.type == "cuda",
        ce=cfg.ce,
        compile_ce=cfg.compile == "model",
        dspark=dspark_loss(cfg),
        objective=Objective.of(cfg),
        # Fewer blocks when a row has fewer candidates changes shapes: only uncompiled.
        trim_anchors=device.type == "cpu" and cfg.compile == "none",
    )


def forward_loss(
    drafter: nn.Module,
    embed_weight_VH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    batch: Batch,
    *,
    num_anchors: int,
    generator: torch.Generator,
    trim_anchors: bool = False,
    **options: Any,
) -> StepOut:
    """The whole training forward for one micro-batch: draw anchors, then `anchored_loss`.

    `num_anchors` blocks per row, drawn with `generator` (`train.drafters.anchors.sample_anchors`);
    `trim_anchors` drops the all-padding blocks (a shape change: only where nothing is compiled).
    `options` are `anchored_loss`'s.
    """
    anchors_BN, keep_BN = sample_anchors(
        batch.loss_mask_BS,
        batch.doc_ids_BS,
        num_anchors=num_anchors,
        generator=generator,
        trim=trim_anchors,
    )
    return anchored_loss(
        drafter, embed_weight_VH, lm_head_weight_VH, batch, anchors_BN, keep_BN, **options
    )


def anchored_loss(
    drafter: nn.Module,
    embed_weight_VH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    batch: Batch,
    anchors_BN: torch.Tensor,
    keep_BN: torch.Tensor,
    *,
    block_size: int,
    gamma: float | None,
    mask_token_id: int,
    attention: str,
    ce_chunk_blocks: int = 128,
    grad_ckpt: str = "loss",
    compile_masks: bool = False,
    ce: str = "fused",
    compile_ce: bool = False,
    selector: SelectorLoss | None = None,
    dspark: DSparkLoss | None = None,
    objective: Objective | None = None,
) -> StepOut:
    """The training forward of one micro-batch for given anchors (a pure function of them).

    `drafter` may be wrapped (DDP, torch.compile). The embedding and lm_head weights are the
    target's, frozen: plain tensors, never drafter parameters. `grad_ckpt`: "loss" checkpoints the
    chunked lm_head + CE (with `ce="autograd"`), "layers" also each drafter layer, "none" neither.
    `ce="fused"` forms each CE chunk's hidden-gradient in the forward
    (`train.drafters.loss.fused_chunked_ce`): no logits are kept or recomputed, whatever
    `grad_ckpt`; `compile_ce` runs its chunk body through torch.compile. `selector`: this step's
    selector-loss weight and stop-gradient (DFlash2 drafters only; default alpha 1). `dspark`: the
    DSpark objective's weights and mode (DSpark drafters only; in mode "full" the batch holds the
    target's last hidden state as its last layer, after the taps). `objective`: a DFlash
    drafter's loss and slot weights (train/drafters/objective.py; default the CE with exp
    weights; a loss against the target's distribution reads the last layer as DSpark's does);
    the slot weights apply to every family. `compile_masks`
    builds flex BlockMasks with the compiled create_block_mask. Measured on an H200 (Qwen3-8B shape,
    S 3072, 512 blocks of 16, flex): steady step 221 ms compiled vs 224 ms eager, but the first step
    210 s vs 13 s (compiling the mask for the second layer type alone took 215 s), so it is off by
    default (`--compile flex` turns it on; compare with `python bench/train_bench.py --shape
    qwen3-8b --attention flex --compile flex|none`). A packed row gives exactly the sums of its
    samples computed one by one (tests/test_packing.py).
    """
    if grad_ckpt not in GRAD_CKPT_MODES:
        raise ValueError(f"grad_ckpt must be one of {GRAD_CKPT_MODES}, got {grad_ckpt!r}")
    if ce not in CE_MODES:
        raise ValueError(f"ce must be one of {CE_MODES}, got {ce!r}")
    cfg = _unwrap(drafter).cfg
    if block_size != cfg.block_size:
        raise ValueError(f"block_size {block_size} differs from the drafter's {cfg.block_size}")
    ids_BS, loss_mask_BS, doc_ids_BS = batch.ids_BS, batch.loss_mask_BS, batch.doc_ids_BS
    dspark, objective = dspark or DSparkLoss(), objective or Objective()
    last_BSH = None
    if (cfg.drafter_type == "dspark" and dspark.mode == "full") or objective.needs_target:
        batch, last_BSH = batch.split_last()
    with torch.no_grad():
        block_ids_BQ = block_inputs(
            ids_BS, anchors_BN, block_size=block_size, mask_token_id=mask_token_id
        )
        block_emb_BQH = F.embedding(block_ids_BQ, embed_weight_VH)
    masks = build_masks(
        anchors_BN,
        keep_BN,
        context_len=ids_BS.shape[1],
        block_size=block_size,
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
        attention=attention,
        starts_BN=context_starts(anchors_BN, batch.positions_BS),
        compiled=compile_masks,
        causal=cfg.is_causal,
    )
    hidden_BQH = drafter(
        batch.context(),
        block_emb_BQH,
        batch.positions_BS.long(),
        block_positions(anchors_BN, batch.positions_BS, block_size=block_size),
        masks,
        attention=attention,
        checkpoint_layers=grad_ckpt == "layers",
    )
    # DSpark: slot k predicts x[a + k + 1], and counts only after every slot before it counts.
    shift = int(cfg.anchor_predicts)
    targets_BQ = block_targets(ids_BS, anchors_BN, block_size=block_size, shift=shift)
    w_BQ = loss_weights(
        loss_mask_BS, doc_ids_BS, anchors_BN, keep_BN, block_size=block_size, gamma=gamma,
        shift=shift, cumulative=cfg.anchor_predicts,
        decay="exp" if objective.slot_weights == "exp" else "uniform",
    )  # fmt: skip
    chunk_rows = ce_chunk_blocks * block_size
    if cfg.drafter_type == "dspark":
        target = None
        if last_BSH is not None:  # the target's last state at rows a + k: its prediction of a+k+1
            rows_BQ = block_rows(anchors_BN, block_size=block_size).clamp(max=ids_BS.shape[1] - 1)
            target = TargetRows.at(last_BSH, rows_BQ)
        weighted_sum, weight_total, stats = dspark_step_terms(
            _unwrap(drafter), hidden_BQH, lm_head_weight_VH, targets_BQ,
            block_targets(ids_BS, anchors_BN, block_size=block_size), target, w_BQ, keep_BN,
            chunk_rows=chunk_rows, checkpoint=grad_ckpt != "none", fused=ce == "fused",
            compiled=compile_ce, options=dspark,
        )  # fmt: skip
        return StepOut(weighted_sum=weighted_sum, weight_total=weight_total, stats=stats)
    if cfg.drafter_type == "dflash2":  # CE_base plus the candidate selector's CE
        weighted_sum, weight_total, stats = selector_step_terms(
            hidden_BQH, lm_head_weight_VH, targets_BQ, w_BQ, keep_BN,
            _unwrap(drafter).candidate_selector, cfg, chunk_rows=chunk_rows,
            checkpoint=grad_ckpt != "none", fused=ce == "fused", compiled=compile_ce,
            options=selector or SelectorLoss(),
        )  # fmt: skip
        return StepOut(weighted_sum=weighted_sum, weight_total=weight_total, stats=stats)
    if not objective.plain_ce:
        target = None
        if last_BSH is not None:  # the target's last state at row a + k - 1: its x[a + k]
            rows_BQ = block_rows(anchors_BN - 1, block_size=block_size)
            rows_BQ = rows_BQ.clamp(min=0, max=ids_BS.shape[1] - 1)  # weight 0 outside
            target = TargetRows.at(last_BSH, rows_BQ)
        out = chunked_target_loss(
            hidden_BQH.flatten(0, 1), lm_head_weight_VH, targets_BQ.flatten(), target,
            w_BQ.flatten(),
            objective=objective, block_size=block_size, chunk_rows=chunk_rows,
            fused=ce == "fused", compiled=compile_ce, checkpoint=grad_ckpt != "none",
        )  # fmt: skip
        stats = acceptance_stats(
            out.correct_N.view_as(targets_BQ), w_BQ, keep_BN, block_size=block_size
        )
        stats["objective_terms"] = out.terms
        return StepOut(weighted_sum=out.loss, weight_total=out.weight_total, stats=stats)
    ce_args = (hidden_BQH.flatten(0, 1), lm_head_weight_VH, targets_BQ.flatten(), w_BQ.flatten())
    if ce == "fused":
        weighted_sum, weight_total, correct_N = fused_chunked_ce(
            *ce_args, chunk_rows=chunk_rows, compiled=compile_ce
        )
    else:
        weighted_sum, weight_total, correct_N = chunked_ce(
            *ce_args, chunk_rows=chunk_rows, checkpoint=grad_ckpt != "none"
        )
    stats = acceptance_stats(correct_N.view_as(targets_BQ), w_BQ, keep_BN, block_size=block_size)
    return StepOut(weighted_sum=weighted_sum, weight_total=weight_total, stats=stats)
