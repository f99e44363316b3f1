"""Stage one end to end on CPU with tiny targets built in code."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from extract.config import ExtractConfig
from extract.run import ExtractError, run
from shared.cache import open_part
from shared.manifest import read_manifest
from shared.target_files import load_heads, read_target_config

ROOT = Path(__file__).resolve().parents[1]


def chat(i: int, turns: int = 1) -> dict:
    msgs = [{"role": "system", "content": f"You are helper number {i}."}] if i % 3 == 0 else []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"What is {i} plus {t}?"})
        msgs.append({"role": "assistant", "content": f"{i} plus {t} is {i + t}. " * (1 + i % 4)})
    return {"messages": msgs}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    lines = [json.dumps(chat(i, 1 + i % 3)) for i in range(22)]
    lines[5] = "{not json"
    lines[9] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    lines[14] = json.dumps({"prompt": "unknown schema"})
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def qwen3(tiny_qwen3) -> Path:
    return tiny_qwen3


def extract(out: Path, target: Path, data: Path, **over) -> object:
    cfg = dict(
        out=out,
        target=str(target),
        data=(data,),
        gpus="cpu",
        rows_per_part=6,
        batch_tokens=512,
        layers="0,2,3",
        writer_threads=2,
    )
    cfg.update(over)
    return run(ExtractConfig(**cfg))


def samples_by_row(cache: Path) -> dict[int, object]:
    out = {}
    for rec in read_manifest(cache).parts:
        for s in open_part(cache / rec.name).iter_samples():
            out[s.sample_index] = s
    return out


def reference_states(
    target: Path, ids: np.ndarray, layer_ids, *, device: str = "cpu", dtype=torch.float32
) -> torch.Tensor:
    """[T, K, H] float32 on the CPU: `hidden_states[i + 1]` of a plain forward of one row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
    with torch.no_grad():
        ids_1T = torch.from_numpy(ids.astype(np.int64))[None].to(device)
        hs = model(ids_1T, output_hidden_states=True).hidden_states
    return torch.stack([hs[i + 1][0] for i in layer_ids], dim=1).float().cpu()


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_stored_states_are_hidden_states_plus_one(tmp_path, data_file, kind, request, caplog):
    """Layer 7, the last, is `hidden_states[8]`: after the final norm."""
    target = request.getfixturevalue("tiny_qwen3" if kind == "qwen3" else "tiny_qwen35")
    # A user's order is stored ascending, the order serving engines collect the states in.
    with caplog.at_level(logging.INFO):
        m = extract(tmp_path / "cache", target, data_file, batch_tokens=4096, layers="7,0,3")
    assert m.complete and m.layer_ids == (0, 3, 7) and m.config["layers"] == "0,3,7"
    assert "as a drafter's input (a tap) SGLang and vLLM cannot serve it" in caplog.text
    samples = samples_by_row(tmp_path / "cache")
    assert len(samples) == m.totals()["rows_kept"] > 10
    for row in list(samples)[:4]:
        s = samples[row]
        ref = reference_states(target, s.input_ids, m.layer_ids)
        got = s.hidden_tensor(torch.device("cpu")).float()
        assert got.shape == ref.shape
        # bf16 storage of fp32 states: 8 mantissa bits.
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_last_layer_is_stored_after_the_final_norm(tmp_path, data_file, kind, request):
    """`hidden_states[T]` of a T-layer model is taken after its final norm: so is layer T - 1."""
    target = request.getfixturevalue("tiny_qwen3" if kind == "qwen3" else "tiny_qwen35")
    last = int(read_config_layers(target)) - 1
    m = extract(tmp_path / "cache", target, data_file, layers=f"1,{last}", max_rows=8)
    samples = samples_by_row(tmp_path / "cache")
    for s in list(samples.values())[:3]:
        ref = reference_states(target, s.input_ids, m.layer_ids)
        got = s.hidden_tensor(torch.device("cpu")).float()
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_a_part_written_with_another_codec_than_the_manifest_records_names_it(
    tmp_path, qwen3, data_file
):
    """A resume by a version whose codec changed: the new part's record says which it used."""
    import shutil

    from shared.codec import codec_description
    from shared.manifest import drop_parts, write_manifest

    out = tmp_path / "cache"
    first = extract(out, qwen3, data_file, max_rows=12)
    assert len(first.parts) == 2 and all(p.codec is None for p in first.parts)
    older = {**first.codec, "compressor": {"id": "blosc", "cname": "zstd", "clevel": 1}}
    last = first.parts[-1].name
    shutil.rmtree(out / last)
    write_manifest(out, replace(drop_parts(first, {last}), codec=older))
    resumed = extract(out, qwen3, data_file, max_rows=12)
    assert resumed.complete and resumed.codec == older
    records = {p.name: p for p in resumed.parts}
    assert records[first.parts[0].name].codec is None
    assert records[last].codec == codec_description("bf16")
    assert read_manifest(out).parts == resumed.parts  # the JSON round trip keeps it
    # The key only where it is set: older versions of the tool read the other records as ever.
    raw = {p["name"]: p for p in json.loads((out / "manifest.json").read_text())["parts"]}
    assert "codec" not in raw[first.parts[0].name] and "codec" in raw[last]


