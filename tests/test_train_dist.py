"""Two gloo processes train the same weights as one process seeing the same global batch."""

import pytest
import torch

from tests.cachegen import write_cache
from tests.test_train_loop import final_state, records, tiny
from train.checkpoint import list_checkpoints, load_drafter
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.proof.compare import differing_settings, read_run
from train.run import run


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=4, samples_per_part=5)


def test_two_ranks_equal_one_rank_with_twice_the_accumulation(cache, tmp_path):
    # The plan depends on ranks x workers only: 2 ranks x 1 stream and 1 rank x 2 streams read
    # the same micro-batches, and 2 ranks x accum 1 pair them into the same optimizer steps
    # as 1 rank x accum 2.
    kw = dict(steps=6, checkpoint_every=3, lr=1e-2)
    two = tmp_path / "two"
    run(tiny(cache, two, gpus="cpu:2", workers=0, grad_accum=1, **kw))
    one = tmp_path / "one"
    run(tiny(cache, one, gpus="cpu", workers=2, grad_accum=2, **kw))
    a, b = final_state(two), final_state(one)
    assert a["step"] == b["step"] == 6
    # Each run records its processes, and a comparison names them among what the runs vary.
    settings = dict(differing_settings([read_run(two), read_run(one)]))
    assert settings["ranks"] == [2, 1] and settings["grad_accum"] == [1, 2]
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-4, atol=1e-5)
    # Adam hides a constant gradient factor; the logged (pre-clip) gradient norm does not.
    for x, y in zip(records(two), records(one), strict=True):
        assert x["step"] == y["step"]
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["tokens_per_s"] > 0
    # and training moved the weights away from their initial values
    _, drafter_cfg = load_drafter(list_checkpoints(one)[-1][1])
    init = DFlashDrafter(drafter_cfg)
    init_drafter_weights(init, 0)
    assert not torch.allclose(init.state_dict()["fc.weight"], b["model"]["fc.weight"], atol=1e-4)
