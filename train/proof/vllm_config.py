"""`python -m train.proof.vllm_config --target PATH --drafter EXPORT`: how vLLM reads an export.

Run in a vLLM environment (`.ci/run` builds one; README "Serve it"). It builds vLLM's speculative
config of the drafter on the target exactly as `vllm serve` does from `--speculative-config`
(the method from the export's architecture: dflash, or dspark for `Qwen3DSparkModel`), then the
whole engine config, and prints one JSON line: the method, the draft architectures and the model
class vLLM resolves them to, the target layers it will capture (its aux hidden-state ids, which
are ours + 1), the speculative tokens, DSpark's head fields as vLLM read them, and the engine
config's error if it stops (vLLM's CPU build parses DSpark but its V1 model runner cannot run it;
the V2 runner needs Triton). A key vLLM misreads or lacks fails before that error, in the
speculative config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

# vLLM's speculative method of an export's architecture (anything else: dflash).
METHODS = {"Qwen3DSparkModel": "dspark", "DFlashDraftModel": "dflash"}


def vllm_view(target: str, drafter: Path, *, max_model_len: int = 256) -> dict[str, Any]:
    """What vLLM makes of `drafter` served beside `target` (see the module docstring)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    config = json.loads((Path(drafter) / "config.json").read_text())
    architecture = (config.get("architectures") or [""])[0]
    method = METHODS.get(architecture, "dflash")
    block = int(config.get("block_size") or config.get("dflash_config", {}).get("block_size", 16))
    # Drafts per verify step: DSpark drafts its whole block, DFlash its block but the anchor.
    speculative = {
        "method": method,
        "model": str(drafter),
        "num_speculative_tokens": block if method == "dspark" else block - 1,
    }

    def engine_args() -> EngineArgs:
        return EngineArgs(
            model=target,
            speculative_config=dict(speculative),
            max_model_len=max_model_len,
            dtype="float32",
        )

    args = engine_args()
    spec = args.create_speculative_config(args.create_model_config(), ParallelConfig())
    draft = spec.draft_model_config
    model_class, _ = ModelRegistry.resolve_model_cls(draft.architectures, model_config=draft)
    try:
        engine_args().create_engine_config()
        engine_error = None
    except Exception as e:  # the runner's refusal, reported: what stops and where
        engine_error = f"{type(e).__name__}: {e}"
    fields = ("markov_rank", "enable_confidence_head", "confidence_head_with_markov")
    return {
        "method": spec.method,
        "architectures": list(draft.architectures),
        "model_class": model_class.__name__,
        "aux_layers": list(get_eagle3_aux_layers_from_config(spec) or ()),
        "num_speculative_tokens": spec.num_speculative_tokens,
        **{name: getattr(draft.hf_config, name, None) for name in fields},
        "engine_error": engine_error,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--target", required=True, help="the target model folder")
@click.option(
    "--drafter", required=True, type=click.Path(path_type=Path, exists=True, file_okay=False)
)
def main(target: str, drafter: Path) -> None:
    """Print (one JSON line) how vLLM reads the drafter export beside the target."""
    from train.proof.serve_check import require_engine

    require_engine("vllm")
    click.echo(json.dumps(vllm_view(target, drafter)))


if __name__ == "__main__":
    main()
