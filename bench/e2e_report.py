"""What `bench/e2e_gpu.py` reads back from the product's logs and metrics, and its table.

The extraction's figures come from `python -m extract`'s per-rank log lines (`extract.worker`:
its rate, the staging wait, `extract.forward_clock`'s split); the training's from the run's
`metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any


def extraction_rate(log: Path) -> tuple[int, float, float, float | None]:
    """(tokens, seconds, seconds until the last forward ended, seconds the device waited for a
    free staging buffer, i.e. for the writers) from extract's per-rank lines (target loading
    excluded)."""
    text = log.read_text()
    m = re.search(r"(\d+) tokens extracted in ([\d.]+) s .*?the forwards ended at ([\d.]+) s", text)
    if not m:
        raise SystemExit(f"no extraction rate in {log}")
    waited = re.search(r"the device waited ([\d.]+) s of [\d.]+ s for a free staging buffer", text)
    return (
        int(m.group(1)),
        float(m.group(2)),
        float(m.group(3)),
        float(waited.group(1)) if waited else None,
    )


def extraction_forwards(log: Path) -> dict[str, float] | None:
    """extract's ForwardClock line: device seconds in the forwards (the first one's apart),
    between them (idle, or the launching stream's work outside the forwards), the launching
    thread's seconds inside them."""
    text = log.read_text()
    m = re.search(
        r"forwards on the device ([\d.]+) s \(the first ([\d.]+) s\), ([\d.]+) s between them, "
        r"the launching thread ([\d.]+) s",
        text,
    )
    if not m:
        return None
    names = ("device_s", "first_s", "idle_s", "host_s")
    out: dict[str, Any] = dict(zip(names, map(float, m.groups()), strict=True))
    gaps = re.search(r"(\d+) gaps over \d+ ms \(([\d.]+) s\)(?:, the longest (.*))?", text)
    if gaps:  # logged since the gap summary (extract.forward_clock.gap_summary)
        out.update(long_gaps=int(gaps.group(1)), long_gaps_s=float(gaps.group(2)))
        out["longest_gaps"] = gaps.group(3) or ""
    return out


def extraction_end(log: Path) -> dict[str, Any] | None:
    """extract's `after the last forward:` line (`extract.backpressure.describe_end`): seconds
    after the last forward at which the writer threads, the disk queue (zarr) and the last commit
    were done, the writer threads' wait for the disk queue in that time, and the bytes queued for
    the disk at the last forward."""
    m = re.search(
        r"after the last forward: the writer threads finished ([\d.]+) s later"
        r"(?: \(([\d.]+) s of their time waiting for the disk queue\))?"
        r"(?:, the disk queue \(([\d.]+) GB then\) emptied ([\d.]+) s later)?"
        r", the last commit ([\d.]+) s later",
        log.read_text(),
    )
    if not m:
        return None
    number = lambda g: None if g is None else float(g)
    names = ("writers_s", "writers_blocked_s", "disk_backlog_gb", "written_s", "committed_s")
    out: dict[str, Any] = dict(zip(names, map(number, m.groups()), strict=True))
    # The last committed part's own commit time by step (`extract.commit.commit_steps`).
    commits = re.findall(
        r"committed (part-\d+(?:\.tar)?): .*?; its commit took ([\d.]+) s(?: \((.*)\))?$",
        log.read_text(),
        re.M,
    )
    out["last_commit"] = None
    if commits:
        name, took, steps = commits[-1]
        out["last_commit"] = f"{name}'s commit took {took} s" + (f": {steps}" if steps else "")
    return out


def extraction_staging(log: Path) -> dict[str, float] | None:
    """extract's `writer threads:` line (their busy seconds, their count, and in logs that say
    it their seconds on a core) and on a GPU its `side stream:` line (device seconds from the
    forwards' ends to their payloads' copies landing, in all and the longest, and the writer
    threads' wait for them)."""
    text = log.read_text()
    m = re.search(
        r"writer threads: busy ([\d.]+) s of their (\d+) x [\d.]+ s"
        r"(?:, ([\d.]+) s of it on a core)?",
        text,
    )
    if not m:
        return None
    out = {"writers_busy_s": float(m.group(1)), "writers": int(m.group(2))}
    if m.group(3) is not None:  # logged since the threads' CPU time was
        out["writers_cpu_s"] = float(m.group(3))
    m = re.search(
        r"side stream: .*? ended ([\d.]+) s after their forwards in all \(the longest (\d+) ms\); "
        r"the writer threads waited ([\d.]+) s",
        text,
    )
    if m:
        names = ("span_s", "longest_ms", "waited_s")
        out.update(zip(names, map(float, m.groups()), strict=True))
    return out


def staging_cell(x: dict[str, Any]) -> str:
    """The table's words for an extraction's staging: the device's wait for a free buffer, the
    writer threads' busy time, the side stream's span and the writers' wait for the copies."""
    waited = "n/a" if x["staging_wait_s"] is None else f"{x['staging_wait_s']:.1f} s"
    words = f"device waited {waited} for a free staging buffer"
    st = x.get("staging")
    if st is None:
        return words
    words += f"; {st['writers']} writer threads busy {st['writers_busy_s']:.1f} s"
    of_it = [f"{st['writers_cpu_s']:.1f} s on a core"] if "writers_cpu_s" in st else []
    if "span_s" in st:
        of_it.append(f"{st['waited_s']:.1f} s waiting for copies")
    if of_it:
        words += f" (of it {', '.join(of_it)})"
    if "span_s" in st:
        words += (
            f"; payloads and copies ended "
            f"{st['span_s']:.1f} s after their forwards (longest {st['longest_ms']:.0f} ms)"
        )
    return words


def end_cell(end: dict[str, Any] | None) -> str:
    """The table's cell for `extraction_end`."""
    if end is None:
        return "not logged"
    writers = f"writer threads {end['writers_s']:.2f} s"
    if end["writers_blocked_s"] is not None:
        writers += f" ({end['writers_blocked_s']:.2f} s blocked on the disk queue)"
    disk = ""
    if end["written_s"] is not None:
        disk = f", disk queue ({end['disk_backlog_gb']:.2f} GB then) {end['written_s']:.2f} s"
    last = f" ({end['last_commit']})" if end.get("last_commit") else ""
    return f"{writers}{disk}, last commit {end['committed_s']:.2f} s{last}"


def extraction_compile(log: Path) -> dict[str, Any] | None:
    """extract's probe line for a compiled target: graphs and seconds, and any recompilation
    logged at the end (`extract.worker._report_graphs`)."""
    text = log.read_text()
    m = re.search(r"(\d+) compiled graphs in ([\d.]+) s", text)
    if not m:
        return None
    more = re.search(r"made (\d+) more graphs during extraction", text)
    return {
        "graphs": int(m.group(1)),
        "seconds": float(m.group(2)),
        "recompiled": int(more.group(1)) if more else 0,
    }


def extraction_figures(log: Path, plain_tok_s: float) -> dict[str, Any]:
    """An extraction's figures from its log, its rates as fractions of the plain forward's."""
    tokens, seconds, forwards_s, waited = extraction_rate(log)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": tokens / seconds,
        "ratio": tokens / seconds / plain_tok_s,
        # The clock stopped at the last forward: what the final writes and commit cost apart.
        "forwards_s": forwards_s,
        "ratio_until_last_forward": tokens / forwards_s / plain_tok_s,
        "staging_wait_s": waited,
        "forwards": extraction_forwards(log),
        "end": extraction_end(log),
        "compile": extraction_compile(log),
        "staging": extraction_staging(log),
        "filesystem": extraction_filesystem(log),
    }


