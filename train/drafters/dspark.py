"""DSpark: the DFlash drafter whose anchor slot drafts too, a Markov head and a confidence head.

../shared/DSPARK.md is the contract. The backbone, masks and RoPE are the DFlash drafter's
(train/drafters/dflash.py); the block [anchor, MASK x (B-1)] at positions p..p+B-1 sees the context
strictly before p and itself (non-causal), and slot k predicts token p + k + 1, so a block yields
B drafts. On top of the final hidden state h_k (after the final norm, as the reference
`speculators` computes it):

- Markov head (vanilla, rank r): slot k's logits are lm_head(h_k) + W2 @ W1[x_{k-1}], with x_{-1}
  the anchor; W1 `markov_head.markov_w1` [V, r] (an embedding), W2 `markov_head.markov_w2`
  [V, r] (a linear r -> V). Training feeds the data tokens (teacher forcing), inference the
  drafted ones, left to right.
- Confidence head: c_k = proj([h_k ; W1[x_{k-1}]]) with proj `confidence_head.proj` a Linear
  (H + r -> 1) with bias (H -> 1 without the Markov input): the logit of P(slot k accepted |
  the slots before it accepted).

Parameter names are the export keys. Shapes as in train/drafters/dflash.py, plus r Markov rank,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights

# Parameter-name prefixes of the DSpark heads (everything else is a DFlash parameter).
HEADS = ("markov_head.", "confidence_head.")


class MarkovHead(nn.Module):
    """A first-order logit bias of rank r: bias(prev) = W2 @ W1[prev]."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def embed(self, prev_N: torch.Tensor) -> torch.Tensor:
        """W1[prev]: [..., r]."""
        return self.markov_w1(prev_N.long())

    def bias(self, emb_Nr: torch.Tensor) -> torch.Tensor:
        """W2 @ emb: the logit bias [..., V]."""
        return self.markov_w2(emb_Nr.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """Linear (features -> 1) with bias: the acceptance logit of a slot."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass
class Drafts:
    """A left-to-right walk over the slots: the drafted tokens [N, Q], the corrected logits
    they were drawn from [N, Q, V] (float32), and the confidence logits [N, Q] (None without
    the head)."""

    tokens_NQ: torch.Tensor
    logits_NQV: torch.Tensor
    confidence_NQ: torch.Tensor | None


class DSparkDrafter(DFlashDrafter):
    """The DFlash drafter with DSpark's block layout, Markov head and confidence head."""

    def __init__(self, cfg: DrafterConfig) -> None:
        if cfg.drafter_type != "dspark":
            raise ValueError(f"DSparkDrafter needs drafter_type dspark, got {cfg.drafter_type}")
        super().__init__(cfg)
        rank = cfg.markov_rank
        self.markov_head = MarkovHead(cfg.vocab_size, rank) if rank else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            extra = rank if cfg.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(cfg.hidden_size + extra)

    def prev_embeddings(self, prev_N: torch.Tensor) -> torch.Tensor | None:
        """W1[prev] [..., r], or None without a Markov head."""
        return None if self.markov_head is None else self.markov_head.embed(prev_N)

    def markov_bias(self, emb_Nr: torch.Tensor | None) -> torch.Tensor | None:
        return None if emb_Nr is None else self.markov_head.bias(emb_Nr)

    def confidence(self, hidden_NH: torch.Tensor, emb_Nr: torch.Tensor | None):
        """Confidence logits [...] of slots with final hidden states `hidden_NH` and previous
        tokens embedded as `emb_Nr`; None without the head."""
        head = self.confidence_head
        if head is None:
            return None
        features = hidden_NH
        if self.cfg.confidence_head_with_markov:
            features = torch.cat([hidden_NH, emb_Nr.to(hidden_NH.dtype)], dim=-1)
        return head(features.to(head.proj.weight.dtype))

    def slot_logits(
        self, hidden_NH: torch.Tensor, lm_head_VH: torch.Tensor, emb_Nr: torch.Tensor | None
    ) -> torch.Tensor:
        """Corrected logits [..., V]: lm_head(h) plus the Markov bias of the previous token."""
        logits = F.linear(hidden_NH.to(lm_head_VH.dtype), lm_head_VH)
        bias = self.markov_bias(emb_Nr)
        return logits if bias is None else logits + bias.to(logits.dtype)

    def walk(
        self,
        hidden_NQH: torch.Tensor,
        lm_head_VH: torch.Tensor,
        first_N: torch.Tensor,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Drafts:
        """Draft every slot left to right: prev = the anchor; per slot add the bias of prev,
        take the argmax (temperature 0) or sample softmax(logits / temperature); prev = that
        draft. The confidence of a slot reads the same previous token."""
        prev_N, tokens, logits, conf = first_N, [], [], []
        for slot in range(hidden_NQH.shape[1]):
            emb = self.prev_embeddings(prev_N)
            hidden_NH = hidden_NQH[:, slot]
            logits_NV = self.slot_logits(hidden_NH, lm_head_VH, emb).float()
            if temperature > 0:
                probs = torch.softmax(logits_NV / temperature, dim=-1)
                prev_N = torch.multinomial(probs, 1, generator=generator)[:, 0]
            else:
                prev_N = logits_NV.argmax(dim=-1)
            tokens.append(prev_N)
            logits.append(logits_NV)
            conf.append(self.confidence(hidden_NH, emb))
        confidence = None if self.confidence_head is None else torch.stack(conf, dim=1)
        return Drafts(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), confidence)

    def propose(
        self, hidden_NQH: torch.Tensor, lm_head_VH: torch.Tensor, first_N: torch.Tensor
    ) -> torch.Tensor:
        """Greedy drafts [N, Q], one per slot (the anchor's included): the Markov walk."""
        return self.walk(hidden_NQH, lm_head_VH, first_N).tokens_NQ


def is_head_parameter(name: str) -> bool:
    """Whether a parameter belongs to a DSpark head (not to the DFlash backbone)."""
    return name.startswith(HEADS)


@torch.no_grad()
def init_dspark_weights(model: DSparkDrafter, seed: int) -> None:
    """The backbone exactly as `init_drafter_weights` with the same seed; W1 and the confidence
    weight N(0, 0.02) from their own generator, W2 and the confidence bias 0. W2 = 0 makes the
    Markov bias start at zero: step 0's logits are the plain anchor-first drafter's."""
    names = [name for name, _ in model.named_parameters()]
    init_drafter_weights(model, seed, names=[n for n in names if not is_head_parameter(n)])
    gen = torch.Generator().manual_seed(seed + 1)
    if model.markov_head is not None:
        w1 = model.markov_head.markov_w1.weight
        w1.copy_(torch.empty(w1.shape).normal_(0.0, 0.02, generator=gen))
        model.markov_head.markov_w2.weight.zero_()
    if model.confidence_head is not None:
        proj = model.confidence_head.proj
        proj.weight.copy_(torch.empty(proj.weight.shape).normal_(0.0, 0.02, generator=gen))
        proj.bias.zero_()
