"""Fused projections (`extract.fused`): q/k/v and gate/up as one matmul each give the states of
the separate ones, inside the compiled layers too, hold no second copy of the weights, and go
back to the separate matmuls on `undo`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from extract.fused import fuse_projections
from extract.target import decoder_layers, load_target
from tests.test_packed import ROWS, _packed, _per_row, targets  # noqa: F401


def _ids(n: int = 2, length: int = 40) -> torch.Tensor:
    return torch.randint(3, 300, (n, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
def test_fused_projections_give_the_same_states_and_undo_restores_them(targets, kind):  # noqa: F811
    model = load_target(str(targets[kind]), device=torch.device("cpu"), last_layer=3)
    body, ids = model.get_decoder(), _ids()
    with torch.inference_mode():
        ref = body(input_ids=ids).last_hidden_state
        undo = fuse_projections(body)
        fused = body(input_ids=ids).last_hidden_state
        undo()
        again = body(input_ids=ids).last_hidden_state
    torch.testing.assert_close(fused, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(again, ref)
    assert all("forward" not in vars(m) for m in body.modules())


def _linears_per_graph(body: nn.Module) -> list[int]:
    """The count of matmuls (linear nodes) in each graph dynamo makes of one decoder layer."""
    counts = []

    def backend(gm: torch.fx.GraphModule, example_inputs):  # noqa: ANN001, ANN202
        counts.append(sum(n.target is torch._C._nn.linear for n in gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    layer = decoder_layers(body)[0]
    layer.forward = torch.compile(layer.forward, dynamic=False, backend=backend)
    try:
        with torch.inference_mode():
            body(input_ids=_ids())
    finally:
        vars(layer).pop("forward")
    return counts


def test_a_compiled_layer_runs_each_group_as_one_matmul(targets):  # noqa: F811
    """Qwen3's layer: q, k, v, o, gate, up, down are 7 matmuls; fused, 4 (qkv, o, gate+up,
    down), and the later members' parts come from the first one's result within the graph."""
    model = load_target(str(targets["qwen3"]), device=torch.device("cpu"), last_layer=1)
    body = model.get_decoder()
    assert _linears_per_graph(body) == [7]
    undo = fuse_projections(body)
    assert _linears_per_graph(body) == [4]
    undo()


def test_the_weights_become_views_into_one_tensor_and_are_not_copied(targets):  # noqa: F811
    model = load_target(str(targets["qwen3"]), device=torch.device("cpu"), last_layer=1)
    attn = decoder_layers(model.get_decoder())[0].self_attn
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fuse_projections(model.get_decoder())
    q, k, v = (getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj"))
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert q.untyped_storage().nbytes() == (q.numel() + k.numel() + v.numel()) * q.element_size()
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_later_projection_given_another_input_multiplies_its_own_weight():
    """The fused result stands in only for the input the first projection was given: a later
    member called with another tensor (or before the first) computes its own matmul."""
    torch.manual_seed(0)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False)
    x, other = torch.randn(3, 8), torch.randn(3, 8)
    expect_up = mlp.up_proj(other)
    fuse_projections(mlp)
    assert torch.equal(mlp.up_proj(other), expect_up)  # before the first member ran
    gate = mlp.gate_proj(x)
    assert torch.equal(mlp.up_proj(other), expect_up)  # another input
    torch.testing.assert_close(gate, x @ mlp.gate_proj.weight.T)


def test_groups_that_differ_are_left_alone():
    """Members of different input widths or with biases on some only are not fused."""
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(8, 16), nn.Linear(8, 16, bias=False)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(8, 8), nn.Linear(4, 8), nn.Linear(8, 8)
    root = nn.Sequential(mlp, attn)
    fuse_projections(root)
    assert all("forward" not in vars(m) for m in root.modules())


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_packed_compiled_rows_with_fused_projections_equal_rows_alone(targets, kind):  # noqa: F811
    """The product's compiled packed layout fuses the projections (backend "eager": dynamo's
    graphs); the states equal each row alone in fp32, and uninstall gives the modules back."""
    cpu = torch.device("cpu")
    model = load_target(str(targets[kind]), device=cpu, last_layer=3)
    ref = _per_row(model, ROWS, [1, 3], cpu)
    got, layout = _packed(model, ROWS, [1, 3], cpu, compile_layers=True, backend="eager")
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert any("forward" in vars(m) for m in model.modules() if isinstance(m, nn.Linear))
    layout.uninstall()
    assert all("forward" not in vars(m) for m in model.modules())