def test_switch_interval_applies_while_extracting_then_is_restored(
    tmp_path, qwen3, data_file, capfd
):
    before = sys.getswitchinterval()
    extract(tmp_path / "cache", qwen3, data_file, max_rows=4, switch_interval_ms=0.5)
    assert "GIL switch interval 0.5 ms" in capfd.readouterr().err
    assert sys.getswitchinterval() == before
    for bad in (0, float("inf"), float("nan"), 5000):
        with pytest.raises(ValueError, match="--switch-interval-ms"):
            ExtractConfig(out=tmp_path / "x", switch_interval_ms=bad)


def test_the_staging_buffers_change_no_stored_bit(tmp_path, qwen3, data_file, capfd):
    extract(tmp_path / "three", qwen3, data_file, max_rows=8)
    extract(tmp_path / "two", qwen3, data_file, max_rows=8, staging_buffers=2)
    assert "2 staging buffers of" in capfd.readouterr().err
    sums = [
        {p.name: p.checksum for p in read_manifest(tmp_path / c).parts} for c in "three two".split()
    ]
    assert sums[0] == sums[1]
    with pytest.raises(ValueError, match="--staging-buffers"):
        ExtractConfig(out=tmp_path / "x", staging_buffers=1)


def read_config_layers(target: Path) -> int:
    config = json.loads((target / "config.json").read_text())
    return (config.get("text_config") or config)["num_hidden_layers"]


def test_bad_rows_are_counted_with_line_numbers(tmp_path, qwen3, data_file):
    m = extract(tmp_path / "c", qwen3, data_file)
    t = m.totals()
    assert t["rows_read"] == 22 and t["rows_kept"] + t["rows_rejected"] == 22
    assert t["rejected"] == {"malformed_json": 1, "no_assistant_turn": 1, "unknown_schema": 1}
    lines = {r.reason: r.line for p in m.parts for r in p.rejected_rows}
    assert lines == {"malformed_json": 6, "no_assistant_turn": 10, "unknown_schema": 15}


def test_target_files_are_copied(tmp_path, qwen3, data_file):
    extract(tmp_path / "c", qwen3, data_file, max_rows=4)
    embed, head = load_heads(tmp_path / "c")
    cfg = read_target_config(tmp_path / "c")
    assert embed.shape == (cfg["vocab_size"], cfg["hidden_size"]) and head.shape == embed.shape
    assert (tmp_path / "c" / "target" / "tokenizer_config.json").is_file()


def _parts_checksums(cache: Path) -> dict[str, str]:
    return {p.name: p.checksum for p in read_manifest(cache).parts}


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, qwen3, data_file):
    one = extract(tmp_path / "one", qwen3, data_file)
    two = extract(tmp_path / "two", qwen3, data_file, gpus="cpu:2")
    assert two.complete and _parts_checksums(tmp_path / "one") == _parts_checksums(tmp_path / "two")
    assert one.totals() == two.totals()


