"""Stage one never loses the user's data: what --overwrite may delete, the lock, verification."""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from extract.config import ExtractConfig
from extract.outdir import protected_reason
from extract.plan import plan_manifest
from extract.run import ExtractError, run
from shared.cache import is_own_entry, open_part_writer, verify_part
from shared.manifest import read_manifest
from shared.stopping import StopRun
from shared.writeback import drop_written
from tests.test_extract import chat


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(8)))
    return path


def extract(out: Path, target: Path, data: Path, **over) -> object:
    cfg = dict(
        out=out,
        target=str(target),
        data=(data,),
        gpus="cpu",
        rows_per_part=4,
        batch_tokens=512,
        layers="0,2",
        writer_threads=1,
    )
    return run(ExtractConfig(**{**cfg, **over}))


def test_own_entries_are_recognised():
    own = ["manifest.json", "part-000012", "part-000003.tar.tmp", "target.tmp", ".progress"]
    own += [".manifest.json.tmp.12.345", ".lock", "extract_config.json", "part-000001.old"]
    assert all(is_own_entry(n) for n in own)
    foreign = ["notes.txt", "part-1", "manifest.json.bak", "target2", "data.jsonl", ".git"]
    assert not any(is_own_entry(n) for n in foreign)


def test_protected_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "working directory" in protected_reason(tmp_path, [])
    assert "working directory" in protected_reason(tmp_path.parent, [])
    data = tmp_path / "d" / "x.jsonl"
    assert "holds" in protected_reason(tmp_path / "d", [data])
    assert protected_reason(tmp_path / "other", [data]) is None


def test_overwrite_refuses_a_folder_that_is_not_a_cache(tmp_path, tiny_qwen3, data_file):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ExtractError, match="precious.txt") as e:
            extract(out, tiny_qwen3, data_file, overwrite=overwrite)
        assert "--overwrite" not in str(e.value)
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_overwrite_refuses_the_working_directory_and_the_data_folder(
    tmp_path, tiny_qwen3, data_file, monkeypatch
):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    extract(cwd, tiny_qwen3, data_file, max_rows=4)  # a real cache, then used as the cwd
    monkeypatch.chdir(cwd)
    before = sorted(p.name for p in cwd.iterdir())
    with pytest.raises(ExtractError, match="working directory"):
        extract(Path("."), tiny_qwen3, data_file, max_rows=4, layers="1", overwrite=True)
    assert sorted(p.name for p in cwd.iterdir()) == before
    holder = tmp_path / "holder"
    extract(holder, tiny_qwen3, data_file, max_rows=4)
    inside = holder / "rows.jsonl"
    inside.write_text(data_file.read_text())
    with pytest.raises(ExtractError, match="rows.jsonl"):
        extract(holder, tiny_qwen3, inside, max_rows=4, layers="1", overwrite=True)
    assert inside.is_file()


def test_overwrite_replaces_only_a_cache_and_leftovers_do_not_block(
    tmp_path, tiny_qwen3, data_file
):
    out = tmp_path / "c"
    extract(out, tiny_qwen3, data_file, max_rows=4)
    m = extract(out, tiny_qwen3, data_file, max_rows=4, layers="1", overwrite=True)
    assert m.complete and m.layer_ids == (1,)
    fresh = tmp_path / "interrupted"
    (fresh / "target.tmp").mkdir(parents=True)  # a start stopped while writing target/
    (fresh / "target.tmp" / "config.json").write_text("{")
    m = extract(fresh, tiny_qwen3, data_file, max_rows=4)
    assert m.complete and not (fresh / "target.tmp").exists()
    assert read_manifest(fresh).complete


