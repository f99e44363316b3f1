"""Checks of a cache's manifest against a request: another extraction's plan (its identity) or
a drafter's needs (its layers and sizes), each difference said in words."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from shared.format import FORMAT_VERSION
from shared.manifest import CacheMismatch, Manifest


def identity_mismatches(old: Manifest, new: Manifest) -> list[str]:
    """Human-readable differences between two manifests' identities; a hash's difference
    names the files it came from (the target folder, the data files) of both."""
    a, b = old.identity(), new.identity()
    out = []
    for k in (k for k in a if a[k] != b[k]):
        line = f"{k}: cache has {a[k]!r}, requested {b[k]!r}"
        if k in ("target", "tokenizer_sha256", "chat_template_sha256"):
            line += f" (the cache's target {old.target.path}, this run's {new.target.path})"
        elif k == "sources":
            paths = [", ".join(s.path for s in m.sources) for m in (old, new)]
            line += f" (the cache's data {paths[0]}, this run's {paths[1]})"
        out.append(line)
    was, now = old.target.weights_sample, new.target.weights_sample  # what `revision` misses
    if a["target"] == b["target"] and None not in (was, now) and was != now:
        out.append(
            f"target weights: the cache's target ({old.target.path}) and this run's "
            f"({new.target.path}) have the same shapes but other weights (sampled bytes differ): "
            "another checkpoint of the same model"
        )
    return out


def check_compatible(
    manifest: Manifest,
    *,
    cache: Path | str = "cache",
    layer_ids: Sequence[int] | None = None,
    hidden_size: int | None = None,
    vocab_size: int | None = None,
    require_complete: bool = True,
) -> None:
    """Raise CacheMismatch listing every reason the cache cannot serve this request."""
    problems = []
    if manifest.format_version != FORMAT_VERSION:
        problems.append(f"format version {manifest.format_version}, expected {FORMAT_VERSION}")
    if require_complete and not manifest.complete:
        done, total = len(manifest.parts), manifest.num_units
        problems.append(
            f"extraction is incomplete ({done}/{total} parts): rerun the same extract command "
            "to resume it"
        )
    if layer_ids is not None:
        missing = [i for i in layer_ids if i not in manifest.layer_ids]
        if missing:
            problems.append(
                f"target layers {missing} are not in the cache (cached: {list(manifest.layer_ids)})"
            )
        if len(set(layer_ids)) != len(layer_ids):
            problems.append(f"target layers {list(layer_ids)} repeat a layer")
    if hidden_size is not None and hidden_size != manifest.target.hidden_size:
        problems.append(
            f"hidden size {manifest.target.hidden_size} in the cache, the drafter needs "
            f"{hidden_size}"
        )
    if vocab_size is not None and vocab_size != manifest.target.vocab_size:
        problems.append(
            f"vocab size {manifest.target.vocab_size} in the cache, the drafter needs {vocab_size}"
        )
    if problems:
        raise CacheMismatch(cache, problems)
