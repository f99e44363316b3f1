"""The stage-independent contract: manifest round trip and checks, --gpus grammar, config CLI."""

import ast
import dataclasses
import os
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from shared.cli import build, click_options, option
from shared.dist import parse_gpus, processes_on_this_host, usable_cpus
from shared.manifest import (
    CacheMismatch,
    Manifest,
    PartRecord,
    RejectedRow,
    SourceFile,
    TargetInfo,
    read_manifest,
    update_manifest,
    write_manifest,
)
from shared.manifest_checks import check_compatible, identity_mismatches

ROOT = Path(__file__).resolve().parents[1]


def make_manifest(**over) -> Manifest:
    base = dict(
        format="zarr",
        store="bf16",
        codec={"name": "blosc"},
        target=TargetInfo(
            path="t",
            revision="sha256:ab",
            model_type="qwen3",
            num_layers=36,
            hidden_size=64,
            vocab_size=512,
            tokenizer_vocab_size=500,
        ),
        tokenizer_sha256="tok",
        chat_template_sha256="tpl",
        layer_ids=(1, 9, 17),
        max_length=3072,
        rows_per_part=4,
        sources=(SourceFile(path="a.jsonl", sha256="x", rows=10),),
        total_rows=10,
    )
    base.update(over)
    return Manifest(**base)


def part(unit: int, **over) -> PartRecord:
    base = dict(
        name=f"part-{unit:06d}",
        unit=unit,
        first_row=unit * 4,
        end_row=unit * 4 + 4,
        rows_kept=3,
        rows_truncated=1,
        rejected={"malformed_json": 1},
        rejected_rows=(
            RejectedRow(row=unit * 4, source="a.jsonl", line=unit * 4 + 1, reason="malformed_json"),
        ),
        tokens=100,
        supervised_tokens=40,
        stored_rows=192,
        nbytes=1000,
        checksum="crc32c:1",
    )
    base.update(over)
    return PartRecord(**base)


def test_manifest_round_trip_and_totals(tmp_path):
    m = make_manifest().with_part(part(1)).with_part(part(0))
    write_manifest(tmp_path, m)
    back = read_manifest(tmp_path)
    assert back == m
    assert [p.unit for p in back.parts] == [0, 1]
    assert back.num_units == 3 and list(back.unit_rows(2)) == [8, 9]
    totals = back.totals()
    assert totals["rows_read"] == 8 and totals["rejected"] == {"malformed_json": 2}
    obj = m.to_json()  # a rejected row as a later version may record it: read past its new key
    obj["parts"][0]["rejected_rows"][0]["why_later"] = "x"
    (tmp_path / "manifest.json").write_text(__import__("json").dumps(obj))
    assert read_manifest(tmp_path) == m


def test_update_manifest_replaces_a_unit(tmp_path):
    write_manifest(tmp_path, make_manifest())
    update_manifest(tmp_path, lambda m: m.with_part(part(0, tokens=5)))
    update_manifest(tmp_path, lambda m: m.with_part(part(0, tokens=7)))
    parts = read_manifest(tmp_path).parts
    assert len(parts) == 1 and parts[0].tokens == 7


def test_check_compatible_lists_every_problem():
    m = make_manifest()
    with pytest.raises(CacheMismatch) as e:
        check_compatible(m, layer_ids=[1, 2, 33], hidden_size=128)
    text = str(e.value)
    assert "incomplete" in text and "[2, 33]" in text and "hidden size" in text
    assert len(e.value.problems) == 3
    check_compatible(dataclasses.replace(m, complete=True), layer_ids=[17, 1], hidden_size=64)


def test_unknown_format_version_is_refused(tmp_path):
    obj = make_manifest().to_json()
    obj["format_version"] = 99
    (tmp_path / "manifest.json").write_text(__import__("json").dumps(obj))
    with pytest.raises(CacheMismatch, match="format version 99"):
        read_manifest(tmp_path)


