"""The peer trainer, speculators 0.9.0's DFlash, side by side with ours on the same hidden states.

    OMP_NUM_THREADS=1 python bench/peer_speculators.py --cache CACHE --work WORK [--seeds 3]

CACHE: our cache of the target holding the taps and its last layer, e.g.
`python -m extract --target smollm2-135m-instruct --gpus cpu --data
extract/data/smollm2_chats.jsonl --out real/bf16 --store bf16 --layers 1,8,14,20,27,29`.
The bench writes it into speculators' offline layout (bench/peer_layout.py: the held-out
samples of our `--eval-fraction` last, so both trainers train on exactly the same samples),
then trains, per seed, three drafters on the same samples and the same number of target tokens
(steps x batch tokens), each process on one thread, `--parallel` processes at a time:
- `ours`: `python -m train` with our default recipe (CE, AdamW, exp slot weights) at the shape
  given (`--drafter-layers`, `--num-anchors`, `--batch-tokens`, `--lr`);
- `spec-default`: speculators' defaults (5 layers, 512 anchors, 8192-token rows, sliding
  attention causal inside the block, Muon at 1e-3, D-PACE over CE), its steps set to the same
  target tokens (steps x batch tokens / 8192, at least 1);
- `spec-shape`: speculators' recipe at our shape (layers, anchors, row tokens, steps, full
  attention on every layer as ours).
Speculators runs in `--spec-python` (default this one) through bench/peer_runner.py, which
patches its CPU problems in that process. On a CPU it needs `--draft-attn-impl sdpa`,
`--loss-implementation eager` and `--hidden-states-dtype float32` (given here) and runs with
`--num-workers 0` (its 12 spawned loader workers do not fit two cores). `--device cuda` runs
both on GPU 0 with their own fast paths instead, one job at a time: ours with `--gpus 0` and its
defaults (flex_attention compiled), speculators with its defaults (its flex attention, its loss,
bf16 hidden states, its loader workers); the layout is then written in bf16. Its checkpoint
becomes a z-lab DFlash export by a config rewrite (`peer_layout.zlab_config`), and every export
is decoded on `--prompts` by z-lab's reference loop (`bench/reference_decode.py`; `--decoder
ours`: `python -m train.proof.speculate`, equal to it step by step). Printed: per recipe the
mean tau over seeds with its standard error, each drafter's tau with the prompts' standard
error, and the median step time after `--warmup-steps`; WORK/summary.json holds it all. A run
found complete in WORK is reused (`--retrain`: trained again), so a second call decodes what the
first trained.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from peer_layout import train_ratio, write_layout, write_zlab_export  # noqa: E402

from shared.manifest import read_manifest  # noqa: E402
from shared.models import resolve_target_name  # noqa: E402
from shared.target_files import read_target_config, unused_special_token  # noqa: E402
from train.data.plan import evenly_spaced  # noqa: E402
from train.drafters.config import default_mask_token_id  # noqa: E402
from train.proof.tau import ratio_se, read_runs  # noqa: E402
from train.run import eval_sample_count  # noqa: E402
from train.sweep.report import mean_se  # noqa: E402

RECIPES = ("ours", "spec-default", "spec-shape")
SPEC_DEFAULT_ROW = 8192  # speculators' --total-seq-len default
SPEC_CPU_ARGS = {  # what speculators needs on a CPU; on a GPU its defaults
    "cpu": ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
            "--hidden-states-dtype", "float32", "--num-workers", "0"],
    "cuda": [],
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="our cache: taps and last layer")
    p.add_argument("--work", type=Path, default=Path("bench-out/peer"))
    p.add_argument("--target", default="smollm2-135m-instruct", help="folder or named target")
    p.add_argument("--taps", default="1,8,14,20,27", help="our layer ids the drafters read")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="ours (AdamW); speculators keeps 1e-3")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--spec-python", default=sys.executable)
    p.add_argument("--parallel", type=int, default=2, help="processes at once, 1 thread each")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: both trainers on GPU 0, their own fast paths, one job at a time",
    )
    p.add_argument("--prompts", type=Path, default=ROOT / "extract/data/smollm2_held_out.json")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the median")
    p.add_argument("--skip-decode", action="store_true", help="train and time only")
    p.add_argument(
        "--decoder",
        choices=("reference", "ours"),
        default="reference",
        help="reference: z-lab's dflash_generate (bench/reference_decode.py); ours: "
        "train.proof.speculate (equal to it step by step: tests/test_speculate.py)",
    )
    p.add_argument(
        "--spec-args",
        default="",
        help="more speculators train arguments, one string (e.g. '--loss-implementation eager')",
    )
    p.add_argument("--retrain", action="store_true", help="retrain runs found complete in WORK")
    p.add_argument(
        "--tag",
        default="",
        help="suffix of the decode logs and summary: benches side by side in "
        "one WORK (each with its --recipes; the layout is made by the first)",
    )
    return p.parse_args(argv)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def prepare_layout(a: argparse.Namespace, target: str) -> dict:
    """The cache in speculators' layout (once per WORK), with our held-out samples last."""
    from safetensors import safe_open

    out = a.work / "layout"
    info_path = out / "peer_layout.json"
    if info_path.is_file():
        return json.loads(info_path.read_text())
    if importlib.util.find_spec("datasets") is None:
        raise SystemExit(
            f"{sys.executable} has no `datasets`, which writes speculators' layout: run this "
            f"script with the python of speculators' environment ({a.spec_python})"
        )
    num = sum(p.rows_kept for p in read_manifest(a.cache).parts)
    held = evenly_spaced(num, eval_sample_count(a.eval_fraction, num))
    index = Path(target) / "model.safetensors.index.json"  # a checkpoint in several files
    name = "model.norm.weight"  # the final norm: see peer_layout's docstring
    file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else None
    with safe_open(str(Path(target) / (file or "model.safetensors")), framework="pt") as f:
        norm = f.get_tensor(name)
    shutil.rmtree(out, ignore_errors=True)
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32  # speculators' own on a GPU
    return write_layout(a.cache, out, taps=_taps(a), norm_weight=norm, held=held, dtype=dtype)


