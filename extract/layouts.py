"""How rows reach the target: padded batches (the model as loaded, eager) or packed rows
(`extract.packed`: one static shape, compiled), and the choice between them.

Packed rows are used only where they are provably the same forward: `choose_layout` runs a few
probe rows both ways, each row alone through the model as loaded and all of them in one packed
row, and keeps packing only if every token's states agree (relative to the token's own norm)
within PROBE_TOLERANCE for the dtype; the probe runs twice with other rows, and a compiled graph
made by the second run is a recompilation, so the layers are then left uncompiled. Anything
else keeps padded batches, with a warning that says why.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from extract.batching import make_batches
from extract.masks import choose_masks, forward_kwargs
from extract.packed import PackedLayout, packed_support
from extract.packing import row_sizes

log = logging.getLogger(__name__)

# Largest relative difference per token (||packed - alone|| / ||alone||) the probe accepts: bf16
# forwards of different shapes differ by a few percent in deep layers (extract.verify's noise);
# a wrong mask, position or recurrent state differs by order one.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}
PROBE_LENGTHS = ((97, 64, 5, 1), (130, 33, 2))


def forward_mode(compile_mode: str, packing: str, device_type: str) -> tuple[bool, bool]:
    """(compile the layers, pack the rows) for `--compile` and `--packing` on a device type.

    >>> forward_mode("auto", "auto", "cuda"), forward_mode("auto", "auto", "cpu")
    ((True, True), (False, False))
    >>> forward_mode("none", "auto", "cuda"), forward_mode("auto", "on", "cpu")
    ((False, False), (False, True))
    """
    compiled = compile_mode == "layers" or (compile_mode == "auto" and device_type == "cuda")
    packed = packing == "on" or (packing == "auto" and compiled)
    return compiled, packed


class PaddedLayout:
    """Rows sorted longest first, cut into batches of at most `batch_tokens` padded tokens and
    right-padded: in a causal model a real token never sees the padding after it."""

    name = "padded"

    def __init__(self, body: nn.Module, *, pad_id: int, own_masks: bool = False):
        """`own_masks`: let the model build its masks (see `extract.masks`); verification does,
        so that it checks the premade ones rather than repeats them."""
        self.pad_id = pad_id
        self.masks = None if own_masks else choose_masks(body, pad_id=pad_id)

    def describe(self) -> str:
        return "padded batches (eager)"

    def batches(
        self, lengths: Sequence[int], *, batch_tokens: int, last: bool = False
    ) -> list[list[int]]:
        """`last` changes nothing here: eager batches take any shape, and their order is the
        one `extract.verify` and the padded path's tests read."""
        return [list(b) for b in make_batches(lengths, batch_tokens=batch_tokens)]

    def inputs(
        self, rows: Sequence[np.ndarray], send: Callable[..., list[torch.Tensor]]
    ) -> tuple[dict, torch.Tensor]:
        ids_BL, index = padded_inputs(rows, pad_id=self.pad_id)
        ids_BL, index = send(torch.from_numpy(ids_BL), torch.from_numpy(index))
        return forward_kwargs(ids_BL, self.masks), index


