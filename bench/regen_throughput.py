"""Regeneration throughput, Hugging Face `generate` against a vLLM server, side by side on this
machine: the same demo rows, the same target, the same settings.

    python bench/regen_throughput.py --vllm-python PATH [--rows 64 --max-new-tokens 64]

PATH is the Python of an environment with vLLM (`.ci/run` builds one with vLLM's CPU build). The
script regenerates the first --rows rows of the shipped demo chats with the embedded tiny demo
target twice through `python -m extract.regen`'s own `run()`: first locally (`--gpus cpu`,
batches of --batch-size), then with `--server` against vLLM's OpenAI-compatible server on the
same target (float32, started after the local run, so that each route has the machine to itself;
its start-up is not timed, the premise being a server already running). Each route's seconds
cover its whole `run()` (the local one loads the target in it). Prints one JSON line: new tokens
per second of each route, their ratio, and whether the two outputs are the same bytes (greedy
decoding: they should be).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from extract.regen.config import RegenConfig  # noqa: E402
from extract.regen.regenerate import run  # noqa: E402
from tests.vllm_server import vllm_server  # noqa: E402

log = logging.getLogger("regen_throughput")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def timed(cfg: RegenConfig) -> dict[str, Any]:
    """The route's figures; `cpu_s`: this process's CPU seconds in it (all its threads: for the
    server route, the client's share of the cores the server also runs on)."""
    start, cpu = time.monotonic(), time.process_time()
    state = run(cfg)
    seconds, cpu_s = time.monotonic() - start, time.process_time() - cpu
    totals = state.totals(range(len(state.chunks)))
    tokens = totals["new_tokens"]
    return {
        "seconds": round(seconds, 2),
        "cpu_s": round(cpu_s, 2),
        "rows_kept": totals["rows_kept"],
        "turns": totals["turns"],
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    parser.add_argument("--rows", type=int, default=64, help="demo rows to regenerate")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="local route's batch")
    parser.add_argument("--concurrency", type=int, default=64, help="server route's requests")
    parser.add_argument(
        "--max-num-seqs", type=int, help="vLLM's batch of requests (default: its own, 128 on CPUs)"
    )
    parser.add_argument(
        "--threads", type=int, help="local route's torch threads (default: torch's own)"
    )
    parser.add_argument(
        "--target",
        default=None,
        help="a target folder or named real target (default: the embedded tiny demo target)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache")
    parser.add_argument("--json", type=Path, help="also write the JSON line here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import torch

    from extract.data import demo_dataset
    from extract.models import resolve_target
    from extract.tiny import tiny_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target) if args.target else str(tiny_target())
    data = (demo_dataset(),)
    common = dict(target=target, data=data, max_rows=args.rows, max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        local_out, served_out = Path(tmp) / "local.jsonl", Path(tmp) / "served.jsonl"
        local = timed(RegenConfig(out=local_out, gpus="cpu", batch_size=args.batch_size, **common))
        kv_bytes = int(args.kv_cache_gib * (1 << 30))
        with vllm_server(
            args.vllm_python, Path(target), max_num_seqs=args.max_num_seqs, kv_cache_bytes=kv_bytes
        ) as server:
            served = timed(
                RegenConfig(
                    out=served_out, server=server.url, concurrency=args.concurrency, **common
                )
            )
        same = local_out.read_bytes() == served_out.read_bytes()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "target": args.target or "tiny demo target",
        "rows": args.rows,
        "max_new_tokens": args.max_new_tokens,
        "local": {**local, "batch_size": args.batch_size, "torch_threads": torch.get_num_threads()},
        "server": {
            **served,
            "concurrency": args.concurrency,
            "engine": "vllm (float32)",
            "max_num_seqs": args.max_num_seqs or "vLLM's default",
        },
        "ratio": round(served["tokens_per_s"] / local["tokens_per_s"], 2),
        "same_rows": same,
        "cpus": os.cpu_count(),
        "machine": cpu_model(),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "commit": commit,
    }
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
