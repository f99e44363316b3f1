"""Capture hidden states of chosen target layers with forward hooks.

Layer id i is the output of decoder layer i (0-based), i.e. Hugging Face
`outputs.hidden_states[i + 1]`; for the last layer (i = T - 1) that entry is taken after the
final norm, and so is ours (the hook sits on the norm): z-lab's reference feeds the drafter
exactly `hidden_states[T]`. Rows reach the target padded or packed (`extract.layouts`); either
way each token's states are those of its row run alone, and only real tokens are gathered:
padding never leaves the GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from extract.layouts import PaddedLayout
from extract.packed import PackedLayout
from extract.target import decoder_layers, final_norm, num_decoder_layers

# Pinned input buffers in rotation: a buffer is refilled only after the copy issued from it
# `INPUT_SLOTS` batches earlier has landed (an event wait that, in steady state, never blocks).
INPUT_SLOTS = 4
# Off only to measure what the pinned copies change (`bench/extract_bench.py --inputs pageable`).
PINNED_INPUTS = True


class DeviceInputs:
    """Host int64 tensors to the device without stopping the host thread.

    A copy from pageable memory may make the CUDA driver wait until the stream has run
    everything queued before it (it stages the data through its own pinned buffer), so the
    thread launching the forward passes could not queue a batch before the previous one ran.
    Copies from a rotation of pinned buffers are asynchronous. Measured on an H200 (Qwen3-8B
    shape, 1.2M tokens, `bench/extract_bench.py --inputs pinned|pageable`), extraction ran at
    0.946 and 0.952 of the forward: no difference beyond run-to-run noise there; the copies stay
    asynchronous wherever the driver would wait. Off CUDA: plain copies.
    """

    def __init__(self, device: torch.device, *, slots: int = INPUT_SLOTS):
        self.device, self.pinned = device, device.type == "cuda" and PINNED_INPUTS
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._count, self._next = slots, 0

    def send(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The int64 `tensors` on the device (one copy for all), safe to use on its stream."""
        if not self.pinned:
            return [t.to(self.device, non_blocking=True) for t in tensors]
        sizes = [t.numel() for t in tensors]
        i, buf = self._slot(sum(sizes))
        host = torch.cat([t.reshape(-1) for t in tensors], out=buf[: sum(sizes)])
        on_device = host.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._slots[i] = (buf, event)
        return [part.view(t.shape) for part, t in zip(on_device.split(sizes), tensors, strict=True)]

    def _slot(self, numel: int) -> tuple[int, torch.Tensor]:
        """The next buffer in rotation with room for `numel`, once its last copy has landed."""
        i = self._next
        self._next = (i + 1) % self._count
        if i == len(self._slots):
            self._slots.append((torch.empty(0, dtype=torch.long), None))
        buf, event = self._slots[i]
        if event is not None:
            event.synchronize()
        if buf.numel() < numel:  # a pinned allocation only when a batch outgrows the slot
            buf = torch.empty(max(numel, 2 * buf.numel()), dtype=torch.long, pin_memory=True)
        return i, buf


class LayerCapture:
    """Hooks on `layer_ids` that write real-token states into one packed tensor.

    The memory is layer-major, [K, N, H], and `run` returns its [N, K, H] view: one layer's
    rows are contiguous, so the writers compress them without a copy on the host (a numpy
    strided copy holds the GIL, and the thread that launches the forward pass waits for it).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        *,
        pad_id: int = 0,
        own_masks: bool = False,
        layout: Callable[[nn.Module], PaddedLayout | PackedLayout] | None = None,
        sharded: bool = False,
    ):
        """`layout(body)` makes the layout rows reach the target in (see `extract.layouts`;
        default: padded batches with `own_masks` as PaddedLayout takes it). `sharded`: a model
        that transformers sharded over the process group (`extract.parallel`): the whole causal
        LM called (FSDP runs only from its root module; the lm_head on one position per row),
        under no_grad (expert parallel dispatch fails under inference_mode); by default in
        padded batches with the model's own masks."""
        self.model, self.layer_ids, self.pad_id = model, list(layer_ids), pad_id
        self.body = model.get_decoder() if hasattr(model, "get_decoder") else model
        self._forward = functools.partial(model, logits_to_keep=1) if sharded else self.body
        self._grad_off = torch.no_grad if sharded else torch.inference_mode
        # Chosen before the hooks exist: the choice runs probe forwards.
        if layout is None:
            self.layout = PaddedLayout(self.body, pad_id=pad_id, own_masks=own_masks or sharded)
        else:
            self.layout = layout(self.body)
        layers, last = decoder_layers(model), num_decoder_layers(model) - 1
        self._packed: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._inputs: DeviceInputs | None = None
        self._handles = [
            (final_norm(model) if layer_id == last else layers[layer_id]).register_forward_hook(
                self._hook(slot)
            )
            for slot, layer_id in enumerate(self.layer_ids)
        ]

    def _hook(self, slot: int):
        def hook(module: nn.Module, args: tuple, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            flat = hidden.reshape(-1, hidden.shape[-1])
            if self._packed is None:
                shape = (len(self.layer_ids), self._index.numel(), flat.shape[-1])
                self._packed = torch.empty(shape, dtype=flat.dtype, device=flat.device)
            torch.index_select(flat, 0, self._index, out=self._packed[slot])

        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def run(self, rows: Sequence[np.ndarray], *, device: torch.device) -> torch.Tensor:
        """States of `rows` (token id arrays) as [sum(len), K, H] on `device`, rows one after
        another, in the model's dtype: a view of layer-major memory (`.transpose(0, 1)` gives
        the contiguous [K, sum(len), H])."""
        if self._inputs is None or self._inputs.device != device:
            self._inputs = DeviceInputs(device)
        with self._grad_off():
            kwargs, self._index = self.layout.inputs(rows, self._inputs.send)
            try:
                self._forward(**kwargs)
                return self._packed.transpose(0, 1)
            finally:
                self._packed, self._index = None, None
