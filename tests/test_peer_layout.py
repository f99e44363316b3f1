"""bench/peer_layout.py: our cache in speculators 0.9.0's offline layout, read back by
speculators' own dataset class (shapes, layer offset, token ids, loss mask, the last slot).

The cache is tests.cachegen's (4 target layers, layers 0, 1 and 3 cached: 3 is the last), with a
final-norm weight made here. The last slot holds y / w; speculators' verifier norm of it gives
back y where y is a norm output, as the real cache's last layer is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("datasets", reason="the layout is a datasets.save_to_disk folder")
spec_data = pytest.importorskip(
    "speculators.train.data", reason="speculators (0.9.0, installed --no-deps) reads the layout"
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from peer_layout import (  # noqa: E402
    prenorm_equivalent,
    spec_layer_ids,
    train_ratio,
    write_layout,
    write_zlab_export,
    zlab_config,
)

from shared.cache import open_part  # noqa: E402
from shared.manifest import read_manifest  # noqa: E402
from tests.cachegen import HIDDEN, NUM_TARGET_LAYERS, write_cache  # noqa: E402

TAPS = [0, 1]


def _our_samples(cache: Path) -> list:
    return [s for r in read_manifest(cache).parts for s in open_part(cache / r.name)]


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, torch.Tensor, dict]:
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=3, lengths=(20, 40))
    norm = 0.5 + torch.rand(HIDDEN, generator=torch.Generator().manual_seed(0))
    info = write_layout(cache, tmp_path / "layout", taps=TAPS, norm_weight=norm, held=[1, 4])
    return cache, tmp_path / "layout", norm, info


def test_layout_reads_back_through_speculators(layout) -> None:
    cache, out, norm, info = layout
    ours = _our_samples(cache)
    assert info["samples"] == 6 and info["aux_hidden_state_layer_ids"] == [1, 2]
    assert info["last_layer"] == NUM_TARGET_LAYERS - 1
    order = [0, 2, 3, 5, 1, 4]  # held-out stored positions last
    assert info["sample_index_order"] == [ours[p].sample_index for p in order]
    # speculators' own reader, the trained split first: int(6 * ratio) = 4 rows
    ratio = train_ratio(6, 2)
    kw = dict(train_ratio=ratio, hidden_states_dtype=torch.float32, on_missing="raise")
    train = spec_data.ArrowDataset(512, out, split="train", **kw)
    val = spec_data.ArrowDataset(512, out, split="val", **kw)
    assert (len(train), len(val)) == (4, 2)
    rows = [train[i] for i in range(4)] + [val[i] for i in range(2)]
    for row, pos in zip(rows, order, strict=True):
        s = ours[pos]
        hidden = s.hidden_tensor().float()  # [S, 3, H]: layers 0, 1, 3 (the last, after norm)
        S = len(s.input_ids)
        assert row["input_ids"].dtype == torch.int64
        assert row["input_ids"].tolist() == s.input_ids.tolist()
        assert row["loss_mask"].tolist() == s.loss_mask.tolist()
        assert row["hidden_states"].shape == (S, len(TAPS) * HIDDEN)  # the taps, flattened
        assert torch.equal(row["hidden_states"].view(S, 2, HIDDEN), hidden[:, :2])
        last = row["verifier_last_hidden_states"]
        assert last.shape == (S, HIDDEN)
        torch.testing.assert_close(last, hidden[:, 2] / norm, rtol=0, atol=0)


def test_the_last_slot_normed_by_the_verifier_norm_is_the_cached_state() -> None:
    """The cache's last layer is an RMSNorm output y (tests.cachegen's is random, hence this
    check on a real norm output): the verifier norm speculators applies to the last slot, with
    the target's weight, gives y back from y / w."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(1)
    w, x = 0.5 + torch.rand(HIDDEN, generator=g), 30 * torch.randn(5, HIDDEN, generator=g)
    norm = LlamaRMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(w)
        y = norm(x)  # what our cache holds for the last layer
        torch.testing.assert_close(norm(prenorm_equivalent(y, w)), y, rtol=2e-5, atol=1e-5)


def test_layout_refuses_a_cache_without_the_last_layer(tmp_path: Path) -> None:
    cache = write_cache(tmp_path / "cache", num_parts=1, layer_ids=(0, 1, 2))
    with pytest.raises(ValueError, match=r"layers \[3\] are not cached"):
        write_layout(cache, tmp_path / "out", taps=[0, 1], norm_weight=torch.ones(HIDDEN))


