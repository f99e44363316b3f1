"""The user's path on one GPU, end to end, through the real commands and their default options.

    python bench/e2e_gpu.py --shape qwen3-8b --tokens 1000000 --steps 200 --work /tmp/e2e

1. A target folder of the shape with random weights (`save_pretrained`, a word-level tokenizer
   built in code; `--target-layers N` keeps the first N layers, for shapes too large for the disk;
   `--target-dir /dev/shm/...` puts the whole model in memory instead).
2. Pre-tokenized rows with a long-tailed length mix like chat data: many short, some at the
   limit (64 .. 3072 tokens, 6% at 3072).
3. The plain forward of the same rows, batched as extraction batches them (its tok/s is the
   denominator of extraction's), then `python -m extract --gpus 0`, `python -m extract.verify`,
   `python -m train --gpus 0 --steps N` (export included) with default settings, and the
   fixed-shape step of `bench/train_bench.py` in the same run.

Prints one table and writes `--json`: extraction tok/s against the plain forward; training
context tok/s (real tokens, padding excluded) over the steady windows, MFU by train_bench's
count (the same shapes: one row of --batch-tokens with its anchor blocks, so the same FLOPs per
step), first-step seconds, compiled graphs after the first step and at the end, peak GPU memory,
data-wait fraction; and the fixed-shape benchmark's step as a ratio. Random weights: real speed,
not real compression ratios or acceptance. `--shape tiny --gpus cpu` runs the same path on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from e2e_forwards import forward_mfu, in_child, plain_forwards  # noqa: E402
from e2e_inputs import long_tailed_lengths, write_rows, write_target  # noqa: E402
from e2e_report import (  # noqa: E402
    disk_bound,
    extraction_figures,
    host_cpu,
    print_table,
    ratio_text,
    training_figures,
)
from shard_write import disk_rate  # noqa: E402


def verify_summary(log: Path) -> str:
    """extract.verify's closing line, and its largest error against the allowance."""
    lines = log.read_text().splitlines()
    worst = max(
        (ln for ln in lines if "relative error" in ln),
        key=lambda ln: float(ln.split("relative error ")[1].split()[0]),
        default="",
    )
    return f"{lines[-1] if lines else ''}; worst: {worst.split(': ', 1)[-1]}"


def command(args: list[str], log: Path, env: dict[str, str], check: bool = True) -> float:
    """Run one of the product's commands; its output to `log`; wall seconds. Fails loudly
    unless `check` is off (the log then tells)."""
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seconds = time.perf_counter() - start
    if done.returncode != 0 and check:
        tail = log.read_text()[-3000:]
        raise SystemExit(
            f"{' '.join(args)} failed ({done.returncode}) after {seconds:.0f} s:\n{tail}"
        )
    return seconds


def extract_command(args: argparse.Namespace, work: Path, out: Path, extra: str = "") -> list:
    """`python -m extract` of the run's target and rows into `out`, with --extract-options and
    `extra` options."""
    return [
        sys.executable, "-m", "extract", "--gpus", args.gpus, "--target", str(args.target_dir),
        "--data", str(work / "rows.jsonl"), "--out", str(out),
        *shlex.split(args.extract_options), *shlex.split(extra),
    ]  # fmt: skip


def extract_variants(
    args: argparse.Namespace, work: Path, plain_tok_s: float, env: dict[str, str]
) -> list[dict[str, Any]]:
    """`python -m extract` of the same rows with each of --also-extract's options added, into
    a fresh cache each (deleted after, for the disk): ratio to the plain forward and the split."""
    out, shards = [], work / "variant-shards"
    for k, extra in enumerate(args.also_extract):
        log = work / f"extract-variant{k}.log"
        command(extract_command(args, work, shards, extra), log, env, check=False)
        manifest = shards / "manifest.json"
        complete = manifest.is_file() and json.loads(manifest.read_text()).get("complete")
        shutil.rmtree(shards, ignore_errors=True)
        if not complete:
            # a variant that fails leaves the default's figures (the log is kept with --logs)
            out.append({"options": extra, "failed": log.read_text()[-1500:]})
            continue
        x = extraction_figures(log, plain_tok_s)
        rate = f"{x['tok_s']:,.0f} tok/s = {ratio_text(x['ratio'])} x eager"
        print(f"extraction with {extra}: {rate}", flush=True)
        keys = ("tok_s", "ratio", "ratio_until_last_forward", "staging_wait_s", "forwards")
        out.append({"options": extra, **{key: x[key] for key in (*keys, "staging")}})
    return out


