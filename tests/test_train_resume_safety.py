"""A resume never continues from something other than what the run saved: another cache with
the same settings, a checkpoint whose bytes changed, a record that cannot be read."""

from __future__ import annotations

import pytest

from tests.cachegen import write_cache
from tests.test_train_loop import tiny
from train.run import RunError, run


def test_a_resume_on_a_cache_of_other_rows_is_refused(tmp_path):
    """Two caches of the same files and settings but --max-rows (here: rows in all): the plan a
    checkpoint holds a place in is the first one's, so the second cannot continue it."""
    first = write_cache(tmp_path / "a", num_parts=3, samples_per_part=6)
    fewer = write_cache(tmp_path / "b", num_parts=2, samples_per_part=6)
    out = tmp_path / "run"
    run(tiny(first, out, steps=4, checkpoint_every=2, stop_after_steps=3))
    with pytest.raises(RunError, match=r"the cache differs \(manifest identity: total_rows\)"):
        run(tiny(fewer, out, steps=4, checkpoint_every=2))
    run(tiny(first, out, steps=4, checkpoint_every=2))  # its own cache resumes it
    assert (out / "export").is_dir()