def test_a_folder_named_target_that_extraction_did_not_write_is_never_deleted(
    tmp_path, tiny_qwen3, data_file
):
    """`target/` is a name the cache uses; a user's folder of that name (the model itself, a
    build folder) is not taken for the cache's, with or without --overwrite."""
    out = tmp_path / "o"
    shutil.copytree(tiny_qwen3, out / "target")
    before = sorted(p.name for p in (out / "target").iterdir())
    for overwrite in (False, True):
        with pytest.raises(ExtractError, match="target"):
            extract(out, out / "target", data_file, max_rows=4, overwrite=overwrite)
        assert sorted(p.name for p in (out / "target").iterdir()) == before
    build = tmp_path / "b"
    (build / "target").mkdir(parents=True)
    (build / "target" / "build-output.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(ExtractError, match="did not write: target"):
            extract(build, tiny_qwen3, data_file, max_rows=4, overwrite=overwrite)
    assert (build / "target" / "build-output.txt").read_text() == "keep me"
    # The cache's own target/ of a start that stopped before its manifest: cleared, as before
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file, max_rows=4)
    for p in cache.iterdir():
        if p.name not in ("target", "extract_config.json"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    assert extract(cache, tiny_qwen3, data_file, max_rows=4).complete


def test_a_hub_id_is_read_from_the_local_hugging_face_cache(
    tmp_path, tiny_qwen3, data_file, monkeypatch
):
    """`--target ORG/NAME` takes the snapshot in the local Hugging Face cache (never a
    download); the manifest records the snapshot's folder. An id not cached is named."""
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_qwen3, snapshot)
    (hub / "models--org--tiny" / "refs").mkdir()
    (hub / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    m = extract(tmp_path / "c", "org/tiny", data_file, max_rows=4)
    assert m.complete and Path(m.target.path) == snapshot
    with pytest.raises(ExtractError, match="'org/other': it is not a folder, nor a hub id in the"):
        extract(tmp_path / "d", "org/other", data_file, max_rows=4)


def test_relative_inputs_are_recorded_absolute(tmp_path, tiny_qwen3, data_file, monkeypatch):
    """The manifest's resume command and verify's re-run of the target work from any folder."""
    shutil.copytree(tiny_qwen3, tmp_path / "model")
    shutil.copy(data_file, tmp_path / "rows.jsonl")
    monkeypatch.chdir(tmp_path)
    m = extract(tmp_path / "c", Path("model"), Path("rows.jsonl"), max_rows=4)
    assert m.target.path == str(tmp_path / "model")
    assert [s.path for s in m.sources] == [str(tmp_path / "rows.jsonl")]


def _cli(*args: str):
    from click.testing import CliRunner

    from extract.__main__ import main

    return CliRunner().invoke(main, list(args))


def _extract_command(output: str) -> list[str]:
    """The arguments of the `python -m extract ...` command a message names."""
    import shlex

    command = output.split("`python -m extract ")[1].split("`")[0]
    return shlex.split(command)


def _verify(cache: Path, *args: str):
    from click.testing import CliRunner

    from extract.verify import main

    return CliRunner().invoke(main, [str(cache), "--samples", "0", *args])


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


def _checksums(cache: Path) -> dict[str, str]:
    return {p.name: p.checksum for p in read_manifest(cache).parts}


def test_damaged_target_files_are_found_refused_and_repaired(tmp_path, tiny_qwen3, data_file):
    from train.config import TrainConfig
    from train.run import prepare

    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file, max_rows=4)
    assert "embed.safetensors" in read_manifest(cache).target_files
    assert _verify(cache).exit_code == 0
    _flip(cache / "target" / "embed.safetensors", 0.9)  # tensor bytes: the file still loads
    r = _verify(cache)
    assert r.exit_code == 1 and "target/embed.safetensors" in r.output, r.output
    cfg = TrainConfig(data=cache, out=tmp_path / "run", gpus="cpu", drafter_layers=1)
    repair = "(?s)target/embed.safetensors.*to repair them: .*--repair"
    with pytest.raises(ValueError, match=repair):
        prepare(cfg, read_manifest(cache), device_kind="cpu")
    r = _verify(cache, "--repair")
    assert r.exit_code == 1 and "target/ to be written again" in r.output
    assert not read_manifest(cache).complete
    m = extract(cache, tiny_qwen3, data_file, max_rows=4)
    assert m.complete and _verify(cache).exit_code == 0