def padded_inputs(rows: Sequence[np.ndarray], *, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [B, L] right-padded with `pad_id`, flat positions of the real tokens in it).

    Built with numpy, which keeps the GIL: each torch call would release it and wait to get it
    back from the writer threads, on the thread that feeds the GPU.

    >>> ids, index = padded_inputs([np.array([5, 6, 7]), np.array([8])], pad_id=0)
    >>> ids.tolist(), index.tolist()
    ([[5, 6, 7], [8, 0, 0]], [0, 1, 2, 3])
    """
    lengths = [len(r) for r in rows]
    width = max(lengths)
    ids_BL = np.full((len(rows), width), pad_id, dtype=np.int64)
    for b, r in enumerate(rows):
        ids_BL[b, : len(r)] = r
    index = np.concatenate([np.arange(n) + b * width for b, n in enumerate(lengths)])
    return ids_BL, index


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _without_grad(choose: Callable[..., PaddedLayout | PackedLayout]) -> Callable:
    """Run `choose` under inference_mode, or no_grad for a sharded target (expert parallel
    dispatch fails under inference_mode)."""

    @functools.wraps(choose)
    def run(*args: object, sharded: Sharded | None = None, **kwargs: object):  # noqa: ANN202
        with torch.no_grad() if sharded else torch.inference_mode():
            return choose(*args, sharded=sharded, **kwargs)

    return run


@_without_grad
def choose_layout(
    body: nn.Module,
    *,
    packed: bool,
    compile_layers: bool,
    chunk_tokens: int,
    pad_id: int,
    backend: str = "inductor",
    attention: str | None = None,
    sharded: Sharded | None = None,
) -> PaddedLayout | PackedLayout:
    """The layout to run `body` with: packed (compiled or not) where asked for and proven by the
    probe, else padded. `sharded`: a target sharded over the process group, whose ranks probe
    together and agree on the outcome (padded batches then use the model's own masks)."""
    padded = functools.partial(PaddedLayout, body, pad_id=pad_id, own_masks=sharded is not None)
    if not packed:
        return padded()
    device = next(body.parameters()).device
    why = packed_support(body, device)
    if why is not None:
        log.warning("packed rows are not possible for this target (%s): padded batches", why)
        return padded()
    states = functools.partial(sharded.states, body) if sharded else _body_states(body)
    agree = sharded.agree if sharded else lambda values: values
    smallest = row_sizes(chunk_tokens)[-1]
    probes = [_probe_rows(n, body, seed, smallest) for seed, n in enumerate(PROBE_LENGTHS)]
    # each row alone through the model as loaded, before the layout changes it
    alone = [[_alone(states, row, device) for row in rows] for rows in probes]
    layout = PackedLayout(
        body,
        chunk_tokens=chunk_tokens,
        pad_id=pad_id,
        device=device,
        compile_layers=compile_layers,
        backend=backend,
        attention=attention,
    )
    failed, error, first, graphs, again = _probe(layout, probes, alone, states, agree)
    tolerance = PROBE_TOLERANCE.get(next(body.parameters()).dtype, 0.25)
    if failed is not None or not error <= tolerance:
        layout.uninstall()
        if failed is not None:
            log.warning("packed rows failed on this target (%s): padded batches", failed)
        else:
            log.warning(
                "packed rows changed a probe forward by %.2e per token (allowed %.1e): padded "
                "batches",
                error,
                tolerance,
            )
        return padded()
    if again:
        layout.uninstall()
        log.warning(
            "the compiled layers recompiled for other rows (%d graphs): not compiled", again
        )
        return choose_layout(
            body,
            packed=True,
            compile_layers=False,
            chunk_tokens=chunk_tokens,
            pad_id=pad_id,
            backend=backend,
            attention=attention,
            sharded=sharded,
        )
    compiled = f"; {graphs} compiled graphs in {first:.1f} s" if compile_layers else ""
    log.info(
        "%s: probe rows within %.1e per token of each row alone%s",
        layout.describe(),
        error,
        compiled,
    )
    layout.graphs, layout.compile_s = graphs, first
    layout.graphs_after_probe = compiled_graphs()
    return layout


def _body_states(body: nn.Module) -> Callable[..., torch.Tensor]:
    return lambda **kwargs: body(**kwargs).last_hidden_state


class Sharded:
    """How the probe reaches a target sharded over the process group: its forward runs from the
    root module (`model`: FSDP gathers each layer only there) under no_grad (expert parallel
    dispatch fails under inference_mode), and the ranks take the largest of each figure
    (`agree`), so that all of them choose the same layout and run the same forwards. A probe
    that fails on every rank alike (a forward the packed layout cannot drive, a compilation
    error) falls back everywhere; one that fails on some ranks only, inside a forward's
    collectives, leaves the others waiting in that collective until the process group's
    timeout."""

    def __init__(self, model: nn.Module, agree: Callable[[list[float]], list[float]]):
        self.model, self.agree = model, agree

    def states(self, body: nn.Module, **kwargs: object) -> torch.Tensor:
        """The last hidden state of `body` (the model's decoder) in one forward of the whole
        model on `kwargs`."""
        got: list[torch.Tensor] = []
        hook = body.register_forward_hook(lambda m, a, out: got.append(out[0]))
        try:
            self.model(**kwargs, logits_to_keep=1)
        finally:
            hook.remove()
        return got[0]


def _probe(
    layout: PackedLayout,
    probes: list[list[np.ndarray]],
    alone: list[list[torch.Tensor]],
    states: Callable[..., torch.Tensor],
    agree: Callable[[list[float]], list[float]],
) -> tuple[str | None, float, float, int, int]:
    """The probe rows through `layout` at every row size against each row `alone`: (why it
    failed or None, the largest error, seconds and graphs of the first probe, graphs made by
    the second), the error and the graphs agreed by the ranks (a failure or NaN anywhere is an
    infinite error everywhere)."""
    sizes = layout.sizes  # the probe runs each size: every graph made before it ends
    failed, first, graphs = None, 0.0, 0
    try:
        start, before = time.perf_counter(), compiled_graphs()
        errors = [_packed_error(states, layout, probes[0], alone[0], n) for n in sizes]
        first, graphs = time.perf_counter() - start, compiled_graphs() - before
        errors += [_packed_error(states, layout, probes[1], alone[1], n) for n in sizes]
        again = compiled_graphs() - before - graphs
    except Exception as e:  # a model whose forward the packed layout cannot drive
        failed, errors, again = f"{type(e).__name__}: {e}", [math.inf], 0
    worst = math.inf if any(math.isnan(e) for e in errors) else max(errors)
    error, again = agree([worst, again])
    if failed is None and math.isinf(error):
        failed = "on another rank" if math.isfinite(worst) else "a probe forward gave NaN"
    return failed, error, first, graphs, int(again)


def _probe_rows(
    lengths: Sequence[int], body: nn.Module, seed: int, chunk_tokens: int
) -> list[np.ndarray]:
    """Random rows of `lengths`, shortened in proportion where they would not fit one chunk."""
    vocab = int(getattr(body.config, "vocab_size", 1000) or 1000)
    scale = min(1.0, chunk_tokens / sum(lengths))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab, 1000), max(1, int(n * scale))) for n in lengths]


def _alone(
    states: Callable[..., torch.Tensor], row: np.ndarray, device: torch.device
) -> torch.Tensor:
    return states(input_ids=torch.from_numpy(row)[None].to(device), use_cache=False)[0].float()


def _packed_error(
    states: Callable[..., torch.Tensor],
    layout: PackedLayout,
    rows: list[np.ndarray],
    alone: list[torch.Tensor],
    size: int,
) -> float:
    """The largest per-token relative difference between the packed row of `size` tokens and
    each row alone (`states(**kwargs)`: the decoder's last hidden state)."""

    device = layout.docs[size].device

    def send(*tensors: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(device) for t in tensors]

    kwargs, index = layout.inputs(rows, send, size=size)
    packed = states(**kwargs)[0, : index.numel()].float()
    ref = torch.cat(alone)
    per_token = (packed - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)
    return float(per_token.max())