def extraction_filesystem(log: Path) -> str | None:
    """The file system of the cache's disk, from extract's `space:` line (None: not logged)."""
    m = re.search(r"space: .* \(file system: ([^)]+)\)", log.read_text())
    return m.group(1) if m else None


def training_figures(run: Path, skip_steps: int) -> dict[str, Any]:
    """Steady-state figures from metrics.jsonl: windows after `skip_steps`, weighted by steps."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    first = train[0]
    steady = [r for r in train if r["step"] > skip_steps]
    prev = {r["step"]: p["step"] for p, r in zip(train, train[1:], strict=False)}
    steps = {r["step"]: r["step"] - prev.get(r["step"], 0) for r in steady}
    total = sum(steps.values())
    step_ms = sum(r["step_ms"] * steps[r["step"]] for r in steady) / total
    tok_s = sum(r["tokens_per_s"] * r["step_ms"] * steps[r["step"]] for r in steady) / (
        step_ms * total
    )
    return {
        "steps": train[-1]["step"],
        "first_step_s": first.get("first_step_s"),
        "graphs_after_first_step": first["compiled_graphs"],
        "graphs_at_end": train[-1]["compiled_graphs"],
        "step_ms": step_ms,
        "context_tok_s": tok_s,
        "data_wait": sum(r["data_wait"] * steps[r["step"]] for r in steady) / total,
        "peak_gpu_gb": max(r.get("peak_gpu_gb", 0) for r in train),
        "loss_first_last": [first["loss"], train[-1]["loss"]],
        "finite": all(math.isfinite(r["loss"]) for r in train),
    }


def forward_split(r: dict[str, Any]) -> str:
    """Device seconds in the forwards and idle between them, plain pass against extraction's."""
    x = r["extract_forwards"]
    if x is None:
        return "n/a"
    return (
        f"extract {x['device_s']:.1f} "
        f"(first {x['first_s']:.2f}, {x['idle_s']:.1f} between; launching thread {x['host_s']:.1f})"
        + (
            f"; {x['long_gaps']} gaps over 10 ms ({x['long_gaps_s']:.2f} s): {x['longest_gaps']}"
            if "long_gaps" in x
            else ""
        )
    )


