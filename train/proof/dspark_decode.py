"""Speculative decoding with a DSpark drafter: B drafts a block, a left-to-right Markov walk.

Per verify step the drafter embeds [last token, MASK x (B-1)] at positions p..p+B-1 and walks its
slots left to right: slot k adds the Markov bias of the token before it (the anchor for slot 0,
else the draft of slot k-1) and takes the argmax, or at temperature T > 0 samples
softmax(corrected logits / T). `confidence_threshold` cuts the drafts before the first slot whose
confidence sigmoid(c_k) is below it (a static cut, as llama.cpp and SGLang serve it; none
drafted: a plain one-token step). The target scores [last token, drafts] (up to B + 1 tokens) in
one forward. Greedy: the longest prefix of drafts equal to the target's argmax is kept, plus the
target's next token; the output equals the target's greedy output. Sampled: standard speculative
sampling (each draft kept with probability min(1, p/q), the first rejected one resampled from
max(0, p - q) normalised, a bonus token from p when all are kept), with q the distribution the
walk drew from; the output is distributed as the target's own sampling at T.

The caches, clipping at max_new_tokens and eos, and the acceptance length (tokens produced per
verify step) are those of `train.proof.decode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from train.drafters.dflash import DFlashDrafter
from train.drafters.dspark import DSparkDrafter
from train.proof.decode import (
    DraftState,
    Result,
    _keep,
    begin_decoding,
    context_features,
    pooled_tau_se,
    se_words,
    speculate,
    sync_clock,
)


def rejection_sample(
    p_NLV: torch.Tensor,
    q_NKV: torch.Tensor,
    drafts_NK: torch.Tensor,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of N independent verify steps: (accepted drafts [N], the next token
    [N]). p: the target's distributions at the L = K + 1 verified positions, q: the drafter's
    at the K drafted ones, `drafts_NK` drawn from q. Draft k is kept with probability
    min(1, p_k(d_k) / q_k(d_k)) while every one before it was kept; the next token is drawn
    from max(0, p_j - q_j) normalised at the first rejected slot j, or from p_K when all K are
    kept.

    >>> p = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
    >>> q = torch.tensor([[[0.5, 0.5]]])
    >>> rejection_sample(p, q, torch.tensor([[1]]))  # p certain of the draft: kept, bonus 0
    (tensor([1]), tensor([0]))
    """
    num, k = drafts_NK.shape
    rows = torch.arange(num, device=p_NLV.device)
    p_draft = p_NLV[:, :k].gather(-1, drafts_NK[..., None])[..., 0]
    q_draft = q_NKV.gather(-1, drafts_NK[..., None])[..., 0]
    u_NK = torch.rand(num, k, generator=generator, device=generator.device if generator else None)
    kept_NK = u_NK.to(p_draft.device) * q_draft <= p_draft
    accepted_N = kept_NK.long().cumprod(dim=-1).sum(dim=-1)
    p_at = p_NLV[rows, accepted_N]
    q_at = q_NKV[rows, accepted_N.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_at)
    q_at = q_at * (accepted_N < k)[:, None]
    residual = (p_at - q_at).clamp(min=0)
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q at a rejection: rounding only
    residual = torch.where(empty, p_at, residual)
    next_N = torch.multinomial(residual / residual.sum(-1, keepdim=True), 1, generator=generator)
    return accepted_N, next_N[:, 0].to(p_NLV.device)


def _first_token(logits_V: torch.Tensor, temperature: float, generator) -> int:
    if temperature <= 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _cut(drafts: torch.Tensor, confidence: torch.Tensor | None, threshold: float | None):
    """The drafts before the first slot whose confidence is below `threshold`."""
    if threshold is None or confidence is None:
        return drafts
    low = (torch.sigmoid(confidence.float()) < threshold).nonzero()
    return drafts if low.numel() == 0 else drafts[: int(low[0, 0])]