def _taps(a: argparse.Namespace) -> list[int]:
    return [int(x) for x in a.taps.split(",")]


def mask_token(cache: Path) -> int:
    """Our trainer's mask token for this cache (speculators gets the same one)."""
    m = read_manifest(cache)
    return default_mask_token_id(
        read_target_config(cache), m.target.tokenizer_vocab_size, unused_special_token(cache)
    )


def our_command(a: argparse.Namespace, seed: int, out: Path) -> list[str]:
    cpu = a.device == "cpu"
    return [
        sys.executable, "-m", "train", "--data", str(a.cache), "--out", str(out),
        "--gpus", "cpu" if cpu else "0", "--seed", str(seed), "--target-layers", a.taps,
        "--drafter-layers", str(a.drafter_layers), "--num-anchors", str(a.num_anchors),
        "--batch-tokens", str(a.batch_tokens), "--steps", str(a.steps), "--lr", str(a.lr),
        "--eval-fraction", str(a.eval_fraction), *(["--workers", "0"] if cpu else []),
        "--log-every", "1", "--checkpoint-every", str(a.steps),
    ]  # fmt: skip


def spec_steps(a: argparse.Namespace, recipe: str) -> int:
    """Optimizer steps giving the same target tokens as ours (steps x batch tokens)."""
    if recipe == "spec-shape":
        return a.steps
    return max(1, round(a.steps * a.batch_tokens / SPEC_DEFAULT_ROW))


def spec_command(
    a: argparse.Namespace, recipe: str, seed: int, out: Path, *, target: str, layout: dict
) -> list[str]:
    cmd = [
        a.spec_python, str(ROOT / "bench/peer_runner.py"), str(out / "step_times.json"),
        "--speculator-type", "dflash", "--verifier-name-or-path", target,
        "--data-path", str(a.work / "layout"), "--save-path", str(out / "checkpoints"),
        "--log-dir", str(out / "logs"), "--target-layer-ids",
        *map(str, layout["aux_hidden_state_layer_ids"]),
        "--mask-token-id", str(mask_token(a.cache)),
        *SPEC_CPU_ARGS[a.device], *shlex.split(a.spec_args),
        "--on-missing", "raise", "--seed", str(seed),
        "--train-data-ratio", str(train_ratio(layout["samples"], layout["held_last"])),
        "--max-steps", str(spec_steps(a, recipe)), "--no-resume-from-checkpoint",
    ]  # fmt: skip
    if recipe == "spec-shape":
        cmd += ["--num-layers", str(a.drafter_layers), "--max-anchors", str(a.num_anchors)]
        cmd += ["--total-seq-len", str(a.batch_tokens), "--full-attention-indices"]
        cmd += [str(i) for i in range(a.drafter_layers)]
    return cmd


