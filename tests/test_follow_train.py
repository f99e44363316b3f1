"""Training on a cache whose manifest grows while the run goes on (in-process, one CPU rank);
the real extract and train CLIs together are in tests/test_follow_cli.py."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import threading

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from shared.cache import open_part
from shared.manifest import read_manifest, write_manifest
from tests.cachegen import write_cache
from train.__main__ import main
from train.config import TrainConfig
from train.run import run

pytestmark = pytest.mark.usefixtures("one_thread")
WAIT_S = 120  # for a log line of the run in another thread; a failing test ends there


def tiny(cache, out, **kw) -> TrainConfig:
    base = dict(
        data=cache, out=out, gpus="cpu", drafter_layers=1, block_size=4, num_anchors=8,
        batch_tokens=512, workers=0, shuffle_buffer=4, lr=3e-3, log_every=1,
        checkpoint_every=1000, eval_fraction=0.0,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


class Lines(logging.Handler):
    """The messages of train's loggers, and a wait for the next one that matches."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.lines.append(record.getMessage())
            self.changed.notify_all()

    def wait_for(self, needle: str, after: int) -> int:
        """The index of the first line from `after` on holding `needle`."""
        with self.changed:
            ok = self.changed.wait_for(
                lambda: any(needle in line for line in self.lines[after:]), timeout=WAIT_S
            )
        assert ok, f"{needle!r} never logged:\n" + "\n".join(self.lines)
        return next(i for i, line in enumerate(self.lines) if i >= after and needle in line)


@pytest.fixture()
def lines():
    handler = Lines()
    logger = logging.getLogger("train")
    level = logger.level
    logger.setLevel(logging.INFO)  # before train_rank sets logging up, the launcher's lines too
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture()
def growing(tmp_path):
    """A cache of 6 parts of which the manifest records the first 2 so far."""
    cache = write_cache(tmp_path / "c", num_parts=6, samples_per_part=5, complete=False)
    full = read_manifest(cache)
    write_manifest(cache, dataclasses.replace(full, parts=full.parts[:2]))
    return cache, full


def run_beside(writer, cfg: TrainConfig) -> None:
    """Train `cfg` while `writer` (what an extraction would do to the cache) runs in a thread."""
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        run(cfg)
    finally:
        thread.join()


def exported(run_dir):
    return load_file(str(run_dir / "export" / "model.safetensors"))


def test_a_run_trains_on_parts_committed_after_it_started(growing, lines, tmp_path):
    """The run waits at the end of what is committed, goes on as parts are recorded, and its
    first pass covers every sample; it trains exactly as a run started on the finished cache."""
    cache, full = growing

    def commit_the_rest() -> None:
        seen = 0
        for n in (4, 6):
            seen = lines.wait_for("waiting at step", seen) + 1
            write_manifest(cache, dataclasses.replace(full, parts=full.parts[:n]))

    run_beside(commit_the_rest, tiny(cache, tmp_path / "followed", steps=14))
    text = "\n".join(lines.lines)
    assert "following the extraction of" in text and "2 of 6 parts committed" in text
    assert "no extraction is running on it" in text  # nothing holds the cache's lock
    waits = re.findall(r"waiting at step (\d+)", text)
    goes_on = re.findall(r"continuing at step (\d+): (\d) of 6", text)
    assert len(waits) == 2 and [g[0] for g in goes_on] == waits and goes_on[-1][1] == "6"
    done = re.search(r"first pass is done at step \d+: (\d+) samples .* of the (\d+) train", text)
    assert done and int(done.group(1)) == int(done.group(2)) == 30  # 6 parts x 5, none held out
    reference = run(tiny(cache, tmp_path / "reference", steps=14))
    a, b = exported(tmp_path / "followed"), exported(reference.parent)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_that_ends_before_the_extraction_says_so(growing, lines, tmp_path):
    cache, _ = growing
    run(tiny(cache, tmp_path / "short", steps=2))
    text = "\n".join(lines.lines)
    assert "this run's 2 steps end within the first pass" in text
    assert "will not train on every sample" in text
    assert "the run ended at step 2 before the extraction finished (2 of 6 parts" in text
    assert (tmp_path / "short" / "export" / "model.safetensors").is_file()


def test_an_extraction_that_ends_before_the_first_step_is_not_said_to_run(lines, tmp_path):
    """The cache completes while the run waits for its first step's parts: the run starts as
    one that follows a finished extraction, not as a resumed one, and warns of nothing still to
    come."""
    cache = write_cache(tmp_path / "c", num_parts=3, samples_per_part=5, complete=False)
    full = read_manifest(cache)
    write_manifest(cache, dataclasses.replace(full, parts=()))

    def finish() -> None:
        lines.wait_for("waiting before the first step", 0)
        write_manifest(cache, dataclasses.replace(full, parts=full.parts, complete=True))

    run_beside(finish, tiny(cache, tmp_path / "r", steps=2))
    text = "\n".join(lines.lines)
    assert "it finished while this run waited for its first step's parts" in text, text
    assert "resuming" not in text and "before the extraction does" not in text
    assert "end within the first pass" not in text


def test_no_follow_refuses_a_cache_still_being_written(growing, tmp_path):
    cache, _ = growing
    result = CliRunner().invoke(
        main, ["--data", str(cache), "--out", str(tmp_path / "r"), "--gpus", "cpu", "--no-follow"]
    )
    assert result.exit_code == 1 and "extraction is incomplete (2/6 parts)" in result.output
    assert not (tmp_path / "r").exists()


def test_parts_the_manifest_does_not_record_are_never_opened(growing, lines, tmp_path):
    """Part 2 committed on disk but not yet recorded, and part 3 being written, both unreadable:
    a run over what is recorded never touches them."""
    cache, full = growing
    for name in ("part-000002", "part-000003.tmp"):
        if name.endswith(".tmp"):
            shutil.copytree(cache / "part-000003", cache / name)
        for f in (cache / name).rglob("*"):
            if f.is_file():
                f.write_bytes(b"being written")
        with pytest.raises(Exception):  # noqa: B017 (any failure: the files are junk)
            open_part(cache / name).read(0, (0,))
    run(tiny(cache, tmp_path / "r", steps=2))
    assert (tmp_path / "r" / "export" / "model.safetensors").is_file()
    assert "2 of 6 parts committed" in "\n".join(lines.lines)


def test_files_put_in_the_export_folder_while_it_trains_stop_it_with_its_checkpoint(
    growing, lines, tmp_path
):
    """A file put in the run's export folder after the run checked it (here while the run waits
    for parts): the export at the end names it, the last checkpoint is kept, and once it is
    moved away the same command exports without training again."""
    from shared.stopping import StopRun

    cache, full = growing
    out = tmp_path / "run"

    def add_a_model_card() -> None:
        lines.wait_for("waiting at step", 0)
        (out / "export").mkdir()
        (out / "export" / "README.md").write_text("my drafter")
        write_manifest(cache, dataclasses.replace(full, complete=True))

    with pytest.raises(StopRun, match=r"holds other files than an export \(README.md\)") as e:
        run_beside(add_a_model_card, tiny(cache, out, steps=8))
    assert "last checkpoint (step 8) is saved: move them away" in str(e.value)
    shutil.move(out / "export" / "README.md", tmp_path / "README.md")
    seen = len(lines.lines)
    run(tiny(cache, out, steps=8))
    assert "checkpoint step-8 is saved already" in "\n".join(lines.lines[seen:])
    assert (out / "export" / "model.safetensors").is_file()
