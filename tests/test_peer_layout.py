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
from peer_layout import prenorm_equivalent, spec_layer_ids, train_ratio, write_layout, zlab_config  # noqa: E402

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
