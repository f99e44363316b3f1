"""The trainer's public step API: prepare + train_step is the step `fit` runs."""

import pytest
import torch

from shared.dist import RankInfo
from shared.manifest import read_manifest
from tests.cachegen import write_cache
from tests.test_train_loop import tiny
from train.loop import Trainer
from train.run import prepare as prepare_run

CPU = RankInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=2, samples_per_part=4)


def make_trainer(cache, out) -> Trainer:
    cfg = tiny(cache, out, grad_accum=2, epochs=3)
    cfg, prep = prepare_run(cfg, read_manifest(cache), device_kind="cpu")
    return Trainer(CPU, cfg, prep)


def run_by_hand(trainer: Trainer) -> list[float]:
    waits = []
    while trainer.step < trainer.total:
        waits.append(trainer.train_step())
    return waits


def test_step_needs_prepare(cache, tmp_path):
    trainer = make_trainer(cache, tmp_path / "run")
    with pytest.raises(RuntimeError, match="prepare"):
        trainer.train_step()
    trainer.prepare()
    trainer.close_loader()
    with pytest.raises(RuntimeError, match="prepare"):
        trainer.train_step()


def test_public_steps_match_fit(cache, tmp_path):
    fitted = make_trainer(cache, tmp_path / "fit")
    fitted.fit()

    from_loader = make_trainer(cache, tmp_path / "loader")
    from_loader.prepare()
    waits = run_by_hand(from_loader)

    # The same micro-batches, taken from the loader beforehand and handed over as an iterator.
    given = make_trainer(cache, tmp_path / "given")
    items = list(given.loader())
    given.prepare(iter(items))
    run_by_hand(given)

    assert fitted.total >= 2 and len(waits) == fitted.total
    assert all(w >= 0.0 for w in waits)
    assert from_loader.step == given.step == fitted.step == fitted.total
    assert from_loader.loader_state == fitted.loader_state == given.loader_state
    reference = fitted.model.state_dict()
    for trainer in (from_loader, given):
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(value, reference[key]), key
    # fit's steps changed the weights: the comparison above is not between untouched models
    untouched = make_trainer(cache, tmp_path / "untouched").model.state_dict()
    assert any(not torch.equal(untouched[k], v) for k, v in reference.items())
