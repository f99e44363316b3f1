"""Our drafters in llama.cpp: its speculative decoding against ours, prompt by prompt.

    python bench/llamacpp_accept.py --llama-cpp SRC --target smollm2-135m-instruct \
        --drafter EXPORT [--drafter EXPORT ...] --prompts extract/data/smollm2_held_out.json

SRC: a llama.cpp source tree with `llama-speculative-simple` built in SRC/build/bin (e.g. the
one `llama-cpp-python` 0.3.36's sdist vendors: `pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`, then `cmake -B build -DLLAMA_CURL=OFF && cmake --build build
--target llama-speculative-simple`). Its `convert_hf_to_gguf.py` (with its own gguf-py; it
needs `sentencepiece` importable, `--convert-path` adds a folder holding it) writes the target
and every drafter export as float32 GGUF files in --work, named by a hash of the folder's path,
sizes and times (a changed folder is converted again). Each prompt (chat template applied, as
`train.proof.speculate` does) is decoded greedily by `llama-speculative-simple` with the
drafter's family (`draft-dflash` for DFlash and DFlash2, `draft-dspark` for DSpark), every block
drafted whole (no probability cut), float32 K/V caches, one thread; and by `python -m
train.proof.speculate --full-blocks` on the same prompts and new tokens (llama.cpp drafts whole
blocks and cuts its output too). A target that llama.cpp decodes with state checkpoints (hybrid
or recurrent) is refused: its log then does not give each verify step's acceptance.

The two schedules differ at the start: our prefill makes the first token and the first block
drafts after it (z-lab's and vLLM's schedule); llama.cpp's prompt pass leaves the prompt's last
token out, and its first verify step, which drafts from that token, also makes our prefill's
token. Where that first step accepts no draft, the two schedules coincide from then on and the
steps are compared one for one; elsewhere the blocks start at other tokens. Per prompt, within
the tokens our decoding made: each verify step's tokens (llama.cpp's from its debug log,
`accepted k/n draft tokens`), the accepted drafts of both, and whether llama.cpp's answer is
ours. Per drafter: each engine's tau (tokens per verify step, its own schedule) with its
standard error, the accepted drafts of both and their paired relative difference, the drafts
llama.cpp accepted at its first step, and how many prompts agree; --json writes every row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.proof.tau import paired_difference, ratio_se  # noqa: E402

ACCEPTED = re.compile(r"accepted (\d+)/\d+ draft tokens")
ENCODED = re.compile(r"encoded\s+(\d+) tokens")
CHECKPOINTS = ("will use checkpoints", "partial acceptance")


def fingerprint(folder: Path) -> str:
    """A short hash of a model folder's resolved path and its files' names, sizes and times."""
    folder = folder.resolve()
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())]
    return hashlib.sha256(json.dumps([str(folder), stats]).encode()).hexdigest()[:12]


def convert(src: Path, model: Path, work: Path, *, target: Path | None, path: str) -> Path:
    """`model` (a Hugging Face folder) as a float32 GGUF file in `work`, unless already there."""
    out = work / f"{model.name}-{fingerprint(model)}-f32.gguf"
    if out.exists():
        return out
    tmp = f"{out}.{os.getpid()}.tmp"  # another run converting the same folder writes its own
    command = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model)]
    command += ["--outtype", "f32", "--outfile", tmp]
    if target is not None:
        command += ["--target-model-dir", str(target)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(src / "gguf-py"), path) if p),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"converting {model} failed:\n{done.stderr[-3000:]}")
    os.replace(tmp, out)
    return out


def family(export: Path) -> tuple[str, int]:
    """(llama.cpp's speculative type, drafts per block) of a drafter export."""
    from train.export import CONFIG_FILE, config_from_hf

    cfg = config_from_hf(json.loads((export / CONFIG_FILE).read_text()))
    if cfg.drafter_type == "dspark":
        return "draft-dspark", cfg.block_size  # anchor first: the whole block drafts
    return "draft-dflash", cfg.block_size - 1  # [last token, MASK x (B - 1)]


def llama_decode(
    binary: Path, target: Path, draft: Path, text: str, *, kind: str, drafts: int, new: int
) -> dict[str, Any]:
    """One greedy speculative decoding by llama.cpp: its prompt length, the drafts accepted at
    each verify step (from its debug log) and its printed answer."""
    command = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", kind]
    command += ["-p", text, "-n", str(new), "--temp", "0", "--top-k", "1", "--seed", "0"]
    command += ["--spec-draft-n-max", str(drafts), "--spec-draft-n-min", "0"]
    command += ["--spec-draft-p-min", "0", "-t", "1", "-td", "1", "-c", "2048", "-v"]
    command += ["-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"]
    done = subprocess.run(command, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:8])} ... failed:\n{log[-3000:]}")
    if any(phrase in log for phrase in CHECKPOINTS):
        raise SystemExit(
            "llama.cpp decodes this target with state checkpoints (a hybrid or recurrent "
            "target): its log does not give each verify step's acceptance; not compared"
        )
    encoded = ENCODED.search(log)
    return {
        "prompt_tokens": int(encoded.group(1)) if encoded else None,
        "accepted": [int(k) for k in ACCEPTED.findall(log)],
        "printed": printed_answer(done.stdout, text),
    }


def printed_answer(stdout: str, prompt: str) -> str | None:
    """What llama-speculative-simple printed after the prompt: it prints two newlines, the
    prompt's pieces, the answer's, then four newlines. None if the prompt is not found there.

    >>> printed_answer("\\n\\nQ: hi\\nA: yes\\n\\n\\n\\n\\n", "Q: hi\\n")
    'A: yes\\n'
    """
    body = stdout.removeprefix("\n\n").removesuffix("\n\n\n\n")
    return body[len(prompt) :] if body.startswith(prompt) else None