def train_variants(
    args: argparse.Namespace, work: Path, shards: Path, train: dict[str, Any], env: dict[str, str]
) -> list[dict[str, Any]]:
    """`python -m train` on the same cache with each of --also-train's options added (a fresh
    run folder each, deleted after): its steady figures and its step against the default's."""
    out, skip = [], min(20, args.steps // 4)
    for k, extra in enumerate(args.also_train):
        run = work / f"run-variant{k}"
        command(
            [sys.executable, "-m", "train", "--gpus", args.gpus, "--data", str(shards),
             "--out", str(run), "--steps", str(args.steps), *shlex.split(extra)],
            work / f"train-variant{k}.log", env,
        )  # fmt: skip
        figures = training_figures(run, skip_steps=skip)
        shutil.rmtree(run)
        out.append(
            {"options": extra, **figures, "step_ratio": figures["step_ms"] / train["step_ms"]}
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--target-layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--gpus", default="0", help="the product's --gpus (cpu for a CPU check)")
    p.add_argument("--work", type=Path, default=Path("/tmp/e2e"))
    p.add_argument(
        "--target-dir",
        type=Path,
        default=None,
        help="where the target folder goes (default: in --work); e.g. /dev/shm/e2e-target for a "
        "checkpoint that does not fit the disk beside its cache; deleted at the end",
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--logs", type=Path, default=None, help="also copy the commands' logs here")
    p.add_argument("--bench-steps", type=int, default=15)
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument(
        "--also-train",
        action="append",
        default=[],
        metavar="ARGS",
        help="after the default training, train again on the same cache with these extra "
        "options (quoted, e.g. '--drafter-type dflash2'; repeatable), each its step against "
        "the default's",
    )
    p.add_argument(
        "--extract-options",
        default="",
        metavar="ARGS",
        help="extra options of the default extraction (quoted, e.g. '--store int4'): verify, "
        "training and every --also-extract run on that cache's options",
    )
    p.add_argument(
        "--also-extract",
        action="append",
        default=[],
        metavar="ARGS",
        help="with --until extract or verify: after the default extraction (and its verify), "
        "extract the same rows again "
        "with these extra options (quoted, e.g. '--switch-interval-ms 5'; repeatable), each "
        "into a fresh cache",
    )
    p.add_argument(
        "--until",
        choices=("extract", "verify", "train"),
        default="train",
        help="extract: stop after the extraction (its rows of the table only); verify: after "
        "extract.verify of its cache",
    )
    p.add_argument(
        "--disk-gb",
        type=float,
        default=8.0,
        help="first measure the cache's disk with this many GB of shard files written as "
        "extraction writes them (0: skip); the table sets extraction beside the rate it allows",
    )
    p.add_argument(
        "--no-plain-forwards",
        dest="plain_forwards",
        action="store_false",
        help="skip the matmul ceiling and the plain forwards (the ratios to eager are then "
        "n/a): for a run that measures extraction and training only, e.g. the trainer's data "
        "wait on another store",
    )
    p.add_argument(
        "--no-compiled-forward",
        dest="compiled_forward",
        action="store_false",
        help="measure the eager plain forward only (extraction's ratio and MFU need no more; "
        "saves the compiled forward's minute on the 8B shape)",
    )
    args = p.parse_args()
    if args.also_extract and args.until == "train":
        # Two caches of 1M 8B tokens and the target do not fit the H200 host's 64 GB disk.
        p.error(
            "--also-extract needs --until extract or verify (the default cache is deleted "
            "before them)"
        )
    if args.also_train and args.until == "extract":
        p.error("--also-train trains on the cache: it cannot stop at --until extract")
    work = args.work / args.shape
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    args.target_dir = args.target_dir or work / "target"
    if args.target_dir.exists():
        p.error(
            f"--target-dir {args.target_dir} exists: it is deleted at the end, so name a new one"
        )
    # `timeout` ends a run with SIGTERM: exit through Python, so the work folder (a 16 GB target,
    # caches of 27 GB) goes too, and a next command on the same host has its disk.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        benchmark(args, work)
    except BaseException:
        if not args.keep:
            clear_work(work)
        raise
    finally:
        if not args.keep:
            shutil.rmtree(args.target_dir, ignore_errors=True)


def benchmark(args: argparse.Namespace, work: Path) -> None:
    """The whole benchmark into `work` (see the module's docstring)."""
    cuda = args.gpus != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    times: dict[str, float] = {}
    t = time.perf_counter()
    disk = disk_rate(work, args.disk_gb)
    times["disk"] = time.perf_counter() - t
    t = time.perf_counter()
    target = args.target_dir
    cfg = in_child(write_target, args.shape, target, args.target_layers, device.type)
    times["target"] = time.perf_counter() - t
    lengths = long_tailed_lengths(args.tokens, seed=0)
    rows = work / "rows.jsonl"
    write_rows(rows, lengths, cfg["vocab_size"] - 293, seed=0)
    forwards = {}
    if args.plain_forwards:
        forwards = plain_forwards(target, rows, device, compiled=args.compiled_forward)
    times["plain_forwards"] = time.perf_counter() - t - times["target"]
    plain_tok_s = forwards["plain_forward"]["tok_s"] if forwards else math.nan
    shards, run = work / "shards", work / "run"
    times["extract"] = command(extract_command(args, work, shards), work / "extract.log", env)
    x = extraction_figures(work / "extract.log", plain_tok_s)
    print(f"extraction {x['tok_s']:,.0f} tok/s = {ratio_text(x['ratio'])} x eager", flush=True)
    tokens = x["tokens"]
    manifest = json.loads((shards / "manifest.json").read_text())
    if args.until != "extract":  # before the variants, which need the default cache's disk
        verify = [py, "-m", "extract.verify", str(shards)]
        times["verify"] = command(verify, work / "verify.log", env, check=args.until == "train")
        verified = verify_summary(work / "verify.log")
    if args.also_extract:  # --until extract or verify: the default cache has given its figures
        shutil.rmtree(shards)
    variants = extract_variants(args, work, plain_tok_s, env) if args.also_extract else []
    result = {
        "shape": args.shape,
        "extract_options": args.extract_options,
        "target_layers": cfg["num_hidden_layers"],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "host_cpu": host_cpu(),
        "rows": len(lengths),
        "tokens": tokens,
        "lengths": {"min": min(lengths), "max": max(lengths), "at_max": lengths.count(3072)},
        "plain_forward_tok_s": plain_tok_s,
        **forwards,
        **(forward_mfu(forwards, x) if forwards else {}),
        "extract_compile": x["compile"],
        "extract_s": x["seconds"],
        "extract_tok_s": x["tok_s"],
        "extract_ratio": x["ratio"],
        "extract_forwards_s": x["forwards_s"],
        "extract_staging_wait_s": x["staging_wait_s"],
        "extract_ratio_until_last_forward": x["ratio_until_last_forward"],
        "extract_forwards": x["forwards"],
        "extract_end": x["end"],
        "extract_staging": x["staging"],
        "extract_filesystem": x["filesystem"],
        "extract_variants": variants,
        "stored_bytes_per_token": sum(r["nbytes"] for r in manifest["parts"]) / tokens,
    }
    result["disk"] = disk and disk_bound(disk, result["stored_bytes_per_token"], plain_tok_s)
    if args.until != "extract":
        result["verify"] = verified
    if args.until != "train":
        result["wall_s"] = times
        finish(result, args, work)
        return
    shutil.rmtree(target)  # the trainer never reads it; the disk is needed for runs
    times["train"] = command(
        [py, "-m", "train", "--gpus", args.gpus, "--data", str(shards), "--out", str(run),
         "--steps", str(args.steps)],
        work / "train.log", env,
    )  # fmt: skip
    train = training_figures(run, skip_steps=min(20, args.steps // 4))
    saved = json.loads((run / "config.json").read_text())
    export_ok = (run / "export" / "model.safetensors").is_file()
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # the disk, for the variants' runs
    also_train = train_variants(args, work, shards, train, env)
    shutil.rmtree(shards)
    bench_json = work / "train_bench.json"
    command(
        [py, "bench/train_bench.py", "--shape", args.shape, "--steps", str(args.bench_steps),
         "--warmup", "4", "--json", str(bench_json), "--workdir", str(work / "bench")],
        work / "train_bench.log", env,
    )  # fmt: skip
    bench = json.loads(bench_json.read_text())
    same_shape = (bench["seq_len"], bench["anchors"]) == (
        saved["train"]["batch_tokens"],
        saved["train"]["num_anchors"],
    )
    mfu = bench["mfu"] * bench["step_ms"] / train["step_ms"] if same_shape else None
    result |= {
        "train": train,
        "train_settings": {
            k: saved["train"][k]
            for k in (
                "attention",
                "compile",
                "ce",
                "grad_ckpt",
                "batch_tokens",
                "num_anchors",
                "workers",
            )
        },  # fmt: skip
        "export_written": export_ok,
        "train_variants": also_train,
        "fixed_shape": {k: bench[k] for k in ("step_ms", "context_tok_s", "mfu", "first_step_s")},
        "tok_s_ratio_to_fixed_shape": train["context_tok_s"] / bench["context_tok_s"],
        "mfu_bench_count": mfu,
        "wall_s": times,
    }
    finish(result, args, work)


def clear_work(work: Path) -> None:
    """Delete everything in `work` but the commands' logs."""
    for path in work.iterdir():
        if path.suffix != ".log":
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()


def finish(result: dict[str, Any], args: argparse.Namespace, work: Path) -> None:
    """Write --json, clear the work folder unless --keep (the logs stay), copy the logs to
    --logs, print the table."""
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not args.keep:
        clear_work(work)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copy2(log, args.logs / f"{args.shape}-{log.name}")
    print_table(result)


if __name__ == "__main__":
    main()