def test_a_complete_cache_is_not_extracted_again(tmp_path, tiny_qwen3, data_file, capfd, caplog):
    """The same command on a complete cache checks it and stops: no rank starts (at 8B, minutes
    of loading the target for nothing), and the cache is as it was."""
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    before = _checksums(cache)
    capfd.readouterr()
    caplog.clear()
    m = extract(cache, tiny_qwen3, data_file)
    said = caplog.text + capfd.readouterr().err
    assert m.complete and _checksums(cache) == before
    assert "every part is committed" in said and "extract.worker" not in said, said


def test_a_folder_of_parts_without_a_manifest_is_refused_not_replaced(
    tmp_path, tiny_qwen3, data_file
):
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    (cache / "manifest.json").unlink()
    before = sorted(p.name for p in cache.iterdir())
    with pytest.raises(ExtractError, match="it holds no manifest.json"):
        extract(cache, tiny_qwen3, data_file)
    assert sorted(p.name for p in cache.iterdir()) == before


def test_missing_part_is_redone_on_resume(tmp_path, tiny_qwen3, data_file):
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    before = _checksums(cache)
    shutil.rmtree(cache / "part-000001")
    m = extract(cache, tiny_qwen3, data_file)
    assert m.complete and _checksums(cache) == before
    assert _verify(cache).exit_code == 0


def test_temporary_files_of_killed_writes_are_removed_by_the_next_run(
    tmp_path, tiny_qwen3, data_file
):
    """A kill -9 inside an atomic write leaves `.NAME.tmp.PID.TID`: the next run removes those
    over a minute old (a running write's is younger) and the cache stays as it was."""
    import time

    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    before = _checksums(cache)
    old, young = cache / ".manifest.json.tmp.4242.17", cache / ".extract_config.json.tmp.4243.1"
    for f in (old, young):
        f.write_text('{"cut')
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    assert extract(cache, tiny_qwen3, data_file).complete
    assert not old.exists() and young.exists()
    assert _checksums(cache) == before


def test_a_kill_inside_a_parts_replacement_leaves_nothing_behind(tmp_path, tiny_qwen3, data_file):
    """A part committed but not recorded is written again on resume, replacing it; a kill
    between the replacement's two renames leaves `part-N.old` and no `part-N`: the resumed
    run's commit of that unit removes it."""
    import dataclasses

    from shared.manifest import write_manifest

    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    before, full = _checksums(cache), read_manifest(cache)
    write_manifest(cache, dataclasses.replace(full, parts=full.parts[1:]))  # unit 0 unrecorded
    (cache / "part-000000").rename(cache / "part-000000.old")
    assert extract(cache, tiny_qwen3, data_file).complete
    assert not (cache / "part-000000.old").exists() and _checksums(cache) == before


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    from shared.fsio import atomic_write_bytes, replace_file_bytes

    (tmp_path / "busy").mkdir()  # a folder in the way: the rename fails
    (tmp_path / "busy" / "f").write_text("")
    for write in (atomic_write_bytes, replace_file_bytes):
        with pytest.raises(OSError):
            write(tmp_path / "busy", b"data")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_a_cut_manifest_is_said_to_be_damaged_not_another_caches(tmp_path, tiny_qwen3, data_file):
    """The same command on a cache whose manifest.json was cut: not "a different cache" with
    the advice to use the same settings (it was), but what to restore; nothing is deleted."""
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    path = cache / "manifest.json"
    path.write_text(path.read_text()[:200])
    before = sorted(p.name for p in cache.iterdir())
    with pytest.raises(ExtractError) as e:
        extract(cache, tiny_qwen3, data_file)
    said = str(e.value)
    assert "its manifest.json cannot be read, so what its parts hold is unknown" in said
    assert "manifest.json is not valid JSON" in said and f"Restore {path}" in said
    assert "holds a different cache" not in said
    assert sorted(p.name for p in cache.iterdir()) == before