def clipped(accepted: list[int], limit: int) -> list[int]:
    """Tokens made by each verify step, the steps cut where `limit` tokens are reached.

    >>> clipped([0, 3, 1, 15], 8)
    [1, 4, 2, 1]
    """
    lengths, total = [], 0
    for k in accepted:
        if total >= limit:
            break
        lengths.append(min(k + 1, limit - total))
        total += lengths[-1]
    return lengths


def our_decode(
    target: Path, drafters: list[Path], prompts: Path, new: int, work: Path
) -> list[dict]:
    """`train.proof.speculate --full-blocks --json`'s line per drafter; kept in `work` and
    reused by a rerun with the same target, drafters (by fingerprint), prompts and new tokens."""
    key = [fingerprint(target), [fingerprint(d) for d in drafters], prompts.read_text(), new]
    kept = work / f"ours-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:12]}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    command = [sys.executable, "-m", "train.proof.speculate", "--target", str(target)]
    for d in drafters:
        command += ["--drafter", str(d)]
    command += ["--prompts", str(prompts), "--max-new-tokens", str(new)]
    command += ["--full-blocks", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train.proof.speculate failed:\n{done.stderr[-3000:]}")
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kept.write_text(json.dumps(runs) + "\n")
    return runs


def compare(mine: dict[str, Any], theirs: dict[str, Any], answer: str, p: list[int], n: int):
    """One prompt's row: `mine`, our per-prompt JSON row; `answer`, its text."""
    lengths = clipped(theirs["accepted"], mine["new_tokens"])
    ended = mine["new_tokens"] < n  # ours stopped at an end token: the answers must be equal
    printed = theirs["printed"]
    same_text = printed is not None and (printed == answer if ended else printed.startswith(answer))
    aligned = bool(lengths) and lengths[0] == 1  # its first step made only our prefill's token
    return {
        "prompt_tokens": [len(p), theirs["prompt_tokens"]],
        "new_tokens": mine["new_tokens"],
        "lengths": [mine["lengths"], lengths],
        # accepted drafts in the first new_tokens tokens: ours, llama.cpp's
        "accepted": [sum(mine["lengths"]) - len(mine["lengths"]), sum(lengths) - len(lengths)],
        "same_text": same_text,
        "aligned": aligned,
        "same_steps": aligned and lengths[1:] == mine["lengths"],
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [[len(r["lengths"][i]) for r in rows] for i in (0, 1)]
    made = [[sum(r["lengths"][i]) for r in rows] for i in (0, 1)]
    accepted = [[r["accepted"][i] for r in rows] for i in (0, 1)]
    ones = [1] * len(rows)
    enough = len(rows) >= 2 and min(sum(a) for a in accepted) > 0
    return {
        "prompts": len(rows),
        "same_prompt_length": sum(a == b for a, b in (r["prompt_tokens"] for r in rows)),
        "same_text": sum(r["same_text"] for r in rows),
        # tokens per verify step, each engine's own schedule: ours, llama.cpp's
        "tau": [ratio_se(made[i], steps[i]) for i in (0, 1)] if len(rows) >= 2 else None,
        "accepted_drafts": [sum(a) for a in accepted],
        "accepted_llama_vs_ours": (
            paired_difference((accepted[0], ones), (accepted[1], ones)) if enough else None
        ),
        "same_accepted": sum(a == b for a, b in zip(*accepted, strict=True)),
        # drafts llama.cpp accepted at its first step, which also makes our prefill's token
        "llama_first_step_accepted": sum(r["lengths"][1][0] - 1 for r in rows if r["lengths"][1]),
        "aligned_prompts": sum(r["aligned"] for r in rows),
        "aligned_same_steps": sum(r["same_steps"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source, built")
    parser.add_argument("--target", required=True, help="a target folder or named real target")
    parser.add_argument("--drafter", type=Path, action="append", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("bench-out/llamacpp"))
    parser.add_argument("--convert-path", default="", help="PYTHONPATH extra for the converter")
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from extract.models import resolve_target
    from train.proof.speculate import load_prompts

    target = Path(resolve_target(args.target)).resolve()
    drafters = [d.resolve() for d in args.drafter]
    prompts_file, new = args.prompts.resolve(), args.max_new_tokens
    binary = args.llama_cpp / "build" / "bin" / "llama-speculative-simple"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: build llama-speculative-simple in {args.llama_cpp}")
    args.work.mkdir(parents=True, exist_ok=True)
    conv = dict(path=args.convert_path)
    target_gguf = convert(args.llama_cpp, target, args.work, target=None, **conv)
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = load_prompts(prompts_file, tokenizer, len(tokenizer))
    texts = [tokenizer.decode(p) for p in ids]
    ours = our_decode(target, drafters, prompts_file, new, args.work)
    results = []
    for k, export in enumerate(drafters):
        kind, drafts = family(export)
        draft = convert(args.llama_cpp, export, args.work, target=target, **conv)
        rows = []
        for n, (text, p) in enumerate(zip(texts, ids, strict=True)):
            theirs = llama_decode(
                binary, target_gguf, draft, text, kind=kind, drafts=drafts, new=new
            )
            mine = ours[k]["per_prompt"][n]
            answer = tokenizer.decode(mine["new_ids"], skip_special_tokens=True)
            rows.append({"prompt": n, **compare(mine, theirs, answer, p, new)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "lengths"}), flush=True)
        summary = {"drafter": str(export), "spec_type": kind, "drafts_per_block": drafts}
        summary |= summarize(rows)
        print(json.dumps(summary), flush=True)
        results.append(summary | {"rows": rows})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
