"""Stage one and stage two at once on one device, through the real commands: the trainer follows
the extraction while it writes the cache.

    python bench/e2e_follow.py --shape qwen3-8b --tokens 1000000 --steps 400 --gpus 0 \
        --extract-args "--rows-per-part 64" --train-args "--shuffle-buffer 256"

1. The inputs of `bench/e2e_gpu.py`: a random-weight target folder of the shape and pre-tokenized
   rows with its long-tailed length mix.
2. `python -m extract --gpus G --out shards/` and at once `python -m train --gpus G --data
   shards/ --out run/ --steps N` (default settings otherwise): both on the same device. Every
   line of both logs is timed from the extraction's start.
3. `python -m extract.verify shards/`.

Prints one table and writes `--json`: when the first part was committed; when the trainer had its
first step's rows (its "following the extraction" line); when its first optimizer step began and
ended (its "first step: S s" line, compilation included); when each command ended; extraction
tok/s by its own count (target loading excluded) while sharing the device; training context tok/s,
step time and data-wait fraction over the windows after the first `--skip-steps` steps; and
whether the first pass covered every training sample of the finished cache. Random weights: real
speed, not real compression or acceptance. On a CPU, as a check of the script:

    python bench/e2e_follow.py --shape tiny --gpus cpu --tokens 30000 --steps 40 \
        --extract-args "--rows-per-part 8" \
        --train-args "--drafter-layers 1 --batch-tokens 1024 --shuffle-buffer 16"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from e2e_gpu import in_child  # noqa: E402
from e2e_inputs import long_tailed_lengths, write_rows, write_target  # noqa: E402
from e2e_report import extraction_rate, training_figures  # noqa: E402


class Timed:
    """A command whose output goes to `log`, each line stamped with seconds since `t0`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], t0: float) -> None:
        self.args, self.t0, self.lines = args, t0, []
        self.started = time.monotonic() - t0
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self.reader.start()

    def _read(self, log: Path) -> None:
        with open(log, "w") as f:
            for line in self.proc.stdout:
                self.lines.append((time.monotonic() - self.t0, line))
                f.write(f"{self.lines[-1][0]:9.2f} {line}")
                f.flush()

    def wait(self) -> float:
        """Seconds from t0 to the command's end; fails loudly with the log's tail."""
        code = self.proc.wait()
        self.reader.join()
        if code != 0:
            tail = "".join(line for _, line in self.lines[-40:])
            raise SystemExit(f"{' '.join(self.args)} failed ({code}):\n{tail}")
        return time.monotonic() - self.t0

    def first(self, pattern: str) -> tuple[float, re.Match] | None:
        """(time, match) of the first line matching `pattern`."""
        for t, line in self.lines:
            m = re.search(pattern, line)
            if m:
                return t, m
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--skip-steps", type=int, default=20, help="windows left out of the rates")
    p.add_argument("--target-layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--gpus", default="0", help="the device both commands share (cpu: a check)")
    p.add_argument("--work", type=Path, default=Path("/tmp/e2e-follow"))
    p.add_argument("--extract-args", default="", help="more options of python -m extract (quoted)")
    p.add_argument("--train-args", default="", help="more options of python -m train (quoted)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs stay anyway)")
    args = p.parse_args()
    work = args.work / args.shape
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        result = benchmark(args, work)
    finally:
        if not args.keep:
            for path in work.iterdir():
                if path.suffix != ".log":
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print_table(result)


def benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    device = "cpu" if args.gpus == "cpu" else "cuda"
    target, shards, run = work / "target", work / "shards", work / "run"
    cfg = in_child(write_target, args.shape, target, args.target_layers, device)
    lengths = long_tailed_lengths(args.tokens, seed=0)
    write_rows(work / "rows.jsonl", lengths, cfg["vocab_size"] - 293, seed=0)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py, t0 = sys.executable, time.monotonic()
    extract = Timed(
        [py, "-m", "extract", "--gpus", args.gpus, "--target", str(target),
         "--data", str(work / "rows.jsonl"), "--out", str(shards),
         *shlex.split(args.extract_args)],
        work / "extract.log", env, t0,
    )  # fmt: skip
    train = Timed(
        [py, "-m", "train", "--gpus", args.gpus, "--data", str(shards), "--out", str(run),
         "--steps", str(args.steps), *shlex.split(args.train_args)],
        work / "train.log", env, t0,
    )  # fmt: skip
    extract_end, train_end = extract.wait(), train.wait()
    verify = Timed([py, "-m", "extract.verify", str(shards)], work / "verify.log", env, t0)
    verify.wait()
    tokens, seconds, _, _ = extraction_rate(work / "extract.log")
    figures = training_figures(run, skip_steps=min(args.skip_steps, args.steps // 4))
    first_step = train.first(r"first step: ([\d.]+) s")
    passed = train.first(r"the first pass is done .*: ([\d,]+) samples .* of the ([\d,]+) training")
    following = train.first(r"following the extraction of \S+: (\d+) of (\d+) parts")
    manifest = json.loads((shards / "manifest.json").read_text())
    return {
        "shape": args.shape,
        "device": device_name(device),
        "tokens": tokens,
        "steps": args.steps,
        "extract_args": args.extract_args,
        "train_args": args.train_args,
        "train_started_s": train.started,
        "first_commit_s": _at(extract.first(r"committed part-")),
        "first_step_rows_s": _at(following),
        "parts_at_start": following and [int(following[1][1]), int(following[1][2])],
        "first_step_began_s": first_step and first_step[0] - float(first_step[1][1]),
        "first_step_ended_s": _at(first_step),
        "first_step_s": first_step and float(first_step[1][1]),
        "extract_ended_s": extract_end,
        "train_ended_s": train_end,
        "extract_tok_s": tokens / seconds,
        "extract_s": seconds,
        "train": figures,
        "first_pass_samples": passed and [int(g.replace(",", "")) for g in passed[1].groups()],
        "cache_parts": len(manifest["parts"]),
        "export_written": (run / "export" / "model.safetensors").is_file(),
    }


def _at(found: tuple[float, re.Match] | None) -> float | None:
    return None if found is None else found[0]


def device_name(device: str) -> str:
    if device == "cpu":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


def print_table(r: dict[str, Any]) -> None:
    t = r["train"]
    s = lambda v: "n/a" if v is None else f"{v:.1f} s"  # noqa: E731
    rows = [
        ("shape, device", f"{r['shape']}, {r['device']}"),
        ("tokens, parts", f"{r['tokens']:,}, {r['cache_parts']}"),
        ("first part committed", s(r["first_commit_s"])),
        ("trainer has its first step's rows", f"{s(r['first_step_rows_s'])} (parts "
         f"{'/'.join(map(str, r['parts_at_start'] or []))})"),
        ("first optimizer step began / ended", f"{s(r['first_step_began_s'])} / "
         f"{s(r['first_step_ended_s'])} (compilation included: {s(r['first_step_s'])})"),
        ("extraction / training ended", f"{s(r['extract_ended_s'])} / {s(r['train_ended_s'])}"),
        ("extraction rate (shared device)", f"{r['extract_tok_s']:,.0f} tok/s"),
        ("training rate (shared device)", f"{t['context_tok_s']:,.0f} context tok/s, "
         f"{t['step_ms']:.1f} ms a step, {100 * t['data_wait']:.1f}% waiting for data"),
        ("first pass: samples trained / in the cache",
         "/".join(map(str, r["first_pass_samples"] or [])) or "not finished"),
        ("export written", str(r["export_written"])),
    ]  # fmt: skip
    print("times from the extraction's start")
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))


if __name__ == "__main__":
    main()
