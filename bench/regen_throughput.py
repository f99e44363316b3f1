"""Regeneration throughput, Hugging Face `generate` against vLLM (a server, and in the process),
side by side on this machine: the same demo rows, the same target, the same settings.

    python bench/regen_throughput.py --vllm-python PATH [--rows 64 --max-new-tokens 64]
    python bench/regen_throughput.py --llama-server BIN --gguf FILE [--vllm-python PATH] ...

PATH is the Python of an environment with vLLM (`.ci/run` builds one with vLLM's CPU build). The
script regenerates the first --rows rows of the shipped demo chats with the embedded tiny demo
target three times through `python -m extract.regen`'s own `run()`, one route at a time so that
each has the machine to itself: locally (`--gpus cpu`, batches of --batch-size); with `--server`
against vLLM's OpenAI-compatible server on the same target (float32, eager, or compiled as `vllm
serve` compiles by default with `--server-compile`; its start-up (`start_s`) is not counted, the
premise being a server already running); and with `--engine vllm` (vLLM in the process, run
by PATH). Each route's `seconds` cover its whole `run()` (the local one and the engine load the
target in it), `generation_s` the part after the target is loaded (the server's: all of it).
Prints one JSON line: new tokens per second of each route, the ratios to the local route, and
whether the outputs are the same bytes (greedy decoding: they should be). `--repeat N` runs the
server route N times on the one server (after the first, vLLM's prefix cache holds the rows'
prompts): its figures are the median run's, every run's speed listed beside them; every run's
output is compared. Each server run also reports `server_cpu_s`: the CPU seconds (user and
system, from /proc) of each of the server's processes in it (API server, engine core, worker),
beside the client's own `cpu_s`: on a machine of few cores, where the cores went.

`--llama-server BIN --gguf FILE` adds llama.cpp's server as a route (`bench/llama_server.py`:
FILE is the same target converted by llama.cpp's `convert_hf_to_gguf.py`; `--concurrency`
slots of `--llama-slot-tokens` each, `--threads` CPU threads), asked through its own
`/completion` endpoint as `--server` asks it; `--vllm-python` may then be left out (no vLLM
routes). Its rows are compared with the local route's row by row (`rows_same`): a GGUF's
kernels round differently from torch's, so greedy answers can part.
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
sys.path.insert(0, str(ROOT / "bench"))

from llama_server import llama_server  # noqa: E402

from extract.regen.config import RegenConfig  # noqa: E402
from extract.regen.regenerate import run  # noqa: E402
from tests.vllm_server import vllm_server  # noqa: E402

log = logging.getLogger("regen_throughput")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def process_tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process `root` and its descendants, by
    "name pid", from /proc (Linux; empty elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    stats: dict[int, tuple[int, str, float]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        fields = rest.split()  # from field 3 (state): ppid is 4, utime 14, stime 15
        stats[int(entry.name)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / ticks)
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            tree[f"{stats[pid][1]} {pid}"] = stats[pid][2]
            frontier += [child for child, (ppid, _, _) in stats.items() if ppid == pid]
    return tree


def timed(cfg: RegenConfig, generation: tuple[Any, str] | None = None) -> dict[str, Any]:
    """The route's figures; `cpu_s`: this process's CPU seconds in it (all its threads: for the
    server route, the client's share of the cores the server also runs on). `generation`: the
    module and name of the route's function that generates once the target is loaded, timed
    by wrapping it (None: all of `run()` generates)."""
    spent: list[float] = []
    if generation is not None:
        module, name = generation
        inner = getattr(module, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return inner(*args, **kwargs)
            finally:
                spent.append(time.monotonic() - start)

        setattr(module, name, wrapped)
    start, cpu = time.monotonic(), time.process_time()
    try:
        state = run(cfg)
    finally:
        if generation is not None:
            setattr(module, name, inner)
    seconds, cpu_s = time.monotonic() - start, time.process_time() - cpu
    totals = state.totals(range(len(state.chunks)))
    tokens = totals["new_tokens"]
    generation_s = sum(spent) if generation is not None else seconds
    return {
        "seconds": round(seconds, 2),
        "generation_s": round(generation_s, 2),
        "cpu_s": round(cpu_s, 2),
        "rows_kept": totals["rows_kept"],
        "turns": totals["turns"],
        "new_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "generation_tokens_per_s": round(tokens / generation_s, 1),
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median speed among `runs` (of an even number, the faster of the middle two),
    with every run's tokens per second beside it."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    median = ordered[len(ordered) // 2]
    if len(runs) == 1:
        return median
    return {**median, "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def served_route(
    server: Any, common: dict[str, Any], concurrency: int, outs: list[Path]
) -> dict[str, Any]:
    """The server route run once into each of `outs` on one running `server`: the median
    run's figures, each run's with the server's processes' CPU seconds in it."""
    runs = []
    for out in outs:
        before = process_tree_cpu_s(server.proc.pid)
        figures = timed(RegenConfig(out=out, server=server.url, concurrency=concurrency, **common))
        after = process_tree_cpu_s(server.proc.pid)
        figures["server_cpu_s"] = {
            name: round(t - before.get(name, 0.0), 2) for name, t in after.items()
        }
        runs.append(figures)
    return median_run(runs)


def rows_same(out: Path, local: Path) -> str:
    """How many of the local route's rows `out` holds the same (by source row), "k of n"."""

    def rows(path: Path) -> dict[Any, str]:
        return {json.loads(line)["source_row"]: line for line in path.read_text().splitlines()}

    ours, theirs = rows(out), rows(local)
    return f"{sum(ours.get(k) == line for k, line in theirs.items())} of {len(theirs)}"


def engine_route(args: argparse.Namespace, common: dict[str, Any], out: Path) -> dict[str, Any]:
    """The --engine vllm route, run by --vllm-python (this script again, with --engine-out;
    its figures come back in a file beside the output: vLLM logs to standard output)."""
    command = [args.vllm_python, __file__, "--vllm-python", args.vllm_python]
    command += ["--rows", str(args.rows), "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--concurrency", str(args.concurrency), "--engine-out", str(out)]
    if common["target"] != str(default_target()):
        command += ["--target", common["target"]]
    env = dict(os.environ)
    if args.threads:  # the engine's torch threads, as the local route's
        env["OMP_NUM_THREADS"] = str(args.threads)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the engine route failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(out.with_suffix(".figures.json").read_text())


def default_target() -> Path:
    from extract.tiny import tiny_target

    return tiny_target()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="a Python with vLLM installed: the vLLM routes")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, help="the target as GGUF, for --llama-server")
    parser.add_argument("--llama-slot-tokens", type=int, default=1024, help="a slot's context")
    parser.add_argument("--rows", type=int, default=64, help="demo rows to regenerate")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="local route's batch")
    parser.add_argument(
        "--concurrency", type=int, default=64, help="conversations in flight (server, engine)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, help="vLLM's batch of requests (default: its own, 128 on CPUs)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="threads of the local route, the engine and llama-server (default: their own)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="a target folder or named real target (default: the embedded tiny demo target)",
    )
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="server route runs on the one server (its figures: the median run's)",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="more arguments of the server, as one string (--server-args=--flag for one flag)",
    )
    parser.add_argument(
        "--server-compile",
        action="store_true",
        help="the vLLM server's model compiled, vLLM's own default (default: --enforce-eager)",
    )
    parser.add_argument("--json", type=Path, help="also write the JSON line here")
    parser.add_argument("--engine-out", type=Path, help=argparse.SUPPRESS)  # the engine route
    args = parser.parse_args()
    if not args.vllm_python and not args.llama_server:
        parser.error("give --vllm-python, --llama-server (with --gguf), or both")
    if args.llama_server and not args.gguf:
        parser.error("--llama-server needs --gguf: the target converted to GGUF")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    import torch

    from extract.data import demo_dataset
    from extract.models import resolve_target

    if args.threads:
        torch.set_num_threads(args.threads)
    target = resolve_target(args.target) if args.target else str(default_target())
    data = (demo_dataset(),)
    common = dict(target=target, data=data, max_rows=args.rows, max_new_tokens=args.max_new_tokens)
    if args.engine_out is not None:  # in --vllm-python: the engine route alone
        import extract.regen.engine

        out, concurrency = args.engine_out, args.concurrency
        cfg = RegenConfig(out=out, engine="vllm", concurrency=concurrency, **common)
        figures = timed(cfg, (extract.regen.engine, "run_engine"))
        out.with_suffix(".figures.json").write_text(json.dumps(figures))
        return
    import extract.regen.local

    with tempfile.TemporaryDirectory() as tmp:
        local_out, served_out = Path(tmp) / "local.jsonl", Path(tmp) / "served.jsonl"
        engine_out = Path(tmp) / "engine.jsonl"
        local_cfg = RegenConfig(out=local_out, gpus="cpu", batch_size=args.batch_size, **common)
        local = timed(local_cfg, (extract.regen.local, "regenerate_chats"))
        routes: dict[str, Any] = {}
        same: dict[str, Any] = {}
        c = args.concurrency
        if args.vllm_python:
            kv_bytes = int(args.kv_cache_gib * (1 << 30))
            served_outs = [served_out] + [
                Path(tmp) / f"served-{i}.jsonl" for i in range(1, args.repeat)
            ]
            started = time.perf_counter()
            with vllm_server(
                args.vllm_python,
                Path(target),
                max_num_seqs=args.max_num_seqs,
                kv_cache_bytes=kv_bytes,
                extra=tuple(args.server_args.split()),
                eager=not args.server_compile,
            ) as server:
                start_s = time.perf_counter() - started
                served = served_route(server, common, c, served_outs)
            routes["server"] = {
                **served,
                "concurrency": c,
                "engine": "vllm (float32)",
                "max_num_seqs": args.max_num_seqs or "vLLM's default",
                "compiled": args.server_compile,
                "start_s": round(start_s, 1),
            }
            engine = engine_route(args, common, engine_out)
            routes["engine"] = {
                **engine,
                "concurrency": c,
                "engine": "vllm (float32)",
                "omp_threads": args.threads or "vLLM's own",
            }
            same["server"] = all(out.read_bytes() == local_out.read_bytes() for out in served_outs)
            same["engine"] = engine_out.read_bytes() == local_out.read_bytes()
        if args.llama_server:
            llama_outs = [Path(tmp) / f"llama-{i}.jsonl" for i in range(args.repeat)]
            with llama_server(
                args.llama_server,
                args.gguf,
                slots=c,
                slot_tokens=args.llama_slot_tokens,
                threads=args.threads,
            ) as server:
                served = served_route(server, common, c, llama_outs)
            routes["llamacpp"] = {
                **served,
                "concurrency": c,
                "engine": f"llama.cpp ({args.gguf.name})",
                "threads": args.threads or "llama.cpp's own",
            }
            same["llamacpp"] = [rows_same(out, local_out) for out in llama_outs]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    ratios = {
        f"{name}_ratio": round(route["tokens_per_s"] / local["tokens_per_s"], 2)
        for name, route in routes.items()
    }
    if "engine" in routes:
        ratios["engine_generation_ratio"] = round(
            routes["engine"]["generation_tokens_per_s"] / local["generation_tokens_per_s"], 2
        )
    if "server_ratio" in ratios:
        ratios["ratio"] = ratios.pop("server_ratio")  # the vLLM server's, as before
    result = {
        "target": args.target or "tiny demo target",
        "rows": args.rows,
        "max_new_tokens": args.max_new_tokens,
        "local": {**local, "batch_size": args.batch_size, "torch_threads": torch.get_num_threads()},
        **routes,
        **ratios,
        "same_rows_as_local": same,
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
