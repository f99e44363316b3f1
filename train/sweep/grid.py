"""The grid of a sweep: which train options vary, over which values, and the run of each
(variant, seed) as the `python -m train` arguments that train it.

Every variant reads the same cache with the same held-out rows and the same step budget: the
options that decide those (and the ones the sweep sets itself) cannot vary.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import click

from shared.cli import build
from shared.manifest import Manifest, manifest_path, read_manifest, refuse_inside_cache
from train.cache_fit import fit_cache
from train.config import TrainConfig
from train.follow_start import never_a_cache

RUNS_DIR = "runs"
SWEEP_FILE = "sweep.json"  # its runs' train options and cache, and the last command run there
# Set by the sweep for every run, or deciding the held-out rows and the budget: never varied.
FIXED = frozenset(
    {"data", "out", "seed", "gpus", "resume", "stop_after_steps", "follow"}
    | {"eval_fraction", "eval_parts", "eval_batches", "eval_every"}
    | {"steps", "epochs", "batch_tokens", "grad_accum", "max_length"}
)
SET_BY_SWEEP = ("data", "out", "seed", "gpus")
# Train options that would break the sweep's own resume (every run resumes from its newest
# checkpoint, `--resume auto`, and ends with its export).
NOT_FOR_SWEEPS = ("resume", "stop_after_steps")


class GridError(ValueError):
    """The grid or the train options cannot make a sweep; the message says why."""


@dataclass(frozen=True)
class Variant:
    """One point of the grid: (train field, value as given) pairs, in --vary order."""

    settings: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """'optimizer=muon,lr=1e-3' (the folder of its runs; '/' written as '_')."""
        text = ",".join(f"{k}={v}" for k, v in self.settings) or "base"
        return text.replace("/", "_")

    def args(self) -> list[str]:
        """The settings as train options: `--name value`, or `--flag`/`--no-flag` for a bool."""
        out: list[str] = []
        for key, value in self.settings:
            flag = "--" + key.replace("_", "-")
            if _is_flag(key):
                out.append(flag if _truth(key, value) else "--no-" + flag[2:])
            else:
                out += [flag, value]
        return out


@dataclass(frozen=True)
class Job:
    """One training run of the sweep."""

    variant: Variant
    seed: int
    folder: Path
    argv: tuple[str, ...]  # `python -m train` options, all but --gpus


def parse_vary(texts: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """['optimizer=adamw,muon', 'target-layers=0,1;1,3'] -> [(field, values)]: values split on
    ',' (on ';' where the text has one, for values that hold commas).

    >>> parse_vary(["optimizer=adamw,muon", "target-layers=0,1;1,3"])
    [('optimizer', ['adamw', 'muon']), ('target_layers', ['0,1', '1,3'])]
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    out, seen = [], set()
    for text in texts:
        key, eq, values = text.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not eq or not values.strip():
            raise GridError(f"--vary {text!r}: expected NAME=V1,V2 (e.g. optimizer=adamw,muon)")
        if key not in fields:
            raise GridError(f"--vary {text!r}: {key!r} is no option of python -m train")
        if key in FIXED:
            raise GridError(
                f"--vary {text!r}: {key} is the same for every run of a sweep (the cache, "
                "held-out rows, budget and seeds are; use --seeds for seeds)"
            )
        if key in seen:
            raise GridError(f"--vary {key} given twice")
        seen.add(key)
        split = ";" if ";" in values else ","
        items = [v.strip() for v in values.split(split)]
        if len(items) > 1 and items[-1] == "":  # a trailing separator: one comma-holding value
            items.pop()
        if "" in items:
            raise GridError(f"--vary {text!r} has an empty value (two {split!r} in a row?)")
        if len(set(items)) != len(items):
            raise GridError(f"--vary {text!r} names a value twice")
        out.append((key, items))
    return out


def variants(grid: list[tuple[str, list[str]]]) -> list[Variant]:
    """Every combination, the last --vary changing fastest."""
    keys = [k for k, _ in grid]
    return [
        Variant(tuple(zip(keys, combo, strict=True)))
        for combo in itertools.product(*(v for _, v in grid))
    ]


