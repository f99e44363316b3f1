"""The greedy speculative decoding loop: a Hugging Face target and a DFlash drafter, with caches.

Per verify step the drafter proposes B-1 tokens for the block [last token, MASK x (B-1)]; the
target scores the block in one forward; the longest prefix of drafts equal to the target's argmax
is kept, plus the target's bonus token. The step's acceptance length (accepted drafts + 1, clipped
at max_new_tokens and at eos) is what `dflash.model.dflash_generate` reports; tau averages it.

Caches: the target's transformers DynamicCache is cropped to the accepted length (hybrid targets
also restore recurrent states, see TargetCache). The drafter caches only each layer's projected
context K/V (k/v_proj of hidden_norm(fc(target states)), after k_norm and RoPE), extended with
each step's accepted rows; the block's own K/V are recomputed every step. Context rows are
`hidden_states[i + 1]` for target layer i, as in the reference; transformers returns the last
layer's entry after the final norm, and extraction stores it so too. transformers is imported only
where the target is loaded: the rest of stage two does not need it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.drafters.dflash import DFlashDrafter, apply_rope, rope_inv_freq
from train.drafters.mask import dense_mask

log = logging.getLogger(__name__)


@dataclass
class Result:
    """One generation: the prompt followed by the new tokens, and what each verify step made."""

    output_ids: torch.Tensor  # [1, P + N] on the target's device
    acceptance_lengths: list[int]  # tokens produced per target forward after the prefill
    num_input_tokens: int
    seconds: float = 0.0
    # Accepted drafts + 1 per step before the clip at max_new_tokens and eos: vLLM's count.
    unclipped_lengths: list[int] = field(default_factory=list)

    @property
    def new_ids(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    @property
    def tau(self) -> float:
        """Mean acceptance length (accepted drafts + 1) per verify step; nan without steps."""
        if not self.acceptance_lengths:
            return float("nan")
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


def pooled_tau_se(lengths_per_prompt: Sequence[Sequence[int]]) -> float:
    """Standard error of the pooled tau (all steps' lengths over all steps) with prompts as
    independent clusters (a step's length depends on the steps of its own prompt): the ratio
    estimator's sqrt(sum_i (L_i - tau n_i)^2 / (m (m - 1))) / mean(n_i), L_i and n_i prompt i's
    summed lengths and steps over m prompts (a prompt with no verify step is one of them, as
    `train.proof.tau.ratio_se` counts it); nan under two prompts with steps.

    >>> round(pooled_tau_se([[1, 1], [3, 3], [2]]), 4)
    0.6928
    >>> round(pooled_tau_se([[1, 1], [3, 3], [2], []]), 4)  # eos first in the 4th: no step
    0.6532
    """
    sums = [(sum(ls), len(ls)) for ls in lengths_per_prompt]
    m = len(sums)
    if sum(1 for _, n in sums if n) < 2:
        return float("nan")
    tau = sum(total for total, _ in sums) / sum(n for _, n in sums)
    spread = sum((total - tau * n) ** 2 for total, n in sums) / (m * (m - 1))
    return spread**0.5 / (sum(n for _, n in sums) / m)


def se_words(se: float) -> str:
    """`+- se` where one was measured; under two prompts with steps, saying why there is none.

    >>> se_words(0.1234), se_words(pooled_tau_se([[2, 3]]))
    ('+- 0.123', '(no standard error: fewer than two prompts with a verify step)')
    """
    return (
        f"+- {se:.3f}"
        if se == se
        else "(no standard error: fewer than two prompts with a verify step)"
    )


def context_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]):
    """[1, n, K*H]: target layer i is `hidden_states[i + 1]` (index 0 is the embedding)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


class DraftState:
    """The drafter at inference: a per-layer cache of projected context K/V, and block proposals.

    `extend` appends context rows (target features of accepted tokens, in position order);
    `propose` drafts the block that starts at the next position without changing the cache.
    """

    def __init__(self, drafter: DFlashDrafter, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor):
        self.drafter, self.cfg = drafter, drafter.cfg
        self.embed_VH, self.lm_head_VH = embed_VH, lm_head_VH
        self.dtype = drafter.fc.weight.dtype
        # float32 always: drafter.to(bfloat16) also rounds the model's inv_freq buffer.
        self.inv_freq_d = rope_inv_freq(self.cfg).to(embed_VH.device)
        self.keys: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.values: list[torch.Tensor | None] = [None] * len(drafter.layers)
        self.length = 0  # context rows cached = the position of the next block's first token

    def _rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos_N = torch.arange(start, start + n, device=self.embed_VH.device)
        freqs_Nd = pos_N[:, None].float() * self.inv_freq_d
        emb_1ND = torch.cat([freqs_Nd, freqs_Nd], dim=-1)[None]
        return emb_1ND.cos(), emb_1ND.sin()

    def _kv(self, attn: nn.Module, x_1NH: torch.Tensor, cos, sin):
        n, d = x_1NH.shape[1], attn.head_dim
        k = attn.k_norm(attn.k_proj(x_1NH).view(1, n, attn.num_kv_heads, d)).transpose(1, 2)
        v = attn.v_proj(x_1NH).view(1, n, attn.num_kv_heads, d).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def extend(self, context_1NC: torch.Tensor) -> None:
        ctx_1NH = self.drafter.hidden_norm(self.drafter.fc(context_1NC.to(self.dtype)))
        cos, sin = self._rope(self.length, ctx_1NH.shape[1])
        for i, layer in enumerate(self.drafter.layers):
            k, v = self._kv(layer.self_attn, ctx_1NH, cos, sin)
            old_k, old_v = self.keys[i], self.values[i]
            self.keys[i] = k if old_k is None else torch.cat([old_k, k], dim=2)
            self.values[i] = v if old_v is None else torch.cat([old_v, v], dim=2)
        self.length += ctx_1NH.shape[1]

    def propose(self, block_ids_1Q: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [1, Q-1] for block offsets 1..Q-1 (block = [last token, MASK...]): the
        unary argmax, or DFlash2's selector walk from the block's first token (DSpark, whose
        anchor slot drafts too: [1, Q], its Markov walk)."""
        first = 0 if self.cfg.anchor_predicts else 1
        hidden_1QH = self.block_hidden(block_ids_1Q)[:, first:]
        return self.drafter.propose(hidden_1QH, self.lm_head_VH, block_ids_1Q[:, 0])

    def block_hidden(self, block_ids_1Q: torch.Tensor) -> torch.Tensor:
        """The drafter's final hidden states [1, Q, H] (after its norm) of every block slot."""
        q_len = block_ids_1Q.shape[1]
        x_1QH = F.embedding(block_ids_1Q, self.embed_VH).to(self.dtype)
        cos, sin = self._rope(self.length, q_len)
        masks = {t: self._mask(t, q_len) for t in set(self.cfg.layer_types)}
        for i, layer in enumerate(self.drafter.layers):
            mask = masks[layer.layer_type]

            def attend(h_1QH, i=i, attn=layer.self_attn, mask=mask):
                return self._attend(i, attn, h_1QH, cos, sin, mask)

            x_1QH = layer.run(x_1QH, attend)  # the layer's own order (DFlash2: convolutions)
        return self.drafter.norm(x_1QH)

    def _mask(self, layer_type: str, q_len: int) -> torch.Tensor | None:
        if layer_type == "full_attention" and not self.cfg.is_causal:
            return None  # the block sees the whole context and itself: no mask needed
        # The training mask function with one anchor at the block start: one source of truth.
        return dense_mask(
            torch.tensor([[self.length]], device=self.embed_VH.device),
            torch.tensor([[True]], device=self.embed_VH.device),
            context_len=self.length,
            block_size=q_len,
            layer_type=layer_type,
            sliding_window=self.cfg.sliding_window,
            causal=self.cfg.is_causal,
        )

    def _attend(self, i: int, attn: nn.Module, h_1QH, cos, sin, mask) -> torch.Tensor:
        q_len, d = h_1QH.shape[1], attn.head_dim
        q = attn.q_norm(attn.q_proj(h_1QH).view(1, q_len, attn.num_heads, d)).transpose(1, 2)
        k_blk, v_blk = self._kv(attn, h_1QH, cos, sin)
        k = torch.cat([self.keys[i], k_blk], dim=2)
        v = torch.cat([self.values[i], v_blk], dim=2)
        groups = attn.num_heads // attn.num_kv_heads
        if mask is not None and groups > 1:
            # sdpa's enable_gqa with a mask falls back to the math kernel (as in
            # train/drafters/dflash.py).
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            apply_rope(q, cos, sin), k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=groups > 1
        )
        return attn.o_proj(out.transpose(1, 2).reshape(1, q_len, -1))


class TargetCache:
    """The target's KV cache, taken back to the accepted length after each verify forward.

    A DynamicCache with past recording crops attention K/V and linear-attention conv states, but
    not the Gated DeltaNet recurrent states (transformers 5.24). For hybrid targets those are
    snapshotted before the verify forward; a partly accepted block is then cropped to its start,
    the snapshot restored and the kept tokens replayed (one more forward of <= B tokens).
    """

    def __init__(self, target: nn.Module, rollback: int = 0) -> None:
        from transformers import DynamicCache

        self.target, self.cache = target, DynamicCache(config=target.config)
        if hasattr(self.cache, "activate_past_recording"):
            # transformers 5.25 crops Gated DeltaNet states from a history of the last
            # `recurrent_states_to_keep` tokens' states (its default, None, fails in the forward):
            # a verify forward's tokens. Earlier versions have no such option.
            try:
                self.cache.activate_past_recording(recurrent_states_to_keep=rollback)
            except TypeError:
                self.cache.activate_past_recording()
        # transformers 5.2x renamed `past_key_values` to `cache` (the old name warns until 5.40).
        params = inspect.signature(target.forward).parameters
        self.kwargs = {"cache" if "cache" in params else "past_key_values": self.cache}
        self.kwargs["use_cache"] = True
        types = getattr(target.config.get_text_config(), "layer_types", None) or ()
        self.hybrid = "linear_attention" in types

    def _recurrent(self) -> list[dict[int, torch.Tensor]]:
        layers = getattr(self.cache, "layers", ())
        found = [getattr(layer, "recurrent_states", None) for layer in layers]
        found = [states for states in found if isinstance(states, dict)]
        if self.hybrid and not found:
            raise RuntimeError("this transformers cache exposes no recurrent states to roll back")
        return found

    def snapshot(self) -> list[dict[int, torch.Tensor]]:
        if not self.hybrid:
            return []
        return [
            {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in self._recurrent()
        ]

    def keep(self, block_1Q: torch.Tensor, start: int, kept: int, snapshot: list) -> None:
        """After verifying `block_1Q` at `start`, hold positions < start + kept only."""
        if not snapshot or kept == block_1Q.shape[1]:
            crop_cache(self.cache, start + kept)
            return
        crop_cache(self.cache, start)
        for states, saved in zip(self._recurrent(), snapshot, strict=True):
            for k, value in saved.items():
                states[k].copy_(value)
        positions = torch.arange(start, start + kept, device=block_1Q.device)[None]
        self.target(block_1Q[:, :kept], position_ids=positions, **self.kwargs, logits_to_keep=1)


def crop_cache(cache: Any, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def begin_decoding(
    target: nn.Module, input_ids: Any, max_new_tokens: int, rollback: int = 0
) -> tuple[torch.Tensor, TargetCache]:
    """(prompt [1, P] on the target's device, a fresh target cache that can take back up to
    `rollback` tokens, a verify forward's); checks the arguments."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = target.get_input_embeddings().weight.device
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be one non-empty sequence, got shape {tuple(ids.shape)}")
    return ids, TargetCache(target, rollback)


def sync_clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _keep(new: list[int], room: int, eos: set[int]) -> tuple[list[int], bool]:
    """The tokens a step keeps: at most `room`, ending after the first eos; and whether it stops."""
    new = new[:room]
    for n, tok in enumerate(new):
        if tok in eos:
            return new[: n + 1], True
    return new, False


@torch.inference_mode()
def speculate(
    target_model: nn.Module,
    drafter: DFlashDrafter,
    input_ids: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    full_blocks: bool = False,
) -> Result:
    """Greedy speculative decoding of one prompt (`drafter` on the target's device); the output
    equals the target's greedy output up to floating-point near-ties.

    The last blocks are cut to the tokens still wanted, as in z-lab's `dflash_generate`;
    `full_blocks` keeps them whole and cuts the output instead, as vLLM does (a shorter block
    changes what a bidirectional drafter proposes)."""
    ids_1P, cache = begin_decoding(target_model, input_ids, max_new_tokens, drafter.cfg.block_size)
    cfg, device, eos = drafter.cfg, ids_1P.device, set(eos_ids)
    embed_VH = target_model.get_input_embeddings().weight
    draft = DraftState(drafter, embed_VH, target_model.get_output_embeddings().weight)
    started = sync_clock(device)
    out = target_model(ids_1P, **cache.kwargs, output_hidden_states=True, logits_to_keep=1)
    draft.extend(context_features(out.hidden_states, cfg.target_layer_ids))
    tokens = ids_1P[0].tolist() + [int(out.logits[0, -1].argmax())]
    start, max_len, lengths, unclipped = ids_1P.shape[1], ids_1P.shape[1] + max_new_tokens, [], []
    stopped = tokens[-1] in eos
    while start + 1 < max_len and not stopped:
        q_len = cfg.block_size if full_blocks else min(cfg.block_size, max_len - start)
        block_1Q = torch.full((1, q_len), cfg.mask_token_id, dtype=torch.long, device=device)
        block_1Q[0, 0] = tokens[start]
        block_1Q[0, 1:] = draft.propose(block_1Q)
        snapshot = cache.snapshot()
        out = target_model(
            block_1Q,
            position_ids=torch.arange(start, start + q_len, device=device)[None],
            **cache.kwargs,
            output_hidden_states=True,
        )
        # One host copy per step: the drafts and the target's argmax side by side.
        drafts, verified = torch.stack([block_1Q[0], out.logits[0].argmax(dim=-1)]).tolist()
        accepted = 0
        while accepted < q_len - 1 and drafts[accepted + 1] == verified[accepted]:
            accepted += 1
        new, stopped = _keep(verified[: accepted + 1], max_len - start - 1, eos)
        tokens += new
        features = context_features(out.hidden_states, cfg.target_layer_ids)
        draft.extend(features[:, : len(new)])
        cache.keep(block_1Q, start, len(new), snapshot)
        start += len(new)
        lengths.append(len(new))
        unclipped.append(accepted + 1)
    seconds = sync_clock(device) - started
    output = torch.tensor([tokens], dtype=torch.long, device=device)
    return Result(output, lengths, ids_1P.shape[1], seconds, unclipped)


@torch.inference_mode()
def greedy(
    target_model: nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    *,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
) -> Result:
    """Plain greedy decoding with a KV cache (one token per forward: every step's length is 1)."""
    ids_1P, cache = begin_decoding(target_model, input_ids, max_new_tokens)
    started = sync_clock(ids_1P.device)
    out = target_model(ids_1P, **cache.kwargs, logits_to_keep=1)
    new = [int(out.logits[0, -1].argmax())]
    while len(new) < max_new_tokens and new[-1] not in eos_ids:
        step_11 = ids_1P.new_tensor([[new[-1]]])
        out = target_model(step_11, **cache.kwargs)
        new.append(int(out.logits[0, -1].argmax()))
    seconds = sync_clock(ids_1P.device) - started
    output = torch.cat([ids_1P, ids_1P.new_tensor([new])], dim=1)
    return Result(output, [1] * (len(new) - 1), ids_1P.shape[1], seconds)


# --- the command line: load, check, compare with plain greedy, report ---
