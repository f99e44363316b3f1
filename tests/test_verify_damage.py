"""`extract.verify`'s check of damaged parts: each damage said once, naming the part."""

import pytest

from extract.verify import check_parts
from shared.manifest import read_manifest
from tests.cachegen import write_cache


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_a_part_that_cannot_be_opened_is_said_so_once(tmp_path, fmt):
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=2, fmt=fmt)
    manifest = read_manifest(cache)
    first = cache / manifest.parts[0].name
    if fmt == "zarr":
        (first / "zarr.json").write_text("not json")
    else:
        first.write_bytes(first.read_bytes()[: first.stat().st_size // 3])
    found = check_parts(cache, manifest, threads=1)
    name = manifest.parts[0].name
    assert all(p.startswith(f"{name}: ") for p in found) and found[0].startswith(
        f"{name}: checksum "
    )
    assert len(found) == 2 and found[1].startswith(f"{name}: cannot be opened ("), found


@pytest.mark.parametrize("array", ["input_ids", "hidden", "lengths"])
def test_an_array_gone_from_a_zarr_part_is_named_missing(tmp_path, array):
    import shutil

    cache = write_cache(tmp_path / "c", num_parts=1, samples_per_part=2)
    manifest = read_manifest(cache)
    name = manifest.parts[0].name
    shutil.rmtree(cache / name / array)
    found = check_parts(cache, manifest, threads=1)
    assert f"{name}: {array}: missing" in found, found
    assert not any("Error" in p or "sample_index" in p for p in found), found  # said once


def test_an_incomplete_cache_still_being_written_is_said_so(tmp_path):
    from extract.verify import unfinished
    from shared.lock import acquire, release

    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=2, complete=False)
    manifest = read_manifest(cache)
    fd = acquire(cache, "python -m extract --out c")  # this process: a running extraction
    try:
        (writing,) = unfinished(cache, manifest)
    finally:
        release(cache, fd)
    (stopped,) = unfinished(cache, manifest)
    assert writing.startswith("the cache is incomplete (")
    assert "an extraction is writing it (pid " in writing and "once that has finished" in writing
    assert "python -m extract --out" not in writing  # that command would be refused now
    assert "writing it" not in stopped and stopped.endswith("to finish it")
    assert "python -m extract --out" in stopped
    every = write_cache(tmp_path / "e", num_parts=2, samples_per_part=2, complete=False)
    (line,) = unfinished(every, read_manifest(every))  # every part listed, the end not recorded
    assert line.startswith("the cache is incomplete (2/2 parts listed, the cache not marked ")
    assert "not listed" not in line and line.endswith("to finish it")


def test_repair_counts_the_parts_it_dropped_in_words_that_agree(tmp_path):
    from click.testing import CliRunner

    from extract.verify import main

    for count in (1, 2):
        cache = write_cache(tmp_path / f"c{count}", num_parts=3, samples_per_part=2)
        names = [p.name for p in read_manifest(cache).parts]
        for name in names[:count]:
            (cache / name / "zarr.json").write_text("not json")
        r = CliRunner().invoke(main, [str(cache), "--samples", "0", "--repair"])
        assert r.exit_code == 1, r.output
        said = "1 damaged part from" if count == 1 else "2 damaged parts from"
        assert f"repaired: dropped {said} the manifest" in r.output, r.output
        assert [p.name for p in read_manifest(cache).parts] == names[count:]


def test_the_last_line_says_when_the_states_were_not_re_run(tmp_path, monkeypatch):
    """The re-run needs the target: where it is not found the checks of the files still pass,
    and the last line, the one a log is read by, says the states went unchecked."""
    from click.testing import CliRunner

    from extract.verify import main

    monkeypatch.chdir(tmp_path)  # where no folder is named as the target recorded
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=2)
    r = CliRunner().invoke(main, [str(cache), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    last = r.stdout.splitlines()[-1]
    assert (
        last
        == "2 parts checked, 0 problems; the states not re-run: target synthetic not found here"
    )
    r = CliRunner().invoke(main, [str(cache), "--samples", "0"])
    assert r.exit_code == 0 and r.stdout.splitlines()[-1] == "2 parts checked, 0 problems"