def test_identity_mismatches_name_the_setting():
    a, b = make_manifest(), make_manifest(layer_ids=(1, 2), store="fp8")
    diffs = identity_mismatches(a, b)
    assert any(d.startswith("layer_ids") for d in diffs) and any("store" in d for d in diffs)
    assert identity_mismatches(a, a.with_part(part(0))) == []
    other = dataclasses.replace(a, sources=(SourceFile(path="new.jsonl", sha256="f", rows=3),))
    (diff,) = identity_mismatches(a, other)  # hashes alone would not say which files
    assert diff.startswith("sources:") and diff.endswith(
        f"data {a.sources[0].path}, this run's new.jsonl)"
    )


@pytest.mark.parametrize(
    "spec, kind, devices",
    [
        ("0-4", "cuda", (0, 1, 2, 3, 4)),
        ("0,2,5", "cuda", (0, 2, 5)),
        ("5-7", "cuda", (5, 6, 7)),
        ("cpu", "cpu", (0,)),
        ("cpu:3", "cpu", (0, 0, 0)),
        (None, "cuda", tuple(range(8))),
    ],
)
def test_parse_gpus(spec, kind, devices):
    got = parse_gpus(spec, visible=8)
    assert (got.kind, got.devices) == (kind, devices)


@pytest.mark.parametrize("spec", ["0-", "a", "3-1", "0,0", "cpu:0", "cpu:x", "9", "", " "])
def test_parse_gpus_rejects(spec):
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(spec, visible=8)


def test_no_gpus_means_cpu():
    assert parse_gpus(None, visible=0).kind == "cpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out: Path = option(help="output folder")
    layers: tuple[int, ...] = option((), help="layer ids")
    store: str = option("bf16", help="store", choices=("bf16", "fp8"))
    steps: int | None = option(None, help="steps")
    overwrite: bool = option(False, help="overwrite")

    def __post_init__(self):
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")


def _cli():
    @click.command()
    @click_options(DemoConfig)
    def main(**kw):
        click.echo(repr(build(DemoConfig, kw)))

    return main


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_usable_cpus_follows_the_affinity_mask():
    # Thread pools are sized from this: under taskset or a cpuset it must not see the whole host.
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cpus() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert usable_cpus() == len(before)


def test_processes_on_this_host_prefers_torchruns_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert processes_on_this_host(16) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # two nodes of eight
    assert processes_on_this_host(16) == 8


def test_a_one_rank_group_lives_as_long_as_its_run():
    """A run of one process that needs a process group (`--parallel fsdp=1`) makes one of its
    own; `launch` destroys it after the run, and leaves a caller's group alone."""
    import torch.distributed as dist

    from shared.dist import DeviceSpec, launch, one_rank_group

    def run(info) -> None:  # noqa: ANN001
        one_rank_group(info)
        assert dist.is_initialized() and dist.get_world_size() == 1
        seen.append(dist.get_backend())

    seen: list[str] = []
    launch(run, (), DeviceSpec("cpu", (0,)))
    assert seen == ["gloo"] and not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        launch(run, (), DeviceSpec("cpu", (0,)))
        assert dist.is_initialized()  # the caller's, kept
    finally:
        dist.destroy_process_group()


def test_cli_from_dataclass():
    r = CliRunner().invoke(_cli(), ["--out", "x", "--layers", "3", "--layers", "1", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert (
        "layers=(3, 1)" in r.output and "overwrite=True" in r.output and "store='bf16'" in r.output
    )
    r = CliRunner().invoke(_cli(), ["--out", "x", "--steps", "0"])
    assert r.exit_code == 2 and "--steps must be >= 1" in r.output
    r = CliRunner().invoke(_cli(), ["--help"])
    assert "layer ids" in r.output


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_import_boundary():
    """shared imports neither stage; the stages never import each other."""
    assert not {"extract", "train"} & _imports("shared")
    assert "train" not in _imports("extract")
    assert "extract" not in _imports("train")


def test_golden_version_1_manifest_still_reads():
    """manifests/demo-v1.json was written by `python -m extract --out shards/` (format 1)."""
    m = read_manifest_file(ROOT / "manifests" / "demo-v1.json")
    assert m.complete and m.layer_ids == (1, 2, 3, 4, 5) and m.num_units == 1
    assert m.totals()["rows_kept"] == 480 and m.parts[0].checksum.startswith("crc32c:")
    check_compatible(m, layer_ids=[5, 1], hidden_size=64)


def read_manifest_file(path: Path) -> Manifest:
    import json

    return Manifest.from_json(json.loads(path.read_text()))
