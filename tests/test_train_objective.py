"""`python -m train --loss` and `--slot-weights` on CPU: a run through the real CLI with the KL to
the target's distribution, the clear error for a cache without the target's last layer, a resume
refusing another loss, uniform and D-PACE slot weights, and a sweep varying the loss."""

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from shared.manifest import CacheMismatch
from tests.cachegen import write_cache
from tests.drafters import tiny_drafter, tiny_drafter_config
from tests.test_train_loop import records, tiny
from train.__main__ import main
from train.data.batch import Batch
from train.drafters.objective import Objective
from train.run import RunError, run
from train.step import anchored_loss
from train.sweep.grid import GridError, parse_vary, plan_jobs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # 4 target layers; cached 0, 1 and the last, 3 (after the final norm)
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=6)


def test_kl_trains_through_the_cli(cache, tmp_path):
    out = tmp_path / "run"
    args = [
        "--data", str(cache), "--out", str(out), "--gpus", "cpu", "--attention", "sdpa",
        "--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8",
        "--batch-tokens", "512", "--workers", "0", "--shuffle-buffer", "4", "--lr", "3e-3",
        "--epochs", "6", "--log-every", "1", "--eval-parts", "1", "--loss", "kl",
    ]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    train = records(out)
    for r in train:
        assert r["loss"] == pytest.approx(r["kl"], rel=1e-6) and r["kl"] >= 0 and 0 <= r["tv"] <= 1
    first, last = train[0]["kl"], sum(r["kl"] for r in train[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert "kl" in records(out, "eval")[-1]
    saved = json.loads((out / "config.json").read_text())["train"]
    # the taps stay the cached layers (the last one too, as with --loss ce)
    assert (saved["loss"], saved["slot_weights"], saved["target_layers"]) == ("kl", "exp", "0,1,3")
    assert (out / "export" / "model.safetensors").is_file()


def test_a_cache_without_the_last_layer_names_it_and_the_extract_option(tmp_path):
    cache = write_cache(tmp_path / "cache", num_parts=2, samples_per_part=6, layer_ids=(0, 1))
    for loss in ("kl", "tv", "mix"):
        with pytest.raises(CacheMismatch) as err:
            run(tiny(cache, tmp_path / loss, loss=loss))
        message = str(err.value)
        assert f"cache {cache} cannot be used" in message
        assert f"--loss {loss}" in message and "layer 3" in message
        assert "cached layers [0, 1]" in message and "python -m extract --layers 0,1,3" in message
        assert not (tmp_path / loss).exists()  # refused before any work
    run(tiny(cache, tmp_path / "ce", epochs=1))  # the CE needs no last layer


def test_a_resume_refuses_another_loss(cache, tmp_path):
    out = tmp_path / "run"
    run(tiny(cache, out, loss="ce", stop_after_steps=2, checkpoint_every=2))
    with pytest.raises(RunError, match="loss: run has 'ce', now 'kl'"):
        run(tiny(cache, out, loss="kl"))
    with pytest.raises(RunError, match="slot_weights: run has 'exp', now 'uniform'"):
        run(tiny(cache, out, slot_weights="uniform"))
    with pytest.raises(RunError, match="kl_weight: run has 0.5, now 0.25"):
        run(tiny(cache, out, kl_weight=0.25))
    run(tiny(cache, out))  # the same loss resumes
    assert [r["step"] for r in records(out)] == list(range(1, len(records(out)) + 1))


@pytest.mark.parametrize("slot_weights", ["uniform", "dpace"])
def test_other_slot_weights_train(cache, tmp_path, slot_weights):
    out = tmp_path / slot_weights
    run(tiny(cache, out, slot_weights=slot_weights, epochs=3))
    train = records(out)
    assert sum(r["loss"] for r in train[-3:]) < 0.8 * sum(r["loss"] for r in train[:3])
    saved = json.loads((out / "config.json").read_text())["train"]
    assert saved["slot_weights"] == slot_weights and saved["gamma"] is None
    if slot_weights == "dpace":  # the CE's mean over D-PACE's weights is recorded beside
        assert "ce" in train[-1] and "kl" in train[-1]


def test_options_that_cannot_work_are_refused(cache, tmp_path):
    with pytest.raises(ValueError, match="loss: applies to --drafter-type dflash"):
        tiny(cache, tmp_path / "x", loss="kl", drafter_type="dspark")
    with pytest.raises(ValueError, match="gamma: applies to --slot-weights exp only"):
        tiny(cache, tmp_path / "x", gamma=3.0, slot_weights="uniform")
    with pytest.raises(ValueError, match="slot_weights: dpace .* --loss ce only"):
        tiny(cache, tmp_path / "x", loss="kl", slot_weights="dpace")


def test_a_sweep_varies_the_loss_and_the_slot_weights(cache, tmp_path):
    train = ["--drafter-layers", "1", "--block-size", "4", "--steps", "4"]
    jobs = plan_jobs(
        data=cache, out=tmp_path, grid=parse_vary(["loss=ce,kl", "slot-weights=exp,uniform"]),
        seeds=1, train_args=train,
    )  # fmt: skip
    assert [j.variant.args() for j in jobs] == [
        ["--loss", "ce", "--slot-weights", "exp"],
        ["--loss", "ce", "--slot-weights", "uniform"],
        ["--loss", "kl", "--slot-weights", "exp"],
        ["--loss", "kl", "--slot-weights", "uniform"],
    ]
    with pytest.raises(GridError, match="variant loss=js: .*js"):
        plan_jobs(data=cache, out=tmp_path, grid=parse_vary(["loss=js"]), seeds=1, train_args=[])
    with pytest.raises(GridError, match="variant loss=kl: .*--drafter-type dflash"):
        plan_jobs(
            data=cache, out=tmp_path, grid=parse_vary(["loss=kl"]), seeds=1,
            train_args=["--drafter-type", "dspark"],
        )  # fmt: skip


def test_noise_leaves_the_targets_last_layer_alone():
    """--noise-std perturbs the drafter's taps, never the target's distribution read after them
    (--loss kl|tv|mix, DSpark's full loss)."""
    ids = torch.zeros(1, 4, dtype=torch.long)
    batch = Batch.one_per_row(
        torch.tensor([4]), ids_BS=ids, loss_mask_BS=ids, hidden_BSKH=torch.ones(1, 4, 3, 8)
    )
    noised = batch.noised(std=0.1, seed=7, layers=2).hidden_BSKH
    assert torch.equal(noised[:, :, 2], torch.ones(1, 4, 8))
    assert (noised[:, :, :2] - 1).abs().min() > 0
    # the taps draw the same noise as without `layers`
    assert torch.equal(noised[:, :, :2], batch.noised(std=0.1, seed=7).hidden_BSKH[:, :, :2])


def _kl_step(objective, batch, anchors, keep, drafter, embed, lm_head, ce="fused"):
    drafter.zero_grad()
    out = anchored_loss(
        drafter, embed, lm_head, batch, anchors, keep, block_size=4, gamma=2.0,
        mask_token_id=299, attention="sdpa", ce=ce, ce_chunk_blocks=3, objective=objective,
    )  # fmt: skip
    out.weighted_sum.backward()
    return out, {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("ce", ["fused", "autograd"])
def test_the_target_row_is_the_one_before_the_token_in_its_own_sample(ce):
    """A target whose last state at row t puts all its mass on x[t + 1] makes the KL the CE on
    the data tokens: the slot predicting x[a + k] reads row a + k - 1. A packed row gives the sums
    of its samples one by one, an anchor at the row's last candidate included."""
    gen = torch.Generator().manual_seed(3)
    embed, lm_head = torch.randn(300, 64, generator=gen), torch.randn(300, 64, generator=gen) / 8
    drafter = tiny_drafter(tiny_drafter_config()).train()
    lengths, ids, hidden = [11, 17], torch.randint(0, 299, (28,), generator=gen), []
    nxt = torch.cat([ids[1:], ids[:1]])
    last = 400 * lm_head[nxt] / lm_head[nxt].norm(dim=-1, keepdim=True) ** 2
    hidden = torch.cat([torch.randn(28, 3, 64, generator=gen), last[:, None]], dim=1)
    docs = torch.tensor([0] * 11 + [1] * 17)
    pos = torch.cat([torch.arange(11), torch.arange(17)])
    packed = Batch(
        ids_BS=ids[None], loss_mask_BS=torch.ones(1, 28, dtype=torch.long), doc_ids_BS=docs[None],
        positions_BS=pos[None], hidden_BSKH=hidden[None],
    )  # fmt: skip
    anchors, keep = torch.tensor([[0, 3, 8, 11, 20, 26]]), torch.ones(1, 6, dtype=torch.bool)
    kl, kl_grads = _kl_step(Objective("kl"), packed, anchors, keep, drafter, embed, lm_head, ce)
    plain = dataclasses.replace(packed, hidden_BSKH=hidden[None, :, :3])
    ce_out, _ = _kl_step(Objective("ce"), plain, anchors, keep, drafter, embed, lm_head, ce)
    assert kl.weighted_sum.item() == pytest.approx(ce_out.weighted_sum.item(), rel=1e-3)
    total, grads = 0.0, None
    for d, start in enumerate((0, 11)):
        span = slice(start, start + lengths[d])
        alone = Batch.one_per_row(
            torch.tensor([lengths[d]]), ids_BS=ids[None, span],
            loss_mask_BS=torch.ones(1, lengths[d], dtype=torch.long),
            hidden_BSKH=hidden[None, span],
        )  # fmt: skip
        mine = anchors[(anchors >= start) & (anchors < start + lengths[d])] - start
        out, g = _kl_step(Objective("kl"), alone, mine[None], torch.ones(1, len(mine)).bool(),
                          drafter, embed, lm_head, ce)  # fmt: skip
        total += out.weighted_sum.item()
        grads = g if grads is None else {n: grads[n] + g[n] for n in g}
    assert kl.weighted_sum.item() == pytest.approx(total, rel=1e-5)
    for name, grad in kl_grads.items():
        torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6)
