"""Our drafters in llama.cpp: its speculative decoding against ours, prompt by prompt.

    python bench/llamacpp_accept.py --llama-cpp SRC --target smollm2-135m-instruct \
        --drafter EXPORT [--drafter EXPORT ...] --prompts extract/data/smollm2_held_out.json

SRC: a llama.cpp source tree with `llama-speculative-simple` built in SRC/build/bin (e.g. the
one `llama-cpp-python` 0.3.36's sdist vendors: `pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`, then `cmake -B build -DLLAMA_CURL=OFF && cmake --build build
--target llama-speculative-simple`). Its `convert_hf_to_gguf.py` (with its own gguf-py; it
needs `sentencepiece` importable, `--convert-path` adds a folder holding it) writes the target
and every drafter export as float32 GGUF files in --work (once: reused when present). Each
prompt (chat template applied, as `train.proof.speculate` does) is then decoded greedily by
`llama-speculative-simple` with the drafter's family (`draft-dflash` for DFlash and DFlash2,
`draft-dspark` for DSpark), drafting the whole block (no probability cut), one thread, and by
`python -m train.proof.speculate` on the same prompts and new tokens.

Compared per prompt, within the tokens our decoding made (the prompt's greedy answer, up to
--max-new-tokens or its end): the drafts accepted at each verify step, from llama.cpp's debug log
(`accepted k/n draft tokens`) and from ours, and the answers' text. The two schedules differ by
one forward: our prefill makes the first token and the first block drafts after it (z-lab's and
vLLM's schedule); llama.cpp's prompt pass leaves the prompt's last token out and the first block
drafts from it (its first step also makes our prefill's token). The blocks of the two then start
at other tokens, so their steps are not compared one for one: the accepted drafts per prompt are
(the same drafter gives about the same number either way). Prints one JSON line per prompt and per
drafter: each engine's tau (tokens per verify step, its own schedule) with its standard error,
the accepted drafts of both and their paired relative difference, and how many prompts had the
same prompt tokens, accepted drafts and text; --json writes every row with the per-step lengths.
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


def convert(src: Path, model: Path, out: Path, *, target: Path | None, path: str) -> Path:
    """`model` (a Hugging Face folder) as a float32 GGUF file `out`, unless already there."""
    if out.exists():
        return out
    command = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model)]
    command += ["--outtype", "f32", "--outfile", str(out) + ".tmp"]
    if target is not None:
        command += ["--target-model-dir", str(target)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(src / "gguf-py"), path) if p),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"converting {model} failed:\n{done.stderr[-3000:]}")
    os.replace(str(out) + ".tmp", out)
    return out


def family(export: Path) -> tuple[str, int]:
    """(llama.cpp's speculative type, drafts per block) of a drafter export."""
    config = json.loads((export / "config.json").read_text())
    block = int(config.get("block_size") or config.get("dflash_config", {}).get("block_size", 16))
    if "DSpark" in config["architectures"][0]:
        return "draft-dspark", block  # anchor first: the whole block drafts
    return "draft-dflash", block - 1  # [last token, MASK x (B - 1)]


def llama_decode(
    binary: Path, target: Path, draft: Path, text: str, *, kind: str, drafts: int, new: int
) -> dict[str, Any]:
    """One greedy speculative decoding by llama.cpp: its prompt length, the drafts accepted at
    each verify step (from its debug log) and its printed answer."""
    command = [str(binary), "-m", str(target), "-md", str(draft), "--spec-type", kind]
    command += ["-p", text, "-n", str(new), "--temp", "0", "--top-k", "1", "--seed", "0"]
    command += ["--spec-draft-n-max", str(drafts), "--spec-draft-n-min", "0"]
    command += ["--spec-draft-p-min", "0", "-t", "1", "-td", "1", "-c", "2048", "-v"]
    done = subprocess.run(command, capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:8])} ... failed:\n{log[-3000:]}")
    encoded = ENCODED.search(log)
    printed = done.stdout.strip("\n")  # the prompt's pieces, then the answer's
    return {
        "prompt_tokens": int(encoded.group(1)) if encoded else None,
        "accepted": [int(k) for k in ACCEPTED.findall(log)],
        "answer": printed[len(text) :] if printed.startswith(text) else None,
    }


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
    target: str, drafters: list[Path], prompts: Path, new: int, work: Path
) -> list[dict]:
    """`train.proof.speculate --json`'s line per drafter; kept in `work` and reused by a rerun
    with the same target, drafters, prompts and new tokens."""
    key = json.dumps([target, [str(d) for d in drafters], str(prompts), new])
    kept = work / f"ours-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    command = [sys.executable, "-m", "train.proof.speculate", "--target", target]
    for d in drafters:
        command += ["--drafter", str(d)]
    command += ["--prompts", str(prompts), "--max-new-tokens", str(new), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"train.proof.speculate failed:\n{done.stderr[-3000:]}")
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kept.write_text(json.dumps(runs) + "\n")
    return runs


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

    target = Path(resolve_target(args.target))
    binary = args.llama_cpp / "build" / "bin" / "llama-speculative-simple"
    if not binary.exists():
        raise SystemExit(f"{binary} not found: build llama-speculative-simple in {args.llama_cpp}")
    args.work.mkdir(parents=True, exist_ok=True)
    conv = dict(path=args.convert_path)
    target_gguf = convert(
        args.llama_cpp, target, args.work / "target-f32.gguf", target=None, **conv
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = load_prompts(args.prompts, tokenizer, len(tokenizer))
    texts = [tokenizer.decode(p) for p in ids]
    ours = our_decode(str(target), args.drafter, args.prompts, args.max_new_tokens, args.work)
    results = []
    for k, export in enumerate(args.drafter):
        kind, drafts = family(export)
        name = f"{k}-{export.parent.name}-{export.name}.gguf".replace("/", "_")
        draft = convert(args.llama_cpp, export, args.work / name, target=target, **conv)
        rows = []
        for n, (text, p) in enumerate(zip(texts, ids, strict=True)):
            theirs = llama_decode(
                binary, target_gguf, draft, text, kind=kind, drafts=drafts, new=args.max_new_tokens
            )
            mine = ours[k]["per_prompt"][n]
            answer = tokenizer.decode(mine["new_ids"], skip_special_tokens=True)
            lengths = clipped(theirs["accepted"], mine["new_tokens"])
            rows.append(
                {
                    "prompt": n,
                    "prompt_tokens": [len(p), theirs["prompt_tokens"]],
                    "new_tokens": mine["new_tokens"],
                    "lengths": [mine["lengths"], lengths],
                    # accepted drafts in the first new_tokens tokens, ours and llama.cpp's
                    "accepted": [
                        sum(mine["lengths"]) - len(mine["lengths"]),
                        sum(lengths) - len(lengths),
                    ],
                    "same_text": (theirs["answer"] or "").startswith(answer),
                }
            )
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "lengths"}), flush=True)
        steps = [[len(r["lengths"][i]) for r in rows] for i in (0, 1)]
        made = [[sum(r["lengths"][i]) for r in rows] for i in (0, 1)]
        accepted = [[r["accepted"][i] for r in rows] for i in (0, 1)]
        ones = [1] * len(rows)
        summary = {
            "drafter": str(export),
            "spec_type": kind,
            "drafts_per_block": drafts,
            "prompts": len(rows),
            "same_prompt_tokens": sum(a == b for a, b in (r["prompt_tokens"] for r in rows)),
            "same_text": sum(r["same_text"] for r in rows),
            # tokens per verify step, each engine's own schedule (tau, with standard error)
            "tau": [ratio_se(made[i], steps[i]) for i in (0, 1)],
            "accepted_drafts": [sum(a) for a in accepted],
            "accepted_llama_vs_ours": paired_difference((accepted[0], ones), (accepted[1], ones)),
            "same_accepted": sum(a == b for a, b in zip(*accepted, strict=True)),
            # accepted at llama.cpp's first step, the block our schedule does not draft
            "llama_first_step_accepted": sum(
                r["lengths"][1][0] - 1 for r in rows if r["lengths"][1]
            ),
        }
        print(json.dumps(summary), flush=True)
        results.append(summary | {"rows": rows})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