def of_default(v: dict[str, Any], r: dict[str, Any]) -> float:
    """A variant's extraction rate against the default's (runs before the rate was kept:
    their ratios to eager)."""
    if "tok_s" in v:
        return v["tok_s"] / r["extract_tok_s"]
    return v["ratio"] / r["extract_ratio"]


def variant_cell(r: dict[str, Any], v: dict[str, Any]) -> str:
    """An --also-extract variant's figures against the default's, or the last line it logged."""
    if "failed" in v:
        return "FAILED: " + (v["failed"].strip().splitlines() or ["(no output)"])[-1]
    return (
        f"{ratio_text(v['ratio'])} = {of_default(v, r):.3f} of the default "
        f"({ratio_text(v['ratio_until_last_forward'])} until the last forward); "
        + forward_split({**r, "extract_forwards": v["forwards"]})
        + "; "
        + staging_cell(v)
    )


def disk_bound(disk: dict[str, Any], bytes_per_token: float, plain_tok_s: float) -> dict:
    """`disk` (`shard_write.disk_rate`) with the extraction rate it allows at the cache's stored
    bytes per token, and that rate against the eager plain forward (nan without one)."""
    tok_s = disk["gb_s"] * 1e9 / bytes_per_token
    return {**disk, "bound_tok_s": tok_s, "bound_ratio": tok_s / plain_tok_s}


def disk_cell(disk: dict[str, Any] | None) -> str:
    if disk is None:
        return "not measured (--disk-gb 0, or too little free space)"
    return (
        f"{disk['gb_s']:.2f} GB/s ({disk['gb']:.1f} GB of shard files in {disk['threads']} "
        f"threads, synced): at most {disk['bound_tok_s']:,.0f} tok/s at the stored bytes/token "
        f"= {ratio_text(disk['bound_ratio'])} x eager"
    )


def ratio_text(ratio: float) -> str:
    """A ratio to the eager plain forward; n/a where the run had none (--no-plain-forwards)."""
    return "n/a" if math.isnan(ratio) else f"{ratio:.3f}"