def plan_jobs(
    *, data: Path, out: Path, grid: list[tuple[str, list[str]]], seeds: int, train_args: list[str]
) -> list[Job]:
    """The sweep's runs, variant by variant, seeds 0..seeds-1, each checked as train would
    check it (a bad option or value is a GridError naming the variant) before any runs."""
    given = {
        a.split("=")[0].lstrip("-").replace("-", "_") for a in train_args if a.startswith("--")
    }
    given |= {g[3:] for g in given if g.startswith("no_")}
    clash = sorted(given & ({k for k, _ in grid} | set(SET_BY_SWEEP)))
    if clash:
        raise GridError(
            f"train options {', '.join(clash)}: set by the sweep (--data, --out, --seeds, --gpus) "
            "or varied by --vary; give them there"
        )
    refused = sorted(given & set(NOT_FOR_SWEEPS))
    if refused:
        raise GridError(
            f"train options {', '.join('--' + k.replace('_', '-') for k in refused)}: not for a "
            "sweep, which resumes each run from its newest checkpoint (--resume auto) until it "
            "has its export; drop them"
        )
    inside = refuse_inside_cache(out, data)
    if inside:
        raise GridError(inside)
    jobs = []
    manifest = read_manifest(data) if manifest_path(data).is_file() else None  # none yet: follows
    if manifest is None and (never := never_a_cache(Path(data))):
        raise GridError(f"--data {data}: {never}")
    names: dict[str, Variant] = {}
    for variant in variants(grid):
        if (same := names.setdefault(variant.name, variant)) is not variant:
            raise GridError(
                f"variants {same.settings} and {variant.settings} would share the run folder "
                f"{variant.name}: give values that differ by more than '/' and '_'"
            )
    trains: dict[TrainConfig, Variant] = {}  # a value written two ways: one variant twice
    for variant in variants(grid):
        for seed in range(seeds):
            folder = Path(out) / RUNS_DIR / variant.name / f"seed-{seed}"
            argv = ["--data", str(data), "--out", str(folder), "--seed", str(seed)]
            argv += [*train_args, *variant.args()]
            if seed == 0:
                cfg = check(variant, argv)
                check_cache(variant, cfg, manifest)
                same = trains.setdefault(cfg.replace(out=Path(out)), variant)
                if same is not variant:
                    raise GridError(
                        f"variants {same.name} and {variant.name} train the same runs (one "
                        "value written two ways): give it once"
                    )
            jobs.append(Job(variant, seed, folder, tuple(argv)))
    return jobs


def runs_outside(out: Path, jobs: list[Job]) -> list[str]:
    """The run folders in the sweep folder that are none of `jobs` (those of an earlier command
    there with another grid or more seeds), as 'VARIANT seed S'."""
    ours = {job.folder for job in jobs}
    found = sorted(p for p in (Path(out) / RUNS_DIR).glob("*/seed-*") if p not in ours)
    return [f"{p.parent.name} seed {p.name.removeprefix('seed-')}" for p in found if p.is_dir()]


def check(variant: Variant, argv: list[str]) -> TrainConfig:
    """The TrainConfig `python -m train argv` would build; GridError naming the variant."""
    from train.__main__ import main

    try:
        with main.make_context("python -m train", [*argv, "--gpus", "cpu"]) as ctx:
            return build(TrainConfig, ctx.params)
    except click.ClickException as e:
        raise GridError(f"variant {variant.name}: {e.format_message()}") from None


def check_cache(variant: Variant, cfg: TrainConfig, manifest: Manifest | None) -> None:
    """GridError naming the variant when the cache cannot serve it (its layers, its family's
    needs), as `python -m train` would find when its run starts."""
    if manifest is None:
        return
    problems = fit_cache(cfg, manifest, complete=False, target_files=False)[3]  # each run does
    if problems:
        raise GridError(f"variant {variant.name}: the cache {cfg.data}: " + "; ".join(problems))


def _is_flag(key: str) -> bool:
    """Whether train's option for field `key` is an on/off flag."""
    return any(f.name == key and f.type in ("bool", bool) for f in dataclasses.fields(TrainConfig))


def _truth(key: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off"):
        return False
    raise GridError(f"--vary {key}: {value!r} is not true or false")


def read_record(out: Path) -> dict | None:
    """The sweep folder's record (`sweep.json`), None for a new folder; GridError where it
    cannot be read."""
    path = Path(out) / SWEEP_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        record = e
    if isinstance(record, dict):
        return record
    why = record if isinstance(record, Exception) else "not a JSON object"
    raise GridError(
        f"{path} cannot be read ({why}): it records the train options and the cache of the "
        "runs in this folder. Restore it, or delete it to take the runs there as runs of this "
        "command unchecked"
    )


def check_same_sweep(old: dict | None, *, data: Path, train_args: list[str]) -> None:
    """GridError when the sweep folder's record (`sweep.json`, None for a new folder) was made
    with other train options or another cache: its finished runs would be reused and reported
    as runs of this command. Another grid or more seeds only add runs, and are taken."""
    if old is None:
        return
    if _as_train_reads(old.get("train_args")) != _as_train_reads(list(train_args)):
        raise GridError(
            f"this sweep folder's runs were trained with the train options {old.get('train_args')}"
            f", not {list(train_args)}: its finished runs would be reported as runs of these. "
            "Give the same options, or another --out"
        )
    if "data" in old and Path(old["data"]) != Path(data).resolve():
        raise GridError(
            f"this sweep folder's runs were trained on {old['data']}, not {Path(data).resolve()}:"
            " give that cache, or another --out"
        )


def _as_train_reads(args: object) -> object:
    """The option values `python -m train args` reads (the same options in another order, or
    a value written another way, read the same); `args` itself where train refuses them."""
    from train.__main__ import main

    if not isinstance(args, list):
        return args
    try:
        with main.make_context("python -m train", ["--data", ".", "--out", ".", *args]) as ctx:
            return ctx.params
    except click.ClickException:
        return args