def test_repair_drops_exactly_the_damaged_part(tmp_path, tiny_qwen3, data_file):
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    before = _checksums(cache)
    victim = max(
        (p for p in (cache / "part-000000").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    _flip(victim)
    untouched = (cache / "part-000001").stat().st_ino
    r = _verify(cache)  # says how to repair it, exactly
    assert r.exit_code == 1 and "part-000000" in r.output
    assert f"to repair: run `python -m extract.verify {cache} --repair`, then `" in r.output
    again = _extract_command(r.output)
    assert again[:4] == ["--out", str(cache), "--target", str(tiny_qwen3)]
    plain = _cli(*again)  # a plain rerun of a cache listed complete redoes nothing
    assert plain.exit_code == 0 and "checks them against their checksums" in plain.output
    assert "every part was committed before, none extracted" in plain.output
    assert "tok/s" not in plain.output.split("every part was committed")[1]
    r = _verify(cache, "--repair")
    assert r.exit_code == 1 and "part-000000" in r.output and "dropped 1 damaged" in r.output
    assert _extract_command(r.output) == again
    m = read_manifest(cache)
    assert not m.complete and [p.name for p in m.parts] == ["part-000001"]
    r = _cli(*again, "--gpus", "cpu", "--writer-threads", "1")  # the command, as printed
    assert r.exit_code == 0, r.output
    m = read_manifest(cache)
    assert m.complete and _checksums(cache) == before
    # the summary's rate is the redone part's tokens over this run's time, not the cache's: one
    # time, printed to 0.1 s and as a rate to 1 tok/s, so the times each allows must meet
    seconds, rate = re.search(r"([\d.]+) s extracting \(([\d,]+) tok/s\)", r.output).groups()
    tokens, printed_s, printed_rate = m.parts[0].tokens, float(seconds), int(rate.replace(",", ""))
    low = max(printed_s - 0.05, tokens / (printed_rate + 0.5))
    high = min(printed_s + 0.05, tokens / (printed_rate - 0.5))
    assert low <= high + 1e-9, r.output
    assert (cache / "part-000001").stat().st_ino == untouched
    assert _verify(cache).exit_code == 0


def test_verify_options_are_checked_before_any_work(tmp_path, tiny_qwen3, data_file):
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file)
    r = _verify(cache, "--samples", "-1")
    assert r.exit_code == 2 and "-1 is not in the range" in r.output
    for device, needle in [("foo", "not a torch device"), ("mps", "only cpu and cuda")]:
        r = _verify(cache, "--device", device)
        assert r.exit_code == 1 and needle in r.output and " checked, " not in r.output


def test_a_cut_short_wds_part_is_named_and_repaired(tmp_path, tiny_qwen3, data_file):
    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file, format="wds")
    tar = cache / "part-000000.tar"
    with open(tar, "r+b") as f:
        f.truncate(1000)  # inside the first member: tarfile's "unexpected end of data"
    r = _verify(cache)
    assert r.exit_code == 1 and "part-000000.tar: cannot be opened" in r.output, r.output
    assert "not a readable tar" in r.output and "Traceback" not in r.output
    r = _verify(cache, "--repair")
    assert r.exit_code == 1 and "dropped 1 damaged" in r.output, r.output
    assert [p.name for p in read_manifest(cache).parts] == ["part-000001.tar"]