@pytest.mark.parametrize(
    "fmt, store",
    [("wds", "bf16"), ("zarr", "fp8"), ("wds", "fp8"), ("zarr", "int4"), ("wds", "int4")],
)
def test_formats_and_stores(tmp_path, qwen3, data_file, fmt, store):
    m = extract(tmp_path / "c", qwen3, data_file, format=fmt, store=store, max_rows=8)
    base = extract(tmp_path / "base", qwen3, data_file, max_rows=8)
    assert m.totals()["tokens"] == base.totals()["tokens"]
    a, b = samples_by_row(tmp_path / "c"), samples_by_row(tmp_path / "base")
    assert a.keys() == b.keys()
    for row in a:
        x = a[row].hidden_tensor(torch.device("cpu")).float()
        y = b[row].hidden_tensor(torch.device("cpu")).float()
        np.testing.assert_array_equal(a[row].input_ids, b[row].input_ids)
        tol = {"bf16": 0, "fp8": 0.07, "int4": 0.12}[store]  # int4: ~0.09 on Gaussian-like states
        assert ((x - y).norm() / y.norm()).item() <= tol


@pytest.mark.parametrize("fmt, store", [("zarr", "bf16"), ("zarr", "int4")])
def test_resume_after_kill_equals_uninterrupted(tmp_path, qwen3, data_file, fmt, store):
    full = extract(tmp_path / "full", qwen3, data_file, format=fmt, store=store)
    out = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "extract",
        "--out",
        str(out),
        "--target",
        str(qwen3),
        "--data",
        str(data_file),
        "--gpus",
        "cpu",
        "--rows-per-part",
        "6",
        "--batch-tokens",
        "512",
        "--layers",
        "0,2,3",
        "--writer-threads",
        "2",
        "--format",
        fmt,
        "--store",
        store,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # kill -9 as soon as the first part is committed
        if "committed part-" in line:
            proc.kill()
            break
    proc.wait()
    assert proc.returncode == -9
    partial = read_manifest(out)
    assert not partial.complete and 1 <= len(partial.parts) < full.num_units
    resumed = extract(out, qwen3, data_file, format=fmt, store=store)
    assert resumed.complete and resumed.codec == full.codec
    assert _parts_checksums(out) == _parts_checksums(tmp_path / "full")
    assert not list(out.glob("*.tmp"))


def test_other_settings_are_refused_then_overwritten(tmp_path, qwen3, data_file):
    extract(tmp_path / "c", qwen3, data_file, max_rows=6)
    with pytest.raises(ExtractError, match="layer_ids"):
        extract(tmp_path / "c", qwen3, data_file, max_rows=6, layers="1")
    m = extract(tmp_path / "c", qwen3, data_file, max_rows=6, layers="1", overwrite=True)
    assert m.layer_ids == (1,) and m.complete


def _cli(*args: str):
    from click.testing import CliRunner

    from extract.__main__ import main

    return CliRunner().invoke(main, list(args))


