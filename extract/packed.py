"""The target on packed rows: one shape for the whole run, compiled once.

`PackedLayout` changes a loaded target in place so that its own forward runs on packed rows
(`extract.packing`): its attention modules call the document-masked attention of
`extract.packed_attention`, its Gated DeltaNet modules become `PackedGatedDeltaNet`, and with
`compile_layers` every decoder layer's forward goes through torch.compile with static shapes.
Layers of one class share one compiled graph (dynamo guards on the class, not the instance):
a dense target compiles one graph, a hybrid one per layer kind, plus the pieces between the
flash-linear-attention kernels, which run outside the graphs. `uninstall` restores the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from extract.linear_attention import PackedGatedDeltaNet, Segments, fla_kernels, supports
from extract.packed_attention import (
    PACKED_ATTENTION,
    SampleGroups,
    dense_document_mask,
    document_block_mask,
    document_mask_mod,
    register,
)
from extract.packing import (
    fitting_size,
    pack_rows,
    packed_inputs,
    row_sizes,
    sample_groups,
    taper_end,
)
from extract.target import decoder_layers

log = logging.getLogger(__name__)

PACKABLE_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})
# The attention kernel of packed rows (`--attention`): "flex" (flex_attention with the document
# BlockMask, inside the compiled layers), "flash" (the same through flash-attention 4's kernels,
# flex_attention's FLASH backend, where the flash-attn-4 package is installed), "sdpa" (each
# row's samples as padded batches through sdpa: cuDNN's kernel on an H200, outside the graphs),
# "dense" (sdpa with an [N, N] mask: the tests' reference). GPU_ATTENTION is what `--attention
# auto` runs on a GPU ("sdpa" elsewhere).
ATTENTION_KINDS = ("flex", "flash", "sdpa", "dense")
GPU_ATTENTION = "flex"


def packed_support(body: nn.Module, device: torch.device) -> str | None:
    """None if `body` can run packed rows on `device`, else the reason it cannot."""
    types = getattr(body.config, "layer_types", None) or ["full_attention"]
    other = sorted(set(types) - PACKABLE_LAYER_TYPES)
    if other:
        return f"its layer types {other} are not plain causal or linear attention"
    for layer in decoder_layers(body):
        inner = getattr(layer, "linear_attn", None)
        if inner is not None and (why := supports(inner)) is not None:
            return why
    if "linear_attention" in types and device.type == "cuda" and fla_kernels() is None:
        return "its linear-attention layers need flash-linear-attention on a GPU (not installed)"
    return None


def _configs(body: nn.Module) -> list:
    """Every distinct config object the model's modules read their attention function from."""
    found = {id(body.config): body.config}
    for module in body.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


