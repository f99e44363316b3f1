"""Stage two never continues on non-finite values and refuses options that cannot work."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from shared.manifest import read_manifest, write_manifest
from shared.space import DiskFull
from shared.target_files import EMBED_FILE, target_checksums, target_dir
from tests.cachegen import write_cache
from tests.test_train_loop import tiny
from train.__main__ import main
from train.checkpoint import list_checkpoints
from train.finite import FiniteGuard, NonFiniteError
from train.run import run


@pytest.fixture()
def cache(tmp_path):
    return write_cache(tmp_path / "cache", num_parts=2, samples_per_part=6)


def poison_embedding(cache):
    """A target whose embedding holds NaN (recorded as such: the files are not damaged)."""
    path = target_dir(cache) / EMBED_FILE
    tensors = load_file(str(path))
    tensors["embed_tokens"][:] = float("nan")
    save_file(tensors, str(path))
    m = read_manifest(cache)
    write_manifest(cache, dataclasses.replace(m, target_files=target_checksums(cache)))


def test_guard_records_the_first_bad_step_without_reading_back(tmp_path):
    guard = FiniteGuard(torch.device("cpu"), every=4, total=10, data=tmp_path, out=tmp_path)
    one = torch.tensor(1.0)
    for step, loss in enumerate([1.0, 2.0, float("inf"), float("nan")], start=1):
        guard.add(torch.tensor(loss), one)
        guard.observe(step, torch.tensor(0.5))
    with pytest.raises(NonFiniteError, match="from step 3 .seen at step 4"):
        guard.check(4)
    ok = FiniteGuard(torch.device("cpu"), every=1, total=2, data=tmp_path, out=tmp_path)
    ok.add(torch.tensor(1.0), one)
    ok.observe(1, torch.tensor(float("nan")))  # a non-finite gradient norm alone
    with pytest.raises(NonFiniteError):
        ok.check(1)
    empty = FiniteGuard(torch.device("cpu"), every=1, total=2, data=tmp_path, out=tmp_path)
    empty.add(torch.tensor(0.0), torch.tensor(0.0))
    empty.observe(1, torch.tensor(0.0))
    with pytest.raises(NonFiniteError, match="no target token"):
        empty.check(1)


def test_nan_stops_the_run_keeping_the_last_good_checkpoint(cache, tmp_path):
    out = tmp_path / "run"
    kw = dict(steps=8, checkpoint_every=2, log_every=4)
    run(tiny(cache, out, stop_after_steps=2, **kw))
    assert [s for s, _ in list_checkpoints(out)] == [2]
    poison_embedding(cache)
    with pytest.raises(NonFiniteError, match="from step 3 .seen at step 4.*step-2") as e:
        run(tiny(cache, out, **kw))
    assert "extract.verify" in str(e.value) and "--lr" in str(e.value)
    assert [s for s, _ in list_checkpoints(out)] == [2]  # nothing saved after the bad step
    assert not (out / "export").exists()


def test_nan_on_two_ranks_is_one_clean_message(cache, tmp_path):
    poison_embedding(cache)
    args = ["--data", str(cache), "--out", str(tmp_path / "r"), "--gpus", "cpu:2"]
    args += ["--drafter-layers", "1", "--block-size", "4", "--num-anchors", "8", "--workers", "0"]
    args += ["--batch-tokens", "512", "--steps", "2", "--log-every", "1", "--eval-fraction", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "not finite" in r.output and "from step 1" in r.output, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "r" / "export").exists()


def test_options_that_cannot_work_name_their_flag(cache, tmp_path):
    base = ["--data", str(cache), "--out", str(tmp_path / "r"), "--gpus", "cpu"]
    for args, needle in [
        (["--block-size", "0"], "--block-size: must be >= 2"),
        (["--block-size", "1"], "--block-size: must be >= 2"),
        (["--block-size", "600", "--batch-tokens", "512"], "must be at most --batch-tokens (512)"),
        (["--max-length", "1"], "--max-length: must be at least --block-size (16)"),
        (["--layer-types", "nope"], "--layer-types: unknown"),
        (["--mask-token-id", "-1"], "--mask-token-id: must be >= 0"),
        (["--layer-types", "full", "--sliding-window", "64"], "--sliding-window: has no effect"),
        (["--target-layers", "1,1"], "--target-layers: names a layer twice (1,1)"),
    ]:
        r = CliRunner().invoke(main, base + args)
        assert r.exit_code == 2 and needle in r.output, (args, r.output)
        assert "block_size" not in r.output and "max_length" not in r.output


def test_a_drafter_shape_the_options_cannot_make_names_them_not_the_cache(cache, tmp_path):
    out = tmp_path / "r"
    base = ["--data", str(cache), "--out", str(out), "--gpus", "cpu", "--drafter-layers", "1"]
    for args, needle in [
        (
            ["--drafter-heads", "3", "--drafter-kv-heads", "2"],
            "num_key_value_heads (2) must divide num_attention_heads (3) (set by "
            "--drafter-heads, --drafter-kv-heads)",
        ),
        (["--drafter-head-dim", "7"], "head_dim must be even for RoPE, got 7 (set by "),
        (["--mask-token-id", "999999"], "(set by --mask-token-id)"),
        (["--drafter-type", "dspark", "--is-causal", "true"], "(set by --is-causal)"),
    ]:
        r = CliRunner().invoke(main, base + args)
        assert r.exit_code == 1, (args, r.output)
        assert "the drafter options make no drafter: " in r.output and needle in r.output, r.output
        assert "cannot be used" not in r.output and not out.exists()


def test_extract_refuses_more_layers_than_the_target_has(tmp_path, tiny_qwen3):
    from extract.__main__ import main as extract_main

    args = ["--out", str(tmp_path / "c"), "--target", str(tiny_qwen3), "--num-layers", "20"]
    r = CliRunner().invoke(extract_main, args)
    assert r.exit_code == 1 and "--num-layers 20" in r.output and "--layers" in r.output
    assert "use --num-layers 5 or less" in r.output  # the most the rule gives distinct
    assert not (tmp_path / "c").exists()


def test_an_output_that_cannot_be_made_is_one_message(cache):
    args = ["--data", str(cache), "--out", "/proc/nope/run", "--gpus", "cpu", "--workers", "0"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "/proc/nope" in r.output and "Traceback" not in r.output


def test_a_warm_start_that_cannot_be_read_is_named_before_the_run_folder(
    cache, tmp_path, tiny_qwen3
):
    base = tmp_path / "base"
    run(tiny(cache, base, steps=2, checkpoint_every=2))
    step, export = base / "checkpoints" / "step-2", base / "export"
    sources = {name: tmp_path / name for name in ("cut", "bare", "state", "meta", "old")}
    for name in ("cut", "bare"):
        shutil.copytree(export, sources[name])
    for name in ("state", "meta", "old"):
        shutil.copytree(step, sources[name])
    weights = sources["cut"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    (sources["bare"] / "model.safetensors").unlink()
    for name in ("state", "old"):
        state = sources[name] / "state.pt"
        state.write_bytes(state.read_bytes()[:5000])
    (sources["meta"] / "meta.json").write_text("{bad")
    meta = json.loads((step / "meta.json").read_text())
    del meta["state"]  # a checkpoint saved before they recorded their state's size and crc32c
    (sources["old"] / "meta.json").write_text(json.dumps(meta))
    args = [
        "--data", str(cache), "--gpus", "cpu", "--workers", "0", "--drafter-layers", "1",
        "--block-size", "4", "--num-anchors", "8", "--batch-tokens", "512", "--steps", "2",
    ]  # fmt: skip
    for source, named in [
        (sources["cut"], f"{weights} is damaged ("),
        (sources["bare"], f"{sources['bare'] / 'model.safetensors'} is missing; export it again"),
        (sources["state"], f"{sources['state'] / 'state.pt'} is damaged"),
        (sources["meta"], f"{sources['meta'] / 'meta.json'} cannot be read"),
        (tiny_qwen3, "is not a drafter export: its config.json has no num_target_layers"),
        (sources["old"], f"{sources['old'] / 'state.pt'}"),  # found by the rank reading it
    ]:
        out = tmp_path / "warm"
        r = CliRunner().invoke(main, [*args, "--out", str(out), "--init-from", str(source)])
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
        assert f"Error: --init-from {source}" in r.output and named in r.output, r.output
        assert "--out" not in r.output and "Traceback" not in r.output
        if source != sources["old"]:
            assert not out.exists()  # nothing written: the corrected command is not refused
        shutil.rmtree(out, ignore_errors=True)


def _tree_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_a_full_disk_at_the_last_checkpoint_exports_and_keeps_the_last_good_one(
    cache, tmp_path, monkeypatch
):
    """The run folder's disk is simulated at the OS query: `capacity` bytes, less what the run
    folder holds. Step 2's checkpoint fits; the last one (written before step 2's is pruned)
    does not; the export, several times smaller, does."""
    args = ["--data", str(cache), "--gpus", "cpu", "--drafter-layers", "1", "--block-size", "4"]
    args += ["--num-anchors", "8", "--batch-tokens", "512", "--workers", "0", "--steps", "4"]
    args += ["--checkpoint-every", "2", "--log-every", "1", "--eval-fraction", "0"]
    probe = tmp_path / "probe"
    assert CliRunner().invoke(main, [*args, "--out", str(probe)]).exit_code == 0
    ckpt = _tree_bytes(list_checkpoints(probe)[-1][1])
    out = tmp_path / "run"
    capacity = ckpt + (1 << 20) + ckpt // 2  # room for one checkpoint and a half
    real = shutil.disk_usage

    def small_disk(path):
        usage = real(path)
        used = _tree_bytes(out) if out.is_dir() else 0
        return usage._replace(free=max(0, capacity - used))

    monkeypatch.setattr(shutil, "disk_usage", small_disk)
    r = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"the disk holding {out} is full: checkpoint step-4 needs about" in r.output
    assert f"the newest checkpoint kept is {out}/checkpoints/step-2" in r.output
    assert f"exported to {out}/export" in r.output
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert not list((out / "checkpoints").glob(".step-*"))  # nothing half-written left
    monkeypatch.setattr(shutil, "disk_usage", real)  # space freed: the same command resumes
    r = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert r.exit_code == 0 and "resumed from" in r.output and "step 2" in r.output, r.output
    assert list_checkpoints(out)[-1][0] == 4 and (out / "export").is_dir()


def test_torch_saves_failing_for_want_of_room_is_the_same_message(tmp_path, monkeypatch):
    """On a real full file system (a tmpfs of 2 MB; skipped where none can be mounted) torch's
    writer fails with `RuntimeError: ... unexpected pos`; the checkpoint before stays."""
    from tests.drafters import tiny_drafter_config
    from tests.test_extract_safety import small_disk
    from train.checkpoint import save_checkpoint

    cfg = tiny_drafter_config()
    with small_disk(tmp_path / "disk", "2m") as disk:
        save_checkpoint(disk, 1, {"model": {"w": torch.zeros(100_000)}}, cfg, keep=1)
        real = shutil.disk_usage
        asked = []

        def roomy_once(path):  # the space another writer was about to take still looked free
            asked.append(path)
            usage = real(path)
            return usage._replace(free=usage.free + (8 << 20)) if len(asked) == 1 else usage

        monkeypatch.setattr(shutil, "disk_usage", roomy_once)
        with pytest.raises(DiskFull, match="checkpoint step-2 needs about 3.0 MB") as e:
            save_checkpoint(disk, 2, {"model": {"w": torch.zeros(500_000)}}, cfg, keep=1)
        assert f"newest checkpoint kept is {disk}/checkpoints/step-1" in str(e.value)
        assert [s for s, _ in list_checkpoints(disk)] == [1]
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step-1"]


def test_out_that_is_a_file_or_read_only_names_out(cache, tmp_path):
    from tests.test_extract_safety import small_disk

    base = ["--data", str(cache), "--gpus", "cpu", "--workers", "0"]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    r = CliRunner().invoke(main, [*base, "--out", str(a_file)])
    assert r.exit_code == 1 and f"--out {a_file}: {a_file} is a file, not a folder" in r.output
    with small_disk(tmp_path / "ro", "1m", read_only=True) as disk:
        r = CliRunner().invoke(main, [*base, "--out", str(disk / "run")])
        assert r.exit_code == 1 and f"--out {disk}/run: {disk} is not a writable folder" in r.output
        assert "read-only file system" in r.output and "Traceback" not in r.output


def test_a_cache_without_its_target_files_names_them_and_the_repair_once(tmp_path):
    from shared.manifest import CacheMismatch

    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=4)
    shutil.rmtree(target_dir(cache))
    with pytest.raises(CacheMismatch) as e:
        run(tiny(cache, tmp_path / "r"))
    said = str(e.value)
    assert said.count("python -m extract.verify") == 1 and "to repair them: run `" in said
    assert said.count("\n  - ") >= 3, said  # each missing file its own line


def test_an_out_folder_of_other_files_is_refused(cache, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = CliRunner().invoke(main, ["--data", str(cache), "--out", str(out), "--gpus", "cpu"])
    assert r.exit_code == 1 and "holds files but no training run (notes.txt)" in r.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    killed = tmp_path / "killed"  # a run killed inside its first config.json write
    killed.mkdir()
    (killed / ".config.json.tmp.4242.1").write_text("{")
    args = ["--data", str(cache), "--out", str(killed), "--gpus", "cpu", "--drafter-layers", "1"]
    r = CliRunner().invoke(main, [*args, "--batch-tokens", "512", "--steps", "1"])
    assert r.exit_code == 0 and (killed / "export").is_dir(), r.output
    (killed / "config.json").unlink()  # a run folder that lost its record still resumes
    r = CliRunner().invoke(main, [*args, "--batch-tokens", "512", "--steps", "1"])
    assert r.exit_code == 0, r.output


def test_data_that_will_never_be_a_cache_is_refused_at_once(tmp_path):
    """--follow waits for an extraction to start writing --data; a file, or a folder of
    files no extraction writes, never will be one: refused at once, not after the wait."""
    from shared.manifest import CacheMismatch
    from train.follow_start import never_a_cache

    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    with pytest.raises(CacheMismatch, match="a file, not a cache folder"):
        run(tiny(afile, tmp_path / "r"))
    with pytest.raises(CacheMismatch, match=r"files no extraction writes \(notes.txt\)"):
        run(tiny(tmp_path, tmp_path / "r"))
    starting = tmp_path / "starting"
    starting.mkdir()
    (starting / ".lock").write_text("")
    assert never_a_cache(starting) is None and never_a_cache(tmp_path / "later") is None
    cache = write_cache(tmp_path / "c", num_parts=2, samples_per_part=4)
    for given in (cache / "part-000000", cache / "manifest.json"):
        with pytest.raises(CacheMismatch, match=f"a part of the cache {cache}, not a cache"):
            run(tiny(given, tmp_path / "r"))


def test_a_run_folder_inside_the_cache_is_refused(cache, tmp_path):
    from shared.manifest import enclosing_cache
    from train.run import RunError

    for out in (cache, cache / "runs" / "a"):
        with pytest.raises(RunError, match=f"is in the cache {cache} \\(--data\\)"):
            run(tiny(cache, out))
    assert not (cache / "runs").exists() and not (cache / "config.json").exists()
    other = tmp_path / "other"  # another cache, as --out: extract could no longer overwrite it
    shutil.copytree(cache, other)
    for out in (other, other / "runs" / "a"):
        with pytest.raises(RunError, match=f"is in the cache {other} \\(it holds manifest.json"):
            run(tiny(cache, out))
    assert sorted(p.name for p in other.iterdir()) == sorted(p.name for p in cache.iterdir())
    web = tmp_path / "web"  # another tool's manifest.json makes no cache
    web.mkdir()
    (web / "manifest.json").write_text('{"name": "app", "parts": []}')
    assert enclosing_cache(web / "runs" / "a") is None and enclosing_cache(other / "a") == other


def test_a_full_disk_under_the_metrics_names_the_file(tmp_path):
    """A write's own error names no file; the message of a full disk should say which one."""
    import errno

    from train.metrics import METRICS_FILE, MetricsWriter

    (tmp_path / METRICS_FILE).symlink_to("/dev/full")  # every write: ENOSPC
    writer = MetricsWriter(tmp_path, enabled=True)
    with pytest.raises(OSError) as e:
        writer.write({"kind": "train", "step": 1, "loss": 1.0})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / METRICS_FILE)
    if writer.tb is not None:
        writer.tb.close()


def test_a_full_disk_at_the_export_is_one_message_and_the_rerun_exports(cache, tmp_path):
    """The last checkpoint fits (its estimate leaves 1 MB), the export after it (bf16 weights of
    a drafter with a wide MLP: more than 1 MB) does not: the run says which file the full disk
    stopped, and the same command exports once there is room, from the checkpoint saved."""
    import subprocess

    from tests.test_extract_safety import small_disk

    wide = tiny(cache, tmp_path / "probe", steps=2, drafter_intermediate=4096)
    run(wide)
    ckpt = _tree_bytes(list_checkpoints(wide.out)[-1][1])
    with small_disk(tmp_path / "disk", f"{ckpt + (1 << 20) + (128 << 10)}") as disk:
        cfg = wide.replace(out=disk / "run")
        with pytest.raises(DiskFull, match=r"export/model\.safetensors\. Free space there"):
            run(cfg)
        assert [s for s, _ in list_checkpoints(cfg.out)] == [2]
        assert not (cfg.out / "export").exists() and not list(cfg.out.glob(".export.tmp-*"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        run(cfg)
        assert (cfg.out / "export" / "model.safetensors").is_file()