def test_zlab_config_puts_the_layer_ids_back() -> None:
    layer = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": HIDDEN,
             "layer_types": ["sliding_attention"] * 2, "sliding_window": 2048,
             "_attn_implementation": "sdpa"}  # fmt: skip
    spec = {"transformer_layer_config": layer, "aux_hidden_state_layer_ids": spec_layer_ids(TAPS),
            "block_size": 16, "mask_token_id": 7, "sliding_window_non_causal": False}  # fmt: skip
    out = zlab_config(spec, num_target_layers=NUM_TARGET_LAYERS)
    assert out["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": TAPS}
    assert out["architectures"] == ["DFlashDraftModel"] and "_attn_implementation" not in out
    assert out["is_causal"] is True  # speculators' sliding layers: causal inside the block
    assert json.loads(json.dumps(out)) == out


@pytest.mark.parametrize(
    ("layer_types", "window"),
    [
        (["full_attention"] * 2, None),
        (["sliding_attention"] * 2, 2048),
        pytest.param(
            ["sliding_attention"] * 2,
            5,
            marks=pytest.mark.xfail(
                strict=True,
                reason=(
                    "a window shorter than the context: speculators' training mask keeps the W "
                    "context positions before the anchor for every slot of the block, z-lab's "
                    "DFlash and our drafter window each query (q - k < W); the bench's contexts "
                    "(under 2048 tokens) are never cut by speculators' default window of 2048"
                ),
            ),
        ),  # fmt: skip
    ],
)
def test_speculators_checkpoint_as_zlab_export_gives_its_blocks(tmp_path, layer_types, window):
    """speculators' DFlashDraftModel saved as its trainer saves it, converted by the config
    rewrite alone, loads into our drafter (`train.export_load.load_export`, which checks every
    tensor name and shape) and gives speculators' block outputs on one anchor: with full
    attention (our shape) and with its default sliding, causal-inside-the-block layers (window
    2048)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    from tests.drafters import drafter_masks
    from train.export_load import load_export

    V, block, taps = 300, 4, [0, 1, 3]
    layer = Qwen3Config(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_hidden_layers=2, vocab_size=V,
        rms_norm_eps=1e-6, max_position_embeddings=256, layer_types=layer_types,
        sliding_window=window, use_sliding_window=window is not None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    )  # fmt: skip
    layer._attn_implementation = "sdpa"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=V, block_size=block,
        aux_hidden_state_layer_ids=spec_layer_ids(taps), mask_token_id=V - 1,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDraftModel(config).eval()
    with torch.no_grad():  # norms away from one; bf16-exact weights, as the checkpoint holds
        model.embed_tokens.weight.normal_()  # left unset without a verifier to load it from
        for name, p in model.named_parameters():
            p.copy_((p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p).bfloat16())
    model.save_pretrained(str(tmp_path / "ckpt"))
    export = write_zlab_export(tmp_path / "ckpt", tmp_path / "export", num_target_layers=4)
    ours, cfg = load_export(export)
    assert cfg.target_layer_ids == tuple(taps) and cfg.layer_types == tuple(layer_types)
    anchor, H = 12, HIDDEN
    T = anchor + block + 1  # speculators' anchors avoid the last block of the row
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V - 1, (1, T), generator=g)
    hidden = torch.randn(1, T, len(taps) * H, generator=g)
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[0, anchor] = 1  # the only candidate: the anchor is fixed
    with torch.no_grad():
        want, *_ = model._backbone_forward(
            hidden, ids, mask, torch.randn(1, T, H, generator=g),
            torch.zeros(1, T, dtype=torch.long), max_anchors=1,
        )  # fmt: skip
        noise = torch.full((1, block), V - 1)
        noise[0, 0] = ids[0, anchor]
        anchors, keep = torch.tensor([[anchor]]), torch.tensor([[True]])
        pos = torch.arange(T)[None]
        got = ours.eval()(
            hidden[:, :anchor], model.embed_tokens.weight[noise], pos[:, :anchor],
            pos[:, anchor : anchor + block], drafter_masks(cfg, anchors, keep, anchor),
        )  # fmt: skip
    torch.testing.assert_close(got.view(block, H), want.view(block, H), atol=1e-5, rtol=1e-5)