def host_cpu() -> str:
    """The host's CPU model and the cores this process may use: hosts of one card differ in how
    fast the writer threads compress, so a run's record names its host."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} usable cores"


def print_table(r: dict[str, Any]) -> None:
    rows = [
        ("shape / target layers / device", f"{r['shape']} / {r['target_layers']} / {r['device']}"),
        ("host CPU", r.get("host_cpu", "not recorded")),
        ("extraction's extra options", r.get("extract_options") or "none (the defaults)"),
        ("rows, tokens (lengths)", f"{r['rows']:,}, {r['tokens']:,} ({r['lengths']})"),
        *forward_rows(r),
        (
            "extract tok/s vs eager plain forward",
            f"{r['extract_tok_s']:,.0f} vs "
            + (
                f"{r['plain_forward_tok_s']:,.0f} = {r['extract_ratio']:.3f}"
                if "plain_forward" in r
                else "n/a (no plain forwards in this run)"
            ),
        ),
        (
            "  until the last forward / then",
            f"{ratio_text(r['extract_ratio_until_last_forward'])} / "
            f"{r['extract_s'] - r['extract_forwards_s']:.1f} s more",
        ),  # fmt: skip
        ("  after the last forward, over at", end_cell(r.get("extract_end"))),
        (
            "  device waiting for the writers",
            "n/a"
            if r["extract_staging_wait_s"] is None
            else f"{r['extract_staging_wait_s']:.1f} s of {r['extract_s']:.1f} s",
        ),  # fmt: skip
        ("  device s in forwards", forward_split(r)),
        (
            "  staging",
            staging_cell(
                {"staging_wait_s": r["extract_staging_wait_s"], "staging": r["extract_staging"]}
            ),
        ),
        *((f"  with {v['options']}", variant_cell(r, v)) for v in r["extract_variants"]),
        ("stored bytes/token", f"{r['stored_bytes_per_token']:,.0f}"),
        ("the cache's file system", r.get("extract_filesystem") or "not logged"),
        ("its disk, measured first", disk_cell(r.get("disk"))),
    ]
    if "verify" in r:
        rows.append(("verify", r["verify"]))
    if "train" in r:
        rows += training_rows(r)
    rows.append(("wall seconds", json.dumps({k: round(v) for k, v in r["wall_s"].items()})))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def training_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    t, f = r["train"], r["fixed_shape"]
    mfu = f"{100 * r['mfu_bench_count']:.1f}%" if r["mfu_bench_count"] is not None else "n/a"
    return [
        ("train steps, settings", f"{t['steps']}, {r['train_settings']}"),
        ("train context tok/s (steady)", f"{t['context_tok_s']:,.0f}"),
        ("train step / fixed-shape step", f"{t['step_ms']:.1f} / {f['step_ms']:.1f} ms"),
        ("context tok/s vs fixed shape", f"{r['tok_s_ratio_to_fixed_shape']:.3f}"),
        ("MFU (bench's count)", mfu),
        ("first step", f"{t['first_step_s']:.1f} s (fixed-shape bench {f['first_step_s']:.1f} s)"),
        (
            "compiled graphs: after step 1, at end",
            f"{t['graphs_after_first_step']}, {t['graphs_at_end']}",
        ),  # fmt: skip
        ("peak GPU memory", f"{t['peak_gpu_gb']:.1f} GB"),
        ("data wait", f"{100 * t['data_wait']:.2f}%"),
        ("loss first -> last, finite", f"{t['loss_first_last']}, {t['finite']}"),
        ("export written", str(r["export_written"])),
        *(
            (
                f"  with {v['options']}",
                f"step {v['step_ms']:.1f} ms = {v['step_ratio']:.3f} x the default's, "
                f"{v['context_tok_s']:,.0f} tok/s, first step {v['first_step_s']:.1f} s, graphs "
                f"{v['graphs_after_first_step']}, {v['graphs_at_end']}, peak "
                f"{v['peak_gpu_gb']:.1f} GB, loss {v['loss_first_last']}, finite {v['finite']}",
            )
            for v in r.get("train_variants", [])
        ),
    ]


def forward_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The plain forwards, eager and compiled (where measured), and extraction's MFU against the
    ceiling."""
    if "plain_forward" not in r:
        return []
    e, c, m = r["plain_forward"], r.get("compiled_forward"), r["mfu"]
    x = r.get("extract_compile") or {}
    rows = [
        ("matmul ceiling (bf16 8192^3)", f"{r['ceiling_tflops']:.0f} TFLOP/s"),
        ("eager plain forward", f"{e['tok_s']:,.0f} tok/s, MFU {m['eager']:.1%}"),
    ]
    if c is not None:
        rows.append((
            "compiled plain forward",
            f"{c['tok_s']:,.0f} tok/s = {c['tok_s'] / e['tok_s']:.3f} x eager, MFU "
            f"{m['compiled']:.1%}; compiled {c['graphs']} graphs in {c['compile_s']:.1f} s",
        ))  # fmt: skip
    rows.append((
        "extraction MFU, compilation",
        f"{m['extract']:.1%}; {x.get('graphs', 'no')} graphs in {x.get('seconds', 0):.1f} s "
        f"before the first part, {x.get('recompiled', 0)} recompiled since",
    ))  # fmt: skip
    if c is not None:
        rows.append(("extract vs compiled plain forward", f"{r['extract_vs_compiled']:.3f}"))
    return rows