@torch.inference_mode()
def speculate_dspark(
    target_model: nn.Module,
    drafter: DSparkDrafter,
    input_ids: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    temperature: float = 0.0,
    confidence_threshold: float | None = None,
    generator: torch.Generator | None = None,
    full_blocks: bool = False,
) -> Result:
    """Speculative decoding of one prompt with a DSpark drafter (see the module docstring).
    The last blocks are cut to the tokens still wanted unless `full_blocks`; `generator` draws
    the samples at temperature > 0."""
    ids_1P, cache = begin_decoding(target_model, input_ids, max_new_tokens, drafter.cfg.block_size)
    cfg, device, eos = drafter.cfg, ids_1P.device, set(eos_ids)
    lm_head_VH = target_model.get_output_embeddings().weight
    draft = DraftState(drafter, target_model.get_input_embeddings().weight, lm_head_VH)
    started = sync_clock(device)
    out = target_model(ids_1P, **cache.kwargs, output_hidden_states=True, logits_to_keep=1)
    draft.extend(context_features(out.hidden_states, cfg.target_layer_ids))
    tokens = ids_1P[0].tolist() + [_first_token(out.logits[0, -1], temperature, generator)]
    start, max_len, lengths, unclipped = ids_1P.shape[1], ids_1P.shape[1] + max_new_tokens, [], []
    stopped = tokens[-1] in eos
    while start + 1 < max_len and not stopped:
        room = max_len - start - 1  # tokens still wanted after tokens[start]
        q_len = cfg.block_size if full_blocks else min(cfg.block_size, room)
        block_1Q = torch.full((1, q_len), cfg.mask_token_id, dtype=torch.long, device=device)
        block_1Q[0, 0] = tokens[start]
        walk = drafter.walk(
            draft.block_hidden(block_1Q), lm_head_VH, block_1Q[:, 0],
            temperature=temperature, generator=generator,
        )  # fmt: skip
        confidence = None if walk.confidence_NQ is None else walk.confidence_NQ[0]
        drafts = _cut(walk.tokens_NQ[0], confidence, confidence_threshold)
        verify_1L = torch.cat([block_1Q[:, :1], drafts[None]], dim=1)
        snapshot = cache.snapshot()
        out = target_model(
            verify_1L,
            position_ids=torch.arange(start, start + verify_1L.shape[1], device=device)[None],
            **cache.kwargs,
            output_hidden_states=True,
        )
        k = drafts.shape[0]
        if temperature > 0:
            p_LV = torch.softmax(out.logits[0].float() / temperature, dim=-1)
            q_KV = torch.softmax(walk.logits_NQV[0, :k] / temperature, dim=-1)
            accepted_1, next_1 = rejection_sample(
                p_LV[None], q_KV[None], drafts[None], generator=generator
            )
            accepted = int(accepted_1)
            produced = [*drafts[:accepted].tolist(), int(next_1)]
        else:
            proposed, verified = torch.stack([verify_1L[0, 1:], out.logits[0, :k].argmax(-1)])
            accepted = int((proposed == verified).long().cumprod(0).sum()) if k else 0
            produced = out.logits[0, : accepted + 1].argmax(-1).tolist()
        new, stopped = _keep(produced, room, eos)
        tokens += new
        features = context_features(out.hidden_states, cfg.target_layer_ids)
        draft.extend(features[:, : len(new)])
        cache.keep(verify_1L, start, len(new), snapshot)
        start += len(new)
        lengths.append(len(new))
        unclipped.append(accepted + 1)
    seconds = sync_clock(device) - started
    output = torch.tensor([tokens], dtype=torch.long, device=device)
    return Result(output, lengths, ids_1P.shape[1], seconds, unclipped)


def decode(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    input_ids: torch.Tensor | Sequence[int],
    *,
    temperature: float = 0.0,
    confidence_threshold: float | None = None,
    generator: torch.Generator | None = None,
    **limits: Any,
) -> Result:
    """Speculative decoding with a drafter of any family: DSpark's loop for a DSpark drafter,
    else `train.proof.decode.speculate` (greedy, no confidence head)."""
    if isinstance(drafter, DSparkDrafter):
        return speculate_dspark(
            target_model, drafter, input_ids, temperature=temperature,
            confidence_threshold=confidence_threshold, generator=generator, **limits,
        )  # fmt: skip
    if temperature > 0 or confidence_threshold is not None:
        raise ValueError(
            f"temperature and confidence_threshold decode DSpark drafters only, not "
            f"{drafter.cfg.drafter_type}"
        )
    return speculate(target_model, drafter, input_ids, **limits)


def sampled_summary(
    target_model: nn.Module,
    drafter: DSparkDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int],
    temperature: float,
    confidence_threshold: float | None = None,
    seed: int = 0,
    full_blocks: bool = False,
) -> dict[str, Any]:
    """Sampled speculative decoding of every prompt (one generator seeded with `seed`): tau
    (tokens per verify step), steps and tokens. `full_blocks`: as `speculate_dspark`."""
    device = next(target_model.parameters()).device
    gen = torch.Generator(device).manual_seed(seed)
    runs = [
        speculate_dspark(
            target_model, drafter, ids, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
            temperature=temperature, confidence_threshold=confidence_threshold, generator=gen,
            full_blocks=full_blocks,
        )
        for ids in prompts
    ]  # fmt: skip
    lengths = [n for run in runs for n in run.acceptance_lengths]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else float("nan"),
        "tau_se": pooled_tau_se([run.acceptance_lengths for run in runs]),
        "steps": len(lengths),
        "new_tokens": sum(len(run.new_ids) for run in runs),
        "prompts": len(runs),
        "block_size": drafter.cfg.block_size,
        "temperature": temperature,
        "confidence_threshold": confidence_threshold,
        "seed": seed,
    }


def format_sampled(summary: dict[str, Any]) -> str:
    """One line of a `sampled_summary`."""
    cut = summary["confidence_threshold"]
    return (
        f"tau {summary['tau']:.3f} {se_words(summary['tau_se'])} over {summary['steps']} steps "
        f"(block {summary['block_size']}, "
        f"sampled at temperature {summary['temperature']}, seed {summary['seed']}"
        + ("" if cut is None else f", confidence cut {cut}")
        + f"), {summary['new_tokens']} tokens from {summary['prompts']} prompts"
    )
