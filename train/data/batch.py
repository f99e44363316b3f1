"""A micro-batch of packed rows: what the data path hands the training step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# Added to a micro-batch's anchor seed, so that its noise and its anchors come from two streams.
NOISE_SEED_OFFSET = 0x6E6F697365


@dataclass
class Batch:
    """Packed rows of cached samples; give exactly one of hidden_BSKH or context_BSC.

    Each of the B rows holds whole samples back to back: `doc_ids_BS` numbers them (-1 on
    padding), `positions_BS` restarts at 0 at each sample. hidden_BSKH holds the K captured target
    layers per token (bf16 or float); context_BSC is the same data already flattened to C = K*H
    (layers concatenated in target_layer_ids order). `num_tokens` counts the real tokens.
    """

    ids_BS: torch.Tensor
    loss_mask_BS: torch.Tensor
    doc_ids_BS: torch.Tensor
    positions_BS: torch.Tensor
    hidden_BSKH: torch.Tensor | None = None
    context_BSC: torch.Tensor | None = None
    num_tokens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.hidden_BSKH is None) == (self.context_BSC is None):
            raise ValueError("Batch: give exactly one of hidden_BSKH and context_BSC")
        for name in ("loss_mask_BS", "doc_ids_BS", "positions_BS"):
            if getattr(self, name).shape != self.ids_BS.shape:
                raise ValueError(
                    f"Batch: ids_BS {tuple(self.ids_BS.shape)} and {name} "
                    f"{tuple(getattr(self, name).shape)} differ"
                )
        if self.num_tokens is None:
            self.num_tokens = (self.doc_ids_BS >= 0).sum()

    @classmethod
    def one_per_row(cls, lengths_B: torch.Tensor, **fields: torch.Tensor) -> Batch:
        """A batch whose row b holds one sample of length lengths_B[b], then padding."""
        seq = fields["ids_BS"].shape[1]
        pos_BS = torch.arange(seq, device=lengths_B.device).expand(len(lengths_B), seq)
        inside = pos_BS < lengths_B[:, None]
        doc_ids_BS = torch.where(inside, 0, -1).to(torch.int32)
        return cls(doc_ids_BS=doc_ids_BS, positions_BS=(pos_BS * inside).int(), **fields)

    def split_last(self) -> tuple[Batch, torch.Tensor]:
        """(this batch without its last cached layer, that layer [B, S, H]): DSpark reads the
        target's last hidden state as one more layer after the drafter's taps."""
        if self.hidden_BSKH is None or self.hidden_BSKH.shape[2] < 2:
            raise ValueError("Batch.split_last: needs hidden_BSKH with the taps and one more layer")
        fields = {**vars(self), "hidden_BSKH": self.hidden_BSKH[:, :, :-1]}
        return Batch(**fields), self.hidden_BSKH[:, :, -1]

    def context(self) -> torch.Tensor:
        """Context input [B, S, K*H]."""
        if self.context_BSC is not None:
            return self.context_BSC
        batch, seq, layers, hidden = self.hidden_BSKH.shape
        return self.hidden_BSKH.reshape(batch, seq, layers * hidden)

    def noised(self, *, std: float, seed: int, layers: int | None = None) -> Batch:
        """This batch with N(0, std^2) noise added to the hidden states of its real tokens (padding
        stays zero; with `layers`, only the first `layers` cached layers: the drafter's taps, not
        the target's last layer read after them as the target's distribution), drawn on the batch's
        device from a generator seeded with `seed + NOISE_SEED_OFFSET`: the same micro-batch gets
        the same noise in a resumed run. `std` 0 returns the batch itself. The training step's
        `--noise-std`: the drafter learns from states near the cached ones, as a serving engine's
        (other kernels, batch shapes, precision) are; evaluation and decoding see the states
        unchanged.

        >>> ids = torch.zeros(1, 3, dtype=torch.long)
        >>> b = Batch.one_per_row(torch.tensor([2]), ids_BS=ids, loss_mask_BS=ids,
        ...                       hidden_BSKH=torch.zeros(1, 3, 2, 4))
        >>> n = b.noised(std=0.5, seed=1).hidden_BSKH
        >>> bool(n[0, :2].abs().gt(0).all()), bool(n[0, 2].eq(0).all())
        (True, True)
        """
        if std == 0:
            return self
        field = "hidden_BSKH" if self.hidden_BSKH is not None else "context_BSC"
        states = getattr(self, field)
        gen = torch.Generator(device=states.device).manual_seed(seed + NOISE_SEED_OFFSET)
        noise = torch.randn(states.shape, generator=gen, device=states.device, dtype=torch.float32)
        real = (self.doc_ids_BS >= 0).reshape(*self.doc_ids_BS.shape, *[1] * (states.ndim - 2))
        if layers is not None and field == "hidden_BSKH":
            taps = torch.arange(states.shape[2], device=states.device) < layers
            real = real & taps[:, None]
        out = (states.float() + noise * std * real).to(states.dtype)
        return dataclasses.replace(self, **{field: out})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return Batch(**{k: move(v) for k, v in vars(self).items()})
