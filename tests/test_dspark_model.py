"""The DSpark drafter: its init (the DFlash backbone of the same seed, a zero Markov bias), the
left-to-right Markov walk, a packed row equal to its samples one by one, its config's limits, and
the exporter's checks of DeepSpec's dense format."""

import json

import pytest
import torch

from tests.drafters import tiny_drafter_config
from tests.test_packing import _alone, _packed, _samples, _split
from train.drafters.anchors import sample_anchors
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.drafters.dspark import DSparkDrafter, init_dspark_weights
from train.drafters.dspark_loss import DSparkLoss
from train.export import check_tensors, export_bytes, export_drafter, export_keys
from train.export_load import load_export
from train.step import anchored_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def dspark(seed=0, **kwargs):
    cfg = tiny_drafter_config(drafter_type="dspark", markov_rank=8, **kwargs)
    drafter = DSparkDrafter(cfg)
    init_dspark_weights(drafter, seed)
    return drafter


def test_init_is_the_dflash_backbone_with_a_zero_markov_bias():
    drafter = dspark()
    base = DFlashDrafter(tiny_drafter_config())
    init_drafter_weights(base, 0)
    for name, tensor in base.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name
    prev = torch.tensor([3, 7, 250])
    with torch.no_grad():
        assert float(drafter.markov_bias(drafter.prev_embeddings(prev)).abs().max()) == 0
        assert float(drafter.prev_embeddings(prev).abs().max()) > 0  # the confidence reads W1


def test_walk_drafts_left_to_right_from_the_anchor():
    drafter = dspark()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 2.0, generator=torch.Generator())
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 64, generator=gen)
    lm_head = torch.randn(300, 64, generator=gen) * 0.1
    first = torch.tensor([5, 9])
    out = drafter.walk(hidden, lm_head, first)
    prev = first
    for k in range(4):
        emb = drafter.prev_embeddings(prev)
        logits = hidden[:, k] @ lm_head.T + drafter.markov_bias(emb)
        torch.testing.assert_close(out.logits_NQV[:, k], logits)
        assert out.tokens_NQ[:, k].tolist() == logits.argmax(-1).tolist()
        torch.testing.assert_close(out.confidence_NQ[:, k], drafter.confidence(hidden[:, k], emb))
        prev = out.tokens_NQ[:, k]
    # The bias depends on the previous draft: another anchor changes the first slot's logits.
    other = drafter.walk(hidden, lm_head, torch.tensor([6, 9]))
    assert not torch.equal(other.logits_NQV[0, 0], out.logits_NQV[0, 0])
    sampled = [
        drafter.walk(
            hidden, lm_head, first, temperature=1.0, generator=torch.Generator().manual_seed(4)
        ).tokens_NQ
        for _ in range(2)
    ]
    assert torch.equal(sampled[0], sampled[1])


@pytest.mark.parametrize("ce", ["autograd", "fused"])
def test_packed_row_equals_its_samples_one_by_one(ce):
    # three cached layers: the two taps, then the target's last (read as its distribution)
    drafter = dspark(target_layer_ids=(1, 4)).train()
    cfg = drafter.cfg
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator())
    gen = torch.Generator().manual_seed(9)
    embed, lm_head = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen) / 8
    lengths = [13, 21, 9]
    samples = _samples(lengths)
    packed = _packed(samples, row=48)
    anchors, keep = sample_anchors(
        packed.loss_mask_BS, packed.doc_ids_BS, num_anchors=40, generator=gen
    )

    def run(batch, a, k):
        drafter.zero_grad()
        out = anchored_loss(
            drafter, embed, lm_head, batch, a, k, block_size=cfg.block_size, gamma=4.0,
            mask_token_id=cfg.mask_token_id, attention="sdpa", ce=ce, ce_chunk_blocks=3,
            dspark=DSparkLoss(),
        )  # fmt: skip
        out.weighted_sum.backward()
        return out, {n: p.grad.clone() for n, p in drafter.named_parameters()}

    got, got_grads = run(packed, anchors, keep)
    total, weight, prob = 0.0, 0.0, 0.0
    grads = {n: torch.zeros_like(g) for n, g in got_grads.items()}
    for sample, (a, k) in zip(samples, _split(anchors, keep, lengths), strict=True):
        out, g = run(_alone(sample), a, k)
        total += out.weighted_sum.item()
        weight += float(out.weight_total)
        prob += float(out.stats["accepted_prob_sum"])
        for n in grads:
            grads[n] += g[n]
    assert got.weighted_sum.item() == pytest.approx(total, rel=1e-5)
    assert float(got.weight_total) == pytest.approx(weight, rel=1e-6)
    assert float(got.stats["accepted_prob_sum"]) == pytest.approx(prob, rel=1e-5)
    for n, g in got_grads.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_config_limits():
    with pytest.raises(ValueError, match="all full_attention"):
        tiny_drafter_config(drafter_type="dspark", layer_types=("sliding_attention",) * 2,
                            sliding_window=8)  # fmt: skip
    with pytest.raises(ValueError, match="needs a Markov head"):
        tiny_drafter_config(drafter_type="dspark", markov_rank=0)
    plain = tiny_drafter_config(drafter_type="dspark", markov_rank=0, enable_confidence_head=False)
    drafter = DSparkDrafter(plain)
    assert drafter.markov_head is None and drafter.confidence_head is None
    assert plain.anchor_predicts and not tiny_drafter_config().anchor_predicts


def test_export_checks_the_dense_format_and_round_trips(tmp_path):
    drafter = dspark()
    cfg = drafter.cfg
    gen = torch.Generator().manual_seed(0)
    heads = (torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen))
    with pytest.raises(ValueError, match="embedding and lm_head"):
        export_drafter(drafter, cfg, tmp_path / "no-heads")
    state = {**drafter.state_dict(), "embed_tokens.weight": heads[0], "lm_head.weight": heads[1]}
    del state["markov_head.markov_w2.weight"]
    with pytest.raises(ValueError, match="markov_w2"):
        check_tensors(state, cfg)
    out = export_drafter(drafter, cfg, tmp_path / "export", heads=heads)
    written = (out / "model.safetensors").stat().st_size  # the heads' 2 x 300 x 64 bf16 with them
    assert 0 < written - export_bytes(drafter, cfg, heads) < 1 << 16  # the header's bytes
    config = json.loads((out / "config.json").read_text())
    for key, value in {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "num_hidden_layers": 2,
        "num_target_layers": 8, "block_size": 4, "target_layer_ids": [1, 4, 6],
        "mask_token_id": 299, "layer_types": ["full_attention"] * 2,
        "tie_word_embeddings": False, "num_anchors": 512, "markov_rank": 8,
        "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True,
    }.items():  # fmt: skip
        assert config[key] == value, key
    loaded, loaded_cfg = load_export(out)
    assert loaded_cfg == cfg and isinstance(loaded, DSparkDrafter)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.bfloat16().float())
    assert len(export_keys(cfg)) == 3 + 2 * 11 + 6
    # A missing confidence_head_with_markov reads as false, as vLLM reads it.
    del config["confidence_head_with_markov"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="confidence_head"):
        load_export(out)  # the weights hold H + r inputs, a false flag means H
