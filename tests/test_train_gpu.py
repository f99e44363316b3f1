"""Stage two on CUDA: flex attention, the compiled drafter, bf16 autocast, fp8 dequantised on
the device, pinned-memory prefetch from worker processes. Skipped without CUDA."""

import json

import pytest
import torch

from tests.cachegen import write_cache
from tests.test_train_loop import records, tiny
from train.run import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("store", ["bf16", "fp8"])
def test_flex_compiled_run_trains_and_exports(tmp_path, store):
    # lengths up to 700 give several padded lengths (128 .. 768) and batch sizes: the compiled
    # drafter must absorb them within the recompile limit.
    cache = write_cache(
        tmp_path / "cache", num_parts=4, samples_per_part=8, lengths=(40, 700), store=store
    )
    out = tmp_path / "run"
    export = run(tiny(cache, out, gpus="0", epochs=3, workers=2, batch_tokens=1024))
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["attention"], saved["compile"]) == ("flex", "model")
    train = records(out)
    first = sum(r["loss"] for r in train[:3]) / 3
    last = sum(r["loss"] for r in train[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert (export / "model.safetensors").is_file()


@pytest.mark.parametrize("grad_ckpt", ["loss", "layers"])
def test_default_compiled_training_on_varied_lengths_compiles_once(tmp_path, grad_ckpt):
    """Lengths from 1 to max_length through the default setting (flex, --compile model, fused
    CE): every step one packed row of the same shape, so nothing compiles after step 1."""
    cache = write_cache(
        tmp_path / "cache", num_parts=3, samples_per_part=40, lengths=(1, 512), max_length=512
    )
    out = tmp_path / "run"
    cfg = tiny(cache, out, gpus="0", steps=32, workers=2, batch_tokens=512, grad_ckpt=grad_ckpt)
    run(cfg.replace(num_anchors=None, block_size=16, drafter_layers=2))
    saved = json.loads((out / "config.json").read_text())["train"]
    assert (saved["attention"], saved["compile"], saved["ce"]) == ("flex", "model", "fused")
    train = records(out)
    assert [r["step"] for r in train][-1] == 32
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    first, last = train[0], train[-1]
    assert first["step"] == 1 and first["compiled_graphs"] > 0
    assert last["compiled_graphs"] == first["compiled_graphs"], [
        r["compiled_graphs"] for r in train
    ]


def test_flex_and_sdpa_runs_agree(tmp_path):
    """Same data, anchors and init: the first steps' losses match across backends (bf16)."""
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=6)
    losses = {}
    for attention, compile_mode in (("sdpa", "none"), ("flex", "flex")):
        out = tmp_path / attention
        run(tiny(cache, out, gpus="0", steps=3, attention=attention, compile=compile_mode))
        losses[attention] = [r["loss"] for r in records(out)]
    assert losses["flex"] == pytest.approx(losses["sdpa"], rel=2e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_one_gpu_with_twice_the_accumulation(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=4, samples_per_part=5)
    kw = dict(steps=4, lr=1e-2, attention="sdpa", compile="none")
    run(tiny(cache, tmp_path / "two", gpus="0,1", workers=0, grad_accum=1, **kw))
    run(tiny(cache, tmp_path / "one", gpus="0", workers=2, grad_accum=2, **kw))
    for x, y in zip(records(tmp_path / "two"), records(tmp_path / "one"), strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-3)
