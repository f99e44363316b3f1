"""A target folder to GGUF with llama.cpp's converter, for `--llama-server` routes.

    python bench/gguf_convert.py --llama-cpp SRC --target PATH_OR_NAME --out FILE [--outtype f32]

SRC: a llama.cpp source tree (its `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`; it needs
`sentencepiece` importable). The converter names a BPE tokenizer's pre-tokenizer by a hash of
its tokens on a fixed text and refuses hashes it does not know; the embedded tiny demo target's
tokenizer is trained on the demo corpus (its hash is its own) but splits text with Qwen2's
pattern (`extract.tiny`), so an unknown hash is written as `qwen2` when the tokenizer's
pre-tokenizer is that pattern, and refused as before otherwise.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def qwen2_split(target: Path) -> bool:
    """Whether the target's tokenizer.json pre-tokenizes with Qwen2's split pattern."""
    from extract.tiny import SPLIT_PATTERN

    spec = json.loads((target / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    steps = spec.get("pretokenizers", [spec])
    return any(step.get("pattern", {}).get("Regex") == SPLIT_PATTERN for step in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree")
    parser.add_argument("--target", default=None, help="folder or named target (default: tiny)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--outtype", default="f32", help="f32 (as the local route), bf16, ...")
    args = parser.parse_args()
    from extract.models import resolve_target
    from extract.tiny import tiny_target

    target = Path(resolve_target(args.target) if args.target else tiny_target())
    src = args.llama_cpp.resolve()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    if qwen2_split(target):
        from conversion import base

        known = base.TextModel.get_vocab_base_pre

        def vocab_base_pre(self, tokenizer) -> str:
            try:
                return known(self, tokenizer)
            except NotImplementedError:
                return "qwen2"

        base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(src / "convert_hf_to_gguf.py"), str(target), "--outfile", str(args.out)]
    sys.argv += ["--outtype", args.outtype]
    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")


if __name__ == "__main__":
    main()
