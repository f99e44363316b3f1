"""`python -m train --drafter-type dflash2` on CPU: its first step equals DFlash's, selected-token
metrics in metrics.jsonl and eval, a warm start from a DFlash run, and an export the reference
package loads."""

import json
import math

import pytest
import torch

from tests.cachegen import write_cache
from tests.test_train_loop import records, tiny
from train.checkpoint import list_checkpoints, load_drafter
from train.export import export_keys
from train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")

DFLASH2 = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=16)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=6)


def test_first_step_equals_dflash_then_selector_metrics(cache, tmp_path):
    # Same seed, data and anchors; alpha 0 on the first steps (warm-up), so the loss is CE_base.
    common = dict(epochs=1, eval_parts=1, eval_every=0, layer_types="full", is_causal="false")
    run(tiny(cache, tmp_path / "dflash", **common))
    # 64 of the 320 rows as candidates: the data token is among them often from the start.
    options = {**DFLASH2, "selector_top_k": 64}
    run(tiny(cache, tmp_path / "dflash2", selector_warmup=0.5, **options, **common))
    base, ours = records(tmp_path / "dflash"), records(tmp_path / "dflash2")
    assert math.isclose(ours[0]["loss"], base[0]["loss"], rel_tol=1e-5)
    assert math.isclose(ours[0]["ce_base"], base[0]["loss"], rel_tol=1e-5)
    assert ours[0]["selected_tau"] == ours[0]["tau"] == base[0]["tau"]
    for key in ("selected_acc", "selector_ce", "selector_coverage"):
        assert key in ours[-1] and key not in base[-1]
    assert len(ours[-1]["selected_acc"]) == 3
    last = ours[-1]  # past the warm-up the loss holds the selector term
    assert last["loss"] > last["ce_base"] and 0 < last["selector_coverage"] <= 1
    evals = records(tmp_path / "dflash2", "eval")
    assert evals and "selected_tau" in evals[-1] and evals[-1]["selected_tau"] >= 1.0
    saved = json.loads((tmp_path / "dflash2" / "config.json").read_text())["train"]
    assert saved["drafter_type"] == "dflash2" and saved["is_causal"] == "false"


def test_published_defaults_warm_start_and_export(cache, tmp_path):
    run(tiny(cache, tmp_path / "dflash", epochs=1, layer_types="sliding", sliding_window=2048))
    source = list_checkpoints(tmp_path / "dflash")[-1][1]
    out = tmp_path / "dflash2"
    export = run(tiny(cache, out, epochs=1, init_from=source, selector_stop_grad=True, **DFLASH2))
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["layer_types"], saved["sliding_window"]) == ("sliding_attention", 2048)
    assert saved["is_causal"] == "false"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    drafter, cfg = load_drafter(list_checkpoints(out)[-1][1])
    assert set(drafter.state_dict()) == set(export_keys(cfg))
    # The warm start's DFlash weights were the starting point: they moved, but not far.
    start, _ = load_drafter(source)
    moved = (drafter.fc.weight - start.fc.weight).abs().max().detach()
    assert 0 < float(moved) < 0.5
    dflash_model = pytest.importorskip("dflash.model")
    ref = dflash_model.DFlash2DraftModel.from_pretrained(export, dtype=torch.float32)
    assert ref.layers[0].attention_conv is not None and ref.candidate_selector.top_k == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_compiled_dflash2_run_trains_and_exports(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=8, lengths=(40, 700))
    out = tmp_path / "run"
    export = run(tiny(cache, out, gpus="0", epochs=3, workers=2, batch_tokens=1024, **DFLASH2))
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["attention"], saved["compile"], saved["ce"]) == ("flex", "model", "fused")
    train = records(out)
    first = sum(r["loss"] for r in train[:3]) / 3
    last = sum(r["loss"] for r in train[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert all(r["selected_tau"] >= 1.0 for r in train)
    # One packed-row shape: the convolved drafter compiles at step 1 only.
    assert train[-1]["compiled_graphs"] == train[0]["compiled_graphs"] > 0
    assert json.loads((export / "config.json").read_text())["architectures"] == [
        "DFlash2DraftModel"
    ]