@contextlib.contextmanager
def small_disk(path: Path, size: str, *, read_only: bool = False):
    """A tmpfs of `size` at `path` (a real full file system; read-only if asked); skips where
    it cannot mount."""
    path.mkdir(parents=True)
    options = f"size={size}" + (",ro" * read_only)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_while_writing_target_is_one_message(tmp_path, tiny_qwen3, data_file):
    with small_disk(tmp_path / "disk", "64k") as disk:
        with pytest.raises(ExtractError, match="cannot write .*target.*needs about") as e:
            extract(disk / "c", tiny_qwen3, data_file, max_rows=4)
        assert "rerun the same command" in str(e.value)
        assert not (disk / "c" / "target.tmp").exists()
        subprocess.run(["mount", "-o", "remount,size=8m", str(disk)], check=True)
        assert extract(disk / "c", tiny_qwen3, data_file, max_rows=4).complete


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_disk_full_in_a_writer_thread_names_the_folder(tmp_path, tiny_qwen3, fmt):
    from tests.test_extract import chat

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(chat(i, 3)) + "\n" for i in range(120)))
    with small_disk(tmp_path / "disk", "1m") as disk:
        out = disk / "c"
        with pytest.raises(StopRun, match="disk holding .* is full .*MB free") as e:
            extract(
                out, tiny_qwen3, data, rows_per_part=30, layers="0,1,2,3", space_check=False,
                format=fmt,
            )  # fmt: skip
        assert "rerun the same command" in str(e.value)
        m = read_manifest(out)
        assert not m.complete and len(m.parts) < m.num_units
        # the parts in progress (and the one read ahead) are gone: their space is free again
        assert not list(out.glob("part-*.tmp"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        m = extract(out, tiny_qwen3, data, rows_per_part=30, layers="0,1,2,3", format=fmt)
        assert m.complete and _verify(out).exit_code == 0


def _disk_bytes(path: Path) -> int:
    """The bytes a file or folder takes on its disk (whole blocks)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(f.stat().st_blocks * 512 for f in files)


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_a_disk_that_fails_below_its_file_system_loses_nothing(
    tmp_path, tiny_qwen3, failing_disk, fmt
):
    # The file system has room, the disk below does not (thin-provisioned, network, loop): the
    # writes succeed and their writeback fails. No part may be committed without its bytes, and
    # the message must say what happened. (The failed writes also damage ext4's own blocks on
    # this disk, so that whether the same command then finishes is the file system's affair.)
    folder, fail, heal = failing_disk
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(chat(i, 3)) + "\n" for i in range(240)))
    out = folder / "c"
    options = dict(rows_per_part=40, layers="0,1,2,3", space_check=False, format=fmt)
    # The disk's room: what the same run writes before its first two parts are committed, and a
    # megabyte for the file system's own blocks. The device runs at most two parts ahead of the
    # commits and a commit syncs the whole file system, so the first part always fits with the
    # second in flight, and the run fails by the third part's writes (of six).
    healthy = extract(tmp_path / "healthy", tiny_qwen3, data, **options)
    first_two = sum(_disk_bytes(tmp_path / "healthy" / p.name) for p in healthy.parts[:2])
    room = first_two + _disk_bytes(tmp_path / "healthy" / "target") + (1 << 20)
    assert sum(_disk_bytes(tmp_path / "healthy" / p.name) for p in healthy.parts[:3]) > room
    os.sync()
    fail(room=room)
    with pytest.raises(StopRun, match="failed to store data written there") as e:
        extract(out, tiny_qwen3, data, **options)
    assert "rerun the same command" in str(e.value)
    m = read_manifest(out)
    assert not m.complete and 1 <= len(m.parts) <= 2
    heal()
    for part in m.parts:  # each committed part whole on the disk, not only in memory
        path = out / part.name
        for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
            fd = os.open(file, os.O_RDONLY)
            try:
                drop_written(fd)
            finally:
                os.close(fd)
        assert verify_part(path, part.checksum) == []


def test_failures_before_any_work_name_the_file(tmp_path, tiny_qwen3, data_file):
    target = tmp_path / "target"
    shutil.copytree(tiny_qwen3, target)
    (target / "config.json").write_text("{broken")
    with pytest.raises(ExtractError, match=r"target/config.json cannot be read"):
        extract(tmp_path / "a", target, data_file)
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": None}))
    with pytest.raises(ExtractError, match=r"config.json has no integer num_hidden_layers"):
        extract(tmp_path / "a", target, data_file)
    (target / "config.json").write_text(json.dumps({**config, "model_type": "alien9"}))
    with pytest.raises(ExtractError, match=r"model_type 'alien9' is not one transformers"):
        extract(tmp_path / "a", target, data_file)
    assert not (tmp_path / "a").exists()
    shutil.copy(tiny_qwen3 / "config.json", target / "config.json")
    weights = next(target.glob("*.safetensors"))
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ExtractError, match=f"{weights.name} cannot be read"):
        extract(tmp_path / "b", target, data_file)
    with pytest.raises(ExtractError, match="/proc/nope"):
        extract(Path("/proc/nope/c"), tiny_qwen3, data_file)
    packed = tmp_path / "d.jsonl.gz"
    packed.write_bytes(gzip.compress(data_file.read_bytes()))
    with pytest.raises(ExtractError, match="d.jsonl.gz is gzip-compressed: decompress it"):
        extract(tmp_path / "c", tiny_qwen3, packed)
    with pytest.raises(ExtractError, match="given twice, its rows would be read twice"):
        run(ExtractConfig(out=tmp_path / "c", target=str(tiny_qwen3), data=(data_file, data_file)))
    r = _verify(tmp_path / "c")  # no cache was made: verify says the folder is missing
    assert r.exit_code == 1 and "no such folder" in r.output and "Traceback" not in r.output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ExtractError, match="holds no rows"):
        extract(tmp_path / "c", tiny_qwen3, empty)
    rows = [json.loads(x) for x in data_file.read_text().splitlines() if x.strip()]
    document = tmp_path / "rows.json"
    document.write_text(json.dumps(rows, indent=2))  # a JSON list, as many datasets ship
    with pytest.raises(ExtractError, match="rows.json is one JSON document .a list., not JSON"):
        extract(tmp_path / "c", tiny_qwen3, document)
    wide = tmp_path / "wide.jsonl"
    wide.write_bytes(data_file.read_text().encode("utf-16"))  # with its byte-order mark
    with pytest.raises(ExtractError, match="wide.jsonl is UTF-16 text: save it as UTF-8"):
        extract(tmp_path / "c", tiny_qwen3, wide)
    pipe = tmp_path / "rows.fifo"  # what `--data <(cmd)` or /dev/stdin gives: read once
    os.mkfifo(pipe)
    with pytest.raises(ExtractError, match="rows.fifo: not a regular file"):
        extract(tmp_path / "c", tiny_qwen3, pipe)
    assert not (tmp_path / "c").exists()


def test_a_max_length_over_the_targets_context_is_named(tmp_path, tiny_qwen3, data_file, caplog):
    context = json.loads((tiny_qwen3 / "config.json").read_text())["max_position_embeddings"]
    caplog.set_level("WARNING", logger="extract.plan")
    plan_manifest(
        ExtractConfig(out=tmp_path / "c", target=str(tiny_qwen3), data=(data_file,),
                      max_length=context + 1)
    )  # fmt: skip
    (warning,) = [r.getMessage() for r in caplog.records if "context" in r.getMessage()]
    assert f"--max-length {context + 1} is over the target's context" in warning
    assert f"give --max-length {context} or less" in warning


def test_every_row_rejected_names_the_target_or_the_option_that_caused_it(tmp_path, tiny_qwen3):
    """Good rows rejected because of the target (no chat template) or of --max-length: the
    error says so, with the template's own failure, instead of blaming the data's form."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    base = tmp_path / "base"
    shutil.copytree(tiny_qwen3, base)
    (base / "chat_template.jinja").unlink()  # a base model: no template
    r = _cli("--out", str(tmp_path / "c"), "--target", str(base), "--data", str(data))
    assert r.exit_code == 1 and f"{data}:1: template_error (" in r.output, r.output
    assert "chat_template" in r.output and "a base model has none" in r.output
    assert "--data takes JSONL" not in r.output and "Traceback" not in r.output
    r = _cli("--out", str(tmp_path / "c"), "--target", str(tiny_qwen3), "--data", str(data),
             "--max-length", "4")  # fmt: skip
    assert r.exit_code == 1 and "too_few_supervised_tokens" in r.output, r.output
    assert "a larger --max-length" in r.output and "--data takes JSONL" not in r.output
    assert not (tmp_path / "c").exists()


def test_every_row_rejected_leaves_no_cache_and_says_what_is_accepted(tmp_path, tiny_qwen3):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n" + json.dumps({"prompt": "unknown schema"}) + "\n")
    r = _cli("--out", str(tmp_path / "c"), "--target", str(tiny_qwen3), "--data", str(bad))
    assert r.exit_code == 1 and "no row of --data was kept" in r.output, r.output
    assert f"{bad}:1: malformed_json" in r.output and f"{bad}:2: unknown_schema" in r.output
    assert "its keys: ['prompt']" in r.output  # the row's own detail, not the reason alone
    assert "parquet" in r.output and "`input_ids` + `loss_mask`" in r.output
    assert "extract finished" not in r.output and "Traceback" not in r.output
    assert not (tmp_path / "c").exists()  # nothing committed: nothing left behind
    made = tmp_path / "made"
    made.mkdir()  # a folder the user made stays, empty
    r = _cli("--out", str(made), "--target", str(tiny_qwen3), "--data", str(bad))
    assert r.exit_code == 1 and made.is_dir() and list(made.iterdir()) == []


def test_parts_checked_on_several_threads_report_as_on_one(tmp_path, tiny_qwen3, data_file):
    """`extract.verify` checks parts side by side; what it finds, and its order, do not change."""
    from extract.verify import check_parts

    cache = tmp_path / "c"
    extract(cache, tiny_qwen3, data_file, rows_per_part=2)
    m = read_manifest(cache)
    names = [p.name for p in m.parts]
    assert len(names) >= 4 and check_parts(cache, m, threads=4) == []
    shutil.rmtree(cache / names[-1])
    victim = max(
        (p for p in (cache / names[1]).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    _flip(victim)
    found = check_parts(cache, m, threads=4)
    assert found == check_parts(cache, m, threads=1)
    assert {p.split(":", 1)[0] for p in found} == {names[1], names[-1]}
    assert found[0].startswith(names[1]) and found[-1] == (
        f"{names[-1]}: listed in the manifest but missing on disk"
    )


def test_processes_that_would_idle_are_warned_of():
    from extract.run import idle_ranks
    from shared.dist import DeviceSpec
    from shared.ranks import usable_cpus

    n = usable_cpus() + 1
    warned = idle_ranks(DeviceSpec("cpu", (0,) * n), 1, sharded=False)
    assert f"{n} processes for 1 parts to do: {n - 1} will have nothing" in warned[0]
    assert f"--gpus cpu:{n} runs {n} processes on {n - 1} usable cores" in warned[1]
    assert idle_ranks(DeviceSpec("cuda", (0, 1)), 4, sharded=False) == []
    assert idle_ranks(DeviceSpec("cuda", (0, 1)), 1, sharded=True) == []  # one model on both


def test_a_tar_append_that_fails_names_the_tar(tmp_path):
    # tarfile's own writes raise without a file name; the message and the I/O-error check
    # (which asks whether the file lies under the cache) need it.
    lengths = [512] * 8
    with small_disk(tmp_path / "disk", "128k") as disk:
        writer = open_part_writer(
            disk, 0, fmt="wds", store="bf16", num_layers=2, hidden_size=64, lengths=lengths
        )
        rng = np.random.default_rng(0)
        with pytest.raises(OSError) as e:  # 8 x 128 KB of noise: no codec fits it in 128 KB
            for n, length in enumerate(lengths):
                hidden = torch.from_numpy(rng.standard_normal((length, 2, 64), np.float32))
                writer.write(
                    n, sample_index=n, input_ids=np.arange(length), loss_mask=np.ones(length),
                    hidden=hidden.to(torch.bfloat16),
                )  # fmt: skip
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(writer.tmp)
        writer.abort()
        assert not list(disk.iterdir())


def test_a_tar_whose_end_finds_the_disk_full_names_it_and_is_not_committed(tmp_path):
    with small_disk(tmp_path / "disk", "1m") as disk:
        writer = open_part_writer(
            disk, 0, fmt="wds", store="bf16", num_layers=1, hidden_size=64, lengths=[64]
        )
        hidden = torch.zeros(64, 1, 64, dtype=torch.bfloat16)
        writer.write(0, sample_index=0, input_ids=np.arange(64), loss_mask=np.ones(64),
                     hidden=hidden)  # fmt: skip
        with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # the disk full before tarfile writes the tar's end
                f.write(bytes(4096))
        with pytest.raises(OSError) as e:
            writer.commit()
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(writer.tmp)
        writer.abort()
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]