class PackedLayout:
    """Packed rows of `chunk_tokens` through `body` (a decoder, see LayerCapture.body)."""

    name = "packed"

    def __init__(
        self,
        body: nn.Module,
        *,
        chunk_tokens: int,
        pad_id: int,
        device: torch.device,
        compile_layers: bool,
        backend: str = "inductor",
        attention: str | None = None,
    ):
        """`backend`: torch.compile's (tests use "eager" to check graphs without Inductor);
        `attention`: one of ATTENTION_KINDS (default: GPU_ATTENTION on GPUs, else "sdpa")."""
        self.body, self.chunk_tokens, self.pad_id = body, chunk_tokens, pad_id
        self.compiled = compile_layers
        if attention is None:
            attention = GPU_ATTENTION if device.type == "cuda" else "sdpa"
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {attention!r} is not one of {ATTENTION_KINDS}")
        self.attention = attention
        self.groups = SampleGroups()
        self.segments = Segments()
        # one document-id buffer and mask function per row size: a compiled graph per size
        self.sizes = row_sizes(chunk_tokens)
        self.docs = {n: torch.zeros(n, dtype=torch.long, device=device) for n in self.sizes}
        self.mask_mods = {n: document_mask_mod(doc) for n, doc in self.docs.items()}
        types = getattr(body.config, "layer_types", None)
        self.types = sorted(set(types)) if types else None
        self._undo: list[Callable[[], None]] = []
        # set by extract.layouts.choose_layout's probe: graphs it made, in how long, and the
        # process's count of graphs after it
        self.graphs, self.compile_s, self.graphs_after_probe = 0, 0.0, 0
        self._install(device, backend)

    def _install(self, device: torch.device, backend: str) -> None:
        register()
        for cfg in _configs(self.body):
            old = cfg._attn_implementation
            cfg._attn_implementation = PACKED_ATTENTION
            self._undo.append(lambda cfg=cfg, old=old: setattr(cfg, "_attn_implementation", old))
        use_fla = device.type == "cuda"
        for layer in decoder_layers(self.body):
            inner = getattr(layer, "linear_attn", None)
            if inner is not None:
                layer.linear_attn = PackedGatedDeltaNet(inner, self.segments, use_fla=use_fla)
                self._undo.append(
                    lambda layer=layer, inner=inner: setattr(layer, "linear_attn", inner)
                )
            if self.compiled:
                layer.forward = torch.compile(layer.forward, dynamic=False, backend=backend)
                self._undo.append(lambda layer=layer: vars(layer).pop("forward", None))

    def uninstall(self) -> None:
        """Give the model back as it was loaded."""
        while self._undo:
            self._undo.pop()()

    @property
    def flex(self) -> bool:
        return self.attention in ("flex", "flash")

    def describe(self) -> str:
        attention = {
            "flex": "flex_attention",
            "flash": "flex_attention through flash-attention 4",
            "sdpa": "sdpa per group of samples",
        }.get(self.attention, "sdpa, dense mask")
        layers = "compiled" if self.compiled else "eager"
        sizes = ", ".join(f"{n:,}" for n in self.sizes[1:])
        return (
            f"packed rows of {self.chunk_tokens:,} tokens ({sizes} for rows that fill no more; "
            f"{attention}, layers {layers})"
        )

    def batches(
        self, lengths: Sequence[int], *, batch_tokens: int, last: bool = False
    ) -> list[list[int]]:
        """Rows (longest first) grouped into packed rows; `batch_tokens` is in chunk_tokens.
        `last`: the rank's last part, whose last rows run at the smallest size (`taper_end`)."""
        chunks = pack_rows(lengths, chunk_tokens=self.chunk_tokens)
        if not last:
            return chunks
        return taper_end(chunks, lengths, chunk_tokens=self.chunk_tokens, small=self.sizes[-1])

    def inputs(
        self,
        rows: Sequence[np.ndarray],
        send: Callable[..., list[torch.Tensor]],
        *,
        size: int | None = None,
    ) -> tuple[dict, torch.Tensor]:
        """(forward keyword arguments, flat positions of the real tokens) for one packed row of
        `size` tokens (one of `sizes`; default the smallest that holds the rows); `send` moves
        int64 host tensors to the device."""
        size = size or fitting_size(self.sizes, sum(len(r) for r in rows))
        p = packed_inputs(rows, chunk_tokens=size, pad_id=self.pad_id)
        host = [torch.from_numpy(a.astype(np.int64)) for a in (p.ids, p.positions, p.doc_ids)]
        host.append(torch.from_numpy(p.cu_seqlens))
        groups = []
        if self.attention == "sdpa":
            lengths = [len(r) for r in rows]
            groups = sample_groups(lengths, p.cu_seqlens[:-1], budget=self.chunk_tokens)
            host += [torch.from_numpy(a) for g in groups for a in g]
        ids_N, pos_N, doc_N, cu, *on_device = send(*host)
        self.docs[size].copy_(doc_N)
        s = self.segments
        s.cu_seqlens, s.cu_seqlens_cpu, s.positions_N = cu, torch.from_numpy(p.cu_seqlens), pos_N
        s.lengths = np.diff(p.cu_seqlens).tolist()
        kwargs = {"input_ids": ids_N[None], "position_ids": pos_N[None], "use_cache": False}
        if self.attention == "sdpa":
            self.groups.groups = [tuple(on_device[i : i + 3]) for i in range(0, len(on_device), 3)]
            kwargs["sample_groups"], mask = self.groups, None
        elif self.flex:
            mask = document_block_mask(self.docs[size], self.mask_mods[size])
            if self.attention == "flash":
                kwargs["flash"] = True
        else:
            mask = dense_document_mask(self.docs[size])
        if self.types is not None:
            mask = {t: (mask if t == "full_attention" else None) for t in self.types}
        kwargs["attention_mask"] = mask
        index = torch.arange(p.real, device=ids_N.device)
        return kwargs, index