def next_job(pending: list, running: dict) -> int | None:
    """Index of the first pending job that may start: speculators' defaults (jobs named
    `spec-default/...`) one at a time, its peak resident memory being 12.8 GB on SmolLM2 (8192
    block rows of 49,152 logits in float32, several copies in its eager loss)."""
    heavy = any(name.startswith("spec-default/") for name in running)
    for i, (name, *_) in enumerate(pending):
        if not (heavy and name.startswith("spec-default/")):
            return i
    return None


def run_jobs(jobs: list[tuple[str, list[str], Path]], parallel: int) -> dict[str, float]:
    """Run (name, command, log) jobs, `parallel` at a time (`next_job`), each on one thread;
    their seconds. A failed job stops the bench with its log's tail."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if parallel > 1:  # each process one core's worth
        env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    pending, running, seconds = list(jobs), {}, {}
    while pending or running:
        while len(running) < parallel and (i := next_job(pending, running)) is not None:
            name, cmd, log = pending.pop(i)
            log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{time.strftime('%H:%M:%S')}] start {name} (load {load_avg()})", flush=True)
            with open(log, "w") as f:
                f.write(" ".join(cmd) + "\n")
                f.flush()
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running[name] = (proc, log, time.perf_counter())
        time.sleep(2)
        for name, (proc, log, start) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            seconds[name] = time.perf_counter() - start
            print(f"[{time.strftime('%H:%M:%S')}] done {name} rc {proc.returncode} "
                  f"{seconds[name]:.0f} s (load {load_avg()})", flush=True)  # fmt: skip
            if proc.returncode:
                for other, *_ in running.values():
                    other.terminate()
                tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
                raise SystemExit(f"{name} failed (rc {proc.returncode}), {log}:\n{tail}")
    return seconds


def step_times(recipe: str, run: Path) -> list[float]:
    """Seconds of each optimizer step, in order."""
    if recipe == "ours":
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["step_ms"] / 1e3 for r in records if r.get("kind") == "train"]
    return json.loads((run / "step_times.json").read_text())["step_s"]


def export_spec(run: Path, *, num_target_layers: int) -> Path:
    """speculators' last checkpoint of a run as a z-lab DFlash export in `run/export`."""
    epochs = [p for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    last = max(epochs, key=lambda p: int(p.name))
    return write_zlab_export(last, run / "export", num_target_layers=num_target_layers)


def decode(a: argparse.Namespace, exports: dict[str, Path]) -> dict[str, dict]:
    """Every export decoded on the prompts, the drafters split over `--parallel` processes (one
    greedy reference each); per drafter name: tau, its standard error over the prompts, lossless."""
    names = list(exports)
    shards = [names[i :: a.parallel] for i in range(a.parallel) if names[i :: a.parallel]]
    jobs = []
    decoder = (
        [str(ROOT / "bench/reference_decode.py")]
        if a.decoder == "reference"
        else ["-m", "train.proof.speculate", "--json"]
    )
    for i, shard in enumerate(shards):
        cmd = [sys.executable, *decoder, "--target", a.target]
        for name in shard:
            cmd += ["--drafter", str(exports[name])]
        cmd += ["--prompts", str(a.prompts), "--max-new-tokens", str(a.max_new_tokens)]
        jobs.append((f"decode-{i}", cmd, a.work / f"decode{a.tag}-{i}.log"))
    run_jobs(jobs, a.parallel)
    by_path = {str(p): n for n, p in exports.items()}
    out = {}
    for run in read_runs([log for *_, log in jobs]):
        tau, se = ratio_se(run["n"], run["s"])
        out[by_path[run["drafter"]]] = {"tau": tau, "tau_se": se, "lossless": run["lossless"]}
    return out


def is_complete(recipe: str, run: Path) -> bool:
    """A run trained to the end (its step times written, and for ours its export)."""
    if recipe == "ours":
        return (run / "export" / "model.safetensors").is_file()
    return (run / "step_times.json").is_file()


def train_all(a: argparse.Namespace, target: str, layout: dict) -> dict[str, tuple]:
    """Every recipe and seed trained, a complete run reused (`--retrain`: none); per run name:
    (recipe, seed, run folder, seconds the bench saw it train or None where reused)."""
    jobs, runs = [], {}
    for seed in range(a.seeds):
        for recipe in a.recipes.split(","):
            name, run = f"{recipe}/seed-{seed}", a.work / "runs" / recipe / f"seed-{seed}"
            runs[name] = (recipe, seed, run)
            if is_complete(recipe, run) and not a.retrain:
                print(f"{name}: complete in {run}, reused")
                continue
            shutil.rmtree(run, ignore_errors=True)
            cmd = our_command(a, seed, run) if recipe == "ours" else spec_command(
                a, recipe, seed, run, target=target, layout=layout)  # fmt: skip
            jobs.append((name, cmd, a.work / "logs" / f"{recipe}-seed-{seed}.log"))
    seconds = run_jobs(jobs, a.parallel)
    return {name: (*r, seconds.get(name)) for name, r in runs.items()}


def summarize(a: argparse.Namespace, runs: dict[str, tuple], exports: dict, taus: dict) -> dict:
    """Per drafter and per recipe: tau (mean ± standard error over seeds), median step time."""
    drafters = {}
    for name, (recipe, seed, run, seconds) in runs.items():
        steps = step_times(recipe, run)
        median = statistics.median(steps[a.warmup_steps :] or steps)
        drafters[name] = {
            "recipe": recipe, "seed": seed, "export": str(exports[name]), "seconds": seconds,
            "steps": len(steps), "median_step_s": median, **taus.get(name, {}),
        }  # fmt: skip
    per_recipe = {}
    for recipe in a.recipes.split(","):
        rows = [d for d in drafters.values() if d["recipe"] == recipe]
        nan = float("nan")
        tau, se = mean_se([d["tau"] for d in rows]) if all("tau" in d for d in rows) else (nan, nan)
        per_recipe[recipe] = {
            "seeds": len(rows), "tau": tau, "tau_se": nan if se is None else se,
            "median_step_s": statistics.median(d["median_step_s"] for d in rows),
            "steps": a.steps if recipe == "ours" else spec_steps(a, recipe),
            "row_tokens": SPEC_DEFAULT_ROW if recipe == "spec-default" else a.batch_tokens,
        }  # fmt: skip
    return {"recipes": per_recipe, "drafters": drafters}


def main() -> None:
    a = parse_args()
    if a.device == "cuda":
        a.parallel = 1  # one job on the GPU at a time: step times of each alone
    else:  # every job on the CPU, speculators too (peer_runner patches it where no GPU is seen)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    a.work.mkdir(parents=True, exist_ok=True)
    target = resolve_target_name(a.target)
    started, load0 = time.time(), load_avg()
    layout = prepare_layout(a, target)
    print(
        f"layout: {layout['samples']} samples ({layout['held_last']} held out, last), "
        f"{layout['tokens']} tokens, speculators' ids {layout['aux_hidden_state_layer_ids']}"
    )
    runs = train_all(a, target, layout)
    layers = read_manifest(a.cache).target.num_layers
    exports = {
        name: run / "export" if recipe == "ours" else export_spec(run, num_target_layers=layers)
        for name, (recipe, _, run, _) in runs.items()
    }
    taus = {} if a.skip_decode else decode(a, exports)
    summary = {
        "args": {k: str(v) for k, v in vars(a).items()}, "target": target, "layout": {
            k: v for k, v in layout.items() if k != "sample_index_order"},
        "load_avg_start": load0, "load_avg_end": load_avg(), "wall_s": time.time() - started,
        **summarize(a, runs, exports, taus),
    }  # fmt: skip
    (a.work / f"summary{a.tag}.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)


def print_table(summary: dict) -> None:
    print(f"\n{'recipe':<14}{'seeds':>6}{'steps':>7}{'row':>6}{'tau (mean ± se, seeds)':>26}"
          f"{'median step s':>15}")  # fmt: skip
    for recipe, r in summary["recipes"].items():
        tau = f"{r['tau']:.3f} ± {r['tau_se']:.3f}"
        print(f"{recipe:<14}{r['seeds']:>6}{r['steps']:>7}{r['row_tokens']:>6}{tau:>26}"
              f"{r['median_step_s']:>15.3f}")  # fmt: skip
    print(f"\n{'drafter':<22}{'tau':>8}{'± prompts':>11}{'lossless':>10}{'step s':>9}{'run s':>8}")
    for name, d in summary["drafters"].items():
        tau, se = d.get("tau", float("nan")), d.get("tau_se", float("nan"))
        run_s = "-" if d["seconds"] is None else f"{d['seconds']:.0f}"
        print(f"{name:<22}{tau:>8.3f}{se:>11.3f}{d.get('lossless', '-')!s:>10}"
              f"{d['median_step_s']:>9.3f}{run_s:>8}")  # fmt: skip
    print(f"\nload average {summary['load_avg_start']} at start, {summary['load_avg_end']} at end; "
          f"{summary['wall_s']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