def test_attention_flash_names_a_flash_attention_that_does_not_import(
    tmp_path, qwen3, data_file, monkeypatch
):
    """flash-attn-4 installed without CUTLASS's CuTeDSL (`pip install --no-deps`): refused before
    any work, naming the import's error, not found as installed and failed in every layer."""
    cute = tmp_path / "site" / "flash_attn" / "cute"
    cute.mkdir(parents=True)
    (cute.parent / "__init__.py").write_text("")
    (cute / "__init__.py").write_text("import cutlass.cute as cute\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    out = tmp_path / "out"
    r = _cli("--out", str(out), "--data", str(data_file), "--target", str(qwen3),
             "--attention", "flash")  # fmt: skip
    sys.modules.pop("flash_attn", None)  # the stand-in's package, imported before its failure
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.output
    said = " ".join(r.output.split())
    assert "flash-attention 4 is installed but does not import" in said
    assert "No module named 'cutlass'" in said and "nvidia-cutlass-dsl" in said
    assert not out.exists()


def test_clear_errors_before_any_work(tmp_path, qwen3, data_file):
    out = tmp_path / "out"
    cases = [
        (["--target", str(tmp_path / "nope")], "--target"),
        (["--target", str(qwen3), "--layers", "0,99"], "out of range"),
        (["--target", str(qwen3), "--data", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--target", str(qwen3), "--gpus", "0-"], "--gpus"),
        (["--target", str(qwen3), "--attention", "flex"], "--attention flex has no effect: the"),
        (["--attention", "sdpa", "--packing", "off"], "has no effect with --packing off"),
        (["--attention", "flash"], "--attention flash: flash-attention 4's kernels are not"),
    ]
    for args, needle in cases:
        r = _cli("--out", str(out), "--data", str(data_file), *args)
        assert r.exit_code != 0 and needle in r.output, r.output
        assert isinstance(r.exception, SystemExit)  # a clean message, not a crash
        assert not out.exists()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    r = _cli("--out", str(a_file / "cache"), "--target", str(qwen3))
    assert r.exit_code != 0 and f"{a_file} is a file, not a folder" in r.output
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores permissions
        pytest.skip("running as root: cannot make an unwritable folder")
    r = _cli("--out", str(locked / "c"), "--target", str(qwen3))
    assert r.exit_code != 0 and "writable" in r.output


def test_verify_passes_then_names_a_corrupt_part(tmp_path, qwen3, data_file):
    extract(tmp_path / "c", qwen3, data_file, max_rows=12, layers="0,2,7")  # 7: the last
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "extract.verify", str(tmp_path / "c"), "--samples", "2"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    victim = max(
        (p for p in (tmp_path / "c" / "part-000001").rglob("*") if p.is_file()),
        key=lambda p: p.stat().st_size,
    )
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = subprocess.run(
        [sys.executable, "-m", "extract.verify", str(tmp_path / "c")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "part-000001" in bad.stderr


def test_verify_refuses_a_manifest_cut_or_edited_by_hand(tmp_path, qwen3, data_file):
    """A manifest that says complete but lists fewer parts than its rows make, and one whose
    layer ids are no ints: each a named problem, not a pass and not a traceback; the command
    verify prints finishes the cut cache."""
    from click.testing import CliRunner

    from extract.verify import main as verify

    cache = tmp_path / "c"
    extract(cache, qwen3, data_file, max_rows=12)  # 2 parts of 6 rows
    path = cache / "manifest.json"
    whole = json.loads(path.read_text())
    assert whole["complete"] and len(whole["parts"]) == 2
    path.write_text(json.dumps({**whole, "parts": whole["parts"][:1]}))
    r = CliRunner().invoke(verify, [str(cache), "--samples", "0"])
    said = "1/2 parts listed, though it says complete; not listed: part-000001)"
    assert r.exit_code == 1 and said in r.output, r.output
    extract(cache, qwen3, data_file, max_rows=12)  # what verify says to run: unit 1 again
    assert len(read_manifest(cache).parts) == 2
    assert CliRunner().invoke(verify, [str(cache), "--samples", "0"]).exit_code == 0
    path.write_text(json.dumps({**whole, "layer_ids": [0, "x", 3]}))
    r = CliRunner().invoke(verify, [str(cache)])
    assert r.exit_code == 1 and "layer_ids holds 'x', not int" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


def test_verify_rerun_catches_states_of_other_weights(tmp_path, qwen3, data_file):
    """Every checksum holds, but the target at the recorded path now has other weights: only the
    re-run can see it, layer by layer, and names the part, the sample and the layer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    target = tmp_path / "target"
    shutil.copytree(qwen3, target)
    extract(tmp_path / "c", target, data_file, max_rows=12, layers="0,2,7")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "extract.verify", str(tmp_path / "c"), "--samples", "3"]
    ok = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "relative error" in ok.stderr and "allowed" in ok.stderr  # the per-sample log line
    assert " extract.verify: " in ok.stderr and " __main__: " not in ok.stderr  # its own name
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():  # a different model: the last layer's MLP scaled
        model.model.layers[-1].mlp.down_proj.weight.mul_(3.0)
    model.save_pretrained(target)
    bad = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert bad.returncode == 1, bad.stderr
    mismatches = [line for line in bad.stderr.splitlines() if line.startswith("MISMATCH")]
    changed = mismatches.pop(0)  # first, what explains the rest: the recorded weights differ
    assert "is not the one this cache was extracted from" in changed, bad.stderr
    assert len(mismatches) == 3, bad.stderr
    # Layers 0 and 2 come before the change and still match: only layer 7 is named.
    assert all("part-" in m and "at layer 7:" in m for m in mismatches), mismatches
    assert not any("at layer 0:" in m or "at layer 2:" in m for m in mismatches)


def test_multimodal_qwen35_checkpoint_extracts_its_language_model(tmp_path, data_file, qwen3):
    """Qwen3.5/3.6 ship as vision-language checkpoints (`model.language_model.*` weights)."""
    from transformers import AutoTokenizer, Qwen3_5Config
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    target = tmp_path / "vl"
    Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=vision)
    ).save_pretrained(target)
    AutoTokenizer.from_pretrained(str(qwen3)).save_pretrained(target)
    # Layer 3 is the last: its final norm sits beside the wrapped language model's layers.
    m = extract(tmp_path / "cache", target, data_file, layers="0,3", max_rows=6)
    assert m.complete and m.target.num_layers == 4 and m.target.hidden_size == 64
    sample = next(iter(samples_by_row(tmp_path / "cache").values()))
    ref = reference_states(target, sample.input_ids, m.layer_ids)
    torch.testing.assert_close(sample.hidden_tensor().float(), ref, rtol=1e-2, atol=1e-2)
    embed, _ = load_heads(tmp_path / "cache")
    assert embed.shape == (512, 64)


@pytest.mark.parametrize("fmt", ["zarr", "wds"])
def test_the_log_says_what_the_time_after_the_last_forward_went_to(
    tmp_path, data_file, qwen3, fmt, capfd
):
    """Compression, the disk queue (zarr parts only) and the last commit, each over in turn."""
    extract(tmp_path / "c", qwen3, data_file, format=fmt, max_rows=8)
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if "after the last forward" in x)
    line = line[line.index("after the last forward") :]
    seconds = [float(w) for w in line.replace(",", " ").split() if w.replace(".", "").isdigit()]
    assert ("disk queue" in line) == (fmt == "zarr")
    assert len(seconds) == (3 if fmt == "zarr" else 2)
    assert seconds == sorted(seconds)  # each step ends after the one before it


def test_verify_names_a_webdataset_sample_by_its_number_in_the_part(
    tmp_path, qwen3, data_file, capfd
):
    """A tar's samples are in the order its writers finished them; verify's re-run reports
    sample n as the part numbers it (its zarr twin's n), with that sample's source row."""
    import re

    import torch

    from extract.verify import rerun_samples
    from tests.test_cache_wds import rewrite_tar

    cache = tmp_path / "c"
    extract(cache, qwen3, data_file, max_rows=12, format="wds")
    manifest = read_manifest(cache)
    for rec in manifest.parts:  # the samples' members in reverse order
        path = cache / rec.name
        rewrite_tar(path, path, lambda ms: sorted(ms, key=lambda m: m[0].name, reverse=True))
    capfd.readouterr()
    assert rerun_samples(cache, manifest, samples=8, seed=0, device=torch.device("cpu")) == []
    said = re.findall(r"(part-\d+\.tar) sample (\d+) \(source row (\d+)\)", capfd.readouterr().err)
    assert len(said) == 8
    for part, n, row in said:
        assert open_part(cache / part).sample_indices[int(n)] == int(row)
