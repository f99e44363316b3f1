"""A decoder layer's q/k/v and gate/up projections as one matmul each (extract.fused_linears):
the same states, one linear per group in the traced graph, no second copy of the weights, and the
model given back as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from extract.fused_linears import fuse_projections
from extract.target import decoder_layers

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(kind: str):  # noqa: ANN202
    import transformers as tf

    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    classes = {
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),  # q/k/v with biases
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }
    config, model = classes[kind]
    return model(config(**common)).eval()


def _states(model, ids):  # noqa: ANN001, ANN202
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_fused_layers_give_the_same_states_and_undo_gives_the_model_back(kind):
    model = _model(kind)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _states(model, ids)
    undo = [step for layer in decoder_layers(model.model) for step in fuse_projections(layer)]
    assert len(undo) == 4  # two groups in each of two layers
    for got, want in zip(_states(model, ids), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer in decoder_layers(model.model):  # nothing of a forward kept
        assert layer.mlp.gate_proj.fused.memo is None
        assert layer.self_attn.q_proj.fused.memo is None
    for step in reversed(undo):
        step()
    for got, want in zip(_states(model, ids), ref, strict=True):
        assert torch.equal(got, want)
    mlp = decoder_layers(model.model)[0].mlp
    assert all(type(getattr(mlp, n)) is torch.nn.Linear for n in ("gate_proj", "up_proj"))


def test_fused_in_inference_mode_the_model_comes_back_trainable_and_whole():
    """The layouts fuse inside inference mode; undone, every weight is a Parameter of its own
    again (its values, its requires_grad, its own storage) that trains and saves."""
    model = _model("qwen2")
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
    numel = sum(p.numel() for p in model.parameters())
    with torch.inference_mode():
        undo = [s for layer in decoder_layers(model.model) for s in fuse_projections(layer)]
        # one copy of the weights while fused: the fused ones replace the projections' own
        assert sum(p.numel() for p in model.parameters()) == numel
        assert model.model.layers[0].mlp.up_proj.weight.shape == (96, 64)
        assert model.model.layers[0].self_attn.v_proj.bias.shape == (32,)
    for step in undo:
        step()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, (value, grad) in before.items():
        assert torch.equal(after[name], value) and after[name].requires_grad == grad, name
        assert not after[name].is_inference(), name
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages)
    ids = torch.randint(0, 128, (1, 8))
    model(ids).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_projections_with_hooks_or_of_another_class_are_left_alone():
    model = _model("llama")
    first, second = decoder_layers(model.model)
    seen = []
    first.self_attn.k_proj.register_forward_hook(lambda *args: seen.append(1))
    second.mlp.up_proj = type("Lora", (torch.nn.Linear,), {})(64, 96, bias=False)
    undo = fuse_projections(first) + fuse_projections(second)
    assert len(undo) == 2  # first's MLP, second's attention
    assert type(first.self_attn.k_proj) is torch.nn.Linear
    assert type(second.mlp.gate_proj) is torch.nn.Linear
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8)))
    assert seen == [1]


def test_a_compiled_layer_traces_one_linear_per_group():
    model = _model("qwen3")
    layer = decoder_layers(model.model)[0]
    fuse_projections(layer)
    graphs = []

    def record(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        positions = torch.arange(16)[None]
        rope = model.model.rotary_emb(hidden, positions)
        layer.forward = torch.compile(layer.forward, backend=record, fullgraph=True)
        layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
    linears = [n for gm in graphs for n in gm.graph.nodes if n.target is F.linear]
    assert len(graphs) == 1 and len(linears) == 4  # q/k/v, o, gate/up, down
