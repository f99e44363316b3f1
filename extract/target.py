"""The target model: its facts, loading it for capture, and what the cache keeps of it."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from extract.parallel import engine_places
from shared import target_identity as identity
from shared.fsio import public_modes, replace_dir
from shared.manifest import TargetInfo
from shared.space import size_text
from shared.target_files import EMBED_FILE, EMBED_KEY, LM_HEAD_KEY, TARGET_DIR

log = logging.getLogger(__name__)


SHAPE_KEYS = ("num_hidden_layers", "hidden_size")  # what planning reads of any target


class TargetError(ValueError):
    """The target cannot be used; the message says why and what to do."""


def load_failure(target: str, device: torch.device, error: Exception) -> str:
    """The message of `target` that raised `error` while loading on `device`: a TargetError's
    own, else what was raised."""
    if isinstance(error, TargetError):
        return str(error)
    return f"--target {target}: it did not load on {device} ({type(error).__name__}: {error})"


def build_target_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """The DFlash default capture rule.

    >>> build_target_layer_ids(36, 5)
    [1, 9, 17, 25, 33]
    >>> build_target_layer_ids(64, 5)
    [1, 16, 31, 46, 61]
    >>> build_target_layer_ids(36, 1)
    [18]
    """
    if num_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + k * span / (num_layers - 1)) for k in range(num_layers)]


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal Qwen3.5/3.6 configs nest it)."""
    return config.get("text_config") or config


def read_config(target: str) -> dict[str, Any]:
    path = Path(target)
    if not (path / "config.json").is_file():
        hint = "it has no config.json"
        if not path.is_dir():
            hint = "it is not a folder, nor a hub id in the local Hugging Face cache"
        raise TargetError(
            f"--target {target!r}: {hint}; give a local Hugging Face model folder "
            "(download it first: this tool never fetches models)"
        )
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TargetError(
            f"--target {target}: {path / 'config.json'} cannot be read ({e}); restore it "
            "from the model's original files"
        ) from None
    missing = [k for k in SHAPE_KEYS if not isinstance(text_config(config).get(k), int)]
    if missing:
        raise TargetError(
            f"--target {target}: its config.json has no integer {' or '.join(missing)}, which "
            "every Hugging Face causal LM's holds: is it a language model's folder?"
        )
    return config


def check_model_type(target: str, config: dict[str, Any]) -> None:
    """Refuse, before any work, a model type this transformers does not know."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING_NAMES:
        raise TargetError(
            f"--target {target}: model_type {kind!r} is not one transformers "
            f"{transformers.__version__} knows: a newer transformers may "
            "(pip install -U transformers), or the folder's config.json is not a causal LM's"
        )


SHARD_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map
MISSING_LISTED = 5  # missing weights an error names


def weight_files(target: Path) -> list[Path]:
    """The target's safetensors files, each checked to open (headers only: fast), and every
    file its shard index lists there."""
    files = identity.safetensors_files(target)
    if not files:
        raise TargetError(f"--target {target}: no *.safetensors weight files found")
    index = Path(target) / SHARD_INDEX
    # transformers reads a single model.safetensors before any index: one beside it is unused
    if index.is_file() and not (Path(target) / "model.safetensors").is_file():
        try:
            listed = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise TargetError(
                f"--target {target}: {index} cannot be read ({e!r}); restore it from the "
                "model's original files"
            ) from None
        missing = sorted(str(n) for n in listed if not (Path(target) / str(n)).is_file())
        if missing:
            raise TargetError(
                f"--target {target}: {len(missing)} of the {len(listed)} weight files its "
                f"{SHARD_INDEX} lists are not there: {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''}; download or copy them again"
            )
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except (OSError, SafetensorError) as e:
            raise TargetError(
                f"--target {target}: {f} cannot be read ({e}); download or copy it again"
            ) from None
    return files


def content_hash(target: Path) -> str:
    """`shared.target_identity.content_hash` of the target folder (its weight files checked)."""
    return identity.content_hash(Path(target) / "config.json", weight_files(target))


def weights_sample(target: Path) -> str:
    """`shared.target_identity.weights_sample` of the target folder (its weight files checked)."""
    return identity.weights_sample(weight_files(target))


def target_info(target: str, config: dict[str, Any], tokenizer_vocab: int) -> TargetInfo:
    tc = text_config(config)
    return TargetInfo(
        path=str(target),
        revision=content_hash(Path(target)),
        weights_sample=weights_sample(Path(target)),
        model_type=str(config.get("model_type", "unknown")),
        num_layers=int(tc["num_hidden_layers"]),
        hidden_size=int(tc["hidden_size"]),
        vocab_size=int(tc["vocab_size"]),
        tokenizer_vocab_size=tokenizer_vocab,
    )


def _find_key(files: list[Path], suffix: str) -> tuple[Path, str] | None:
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key == suffix or key.endswith("." + suffix):
                    return f, key
    return None


def check_layer_weights(target: Path, last_layer: int) -> None:
    """Refuse, from the weight files' headers, a target lacking every tensor of a decoder layer
    this run computes (0..`last_layer`), named as its embedding is (`model.layers.N.`); files
    that name their layers otherwise are left to the load's own check (`load_target`)."""
    files = weight_files(target)
    embed = _find_key(files, "embed_tokens.weight")
    if embed is None:
        return
    prefix = embed[1].removesuffix("embed_tokens.weight")
    layer = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    found = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            found.update(int(m.group(1)) for k in st.keys() if (m := layer.match(k)))
    missing = [i for i in range(last_layer + 1) if i not in found]
    if found and missing:
        more = " ..." if len(missing) > MISSING_LISTED else ""
        ids = ", ".join(map(str, missing[:MISSING_LISTED])) + more
        raise TargetError(
            f"--target {target}: its weight files hold no tensor of {len(missing)} of the "
            f"{last_layer + 1} decoder layers this run computes (layers {ids}; "
            f"`{prefix}layers.N.*`), which would run on random values: is a weight file missing, "
            "or is config.json (num_hidden_layers) another model's?"
        )


def write_target_files(target: Path, tokenizer: Any, cache: Path) -> None:
    """Write `<cache>/target/`: tokenizer, config.json, embedding and lm_head (read from the
    safetensors files directly, never loading the model). Atomic: tmp folder, then rename."""
    files = weight_files(target)
    embed = _find_key(files, "embed_tokens.weight")
    if embed is None:
        raise TargetError(f"--target {target}: no `embed_tokens.weight` tensor in its weights")
    tensors = {}
    with safe_open(str(embed[0]), framework="pt") as st:
        tensors[EMBED_KEY] = st.get_tensor(embed[1]).contiguous()
    head = _find_key(files, "lm_head.weight")
    if head is not None:
        with safe_open(str(head[0]), framework="pt") as st:
            tensors[LM_HEAD_KEY] = st.get_tensor(head[1]).contiguous()
    elif not text_config(read_config(str(target))).get("tie_word_embeddings", False):
        raise TargetError(f"--target {target}: no `lm_head.weight` and embeddings are not tied")
    final = Path(cache) / TARGET_DIR
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tokenizer.save_pretrained(str(tmp))
        shutil.copyfile(Path(target) / "config.json", tmp / "config.json")
        save_file(tensors, str(tmp / EMBED_FILE))
        public_modes(tmp)
        replace_dir(tmp, final)
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left to block the same command
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        raise TargetError(
            f"cannot write {final} ({e}); it needs about {size_text(need)} (free: "
            f"{_free(cache)}): free space or fix the folder, then rerun the same command"
        ) from None


def _free(folder: Path) -> str:
    try:
        return size_text(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a causal LM (Qwen3, Qwen3.5/3.6 and most HF decoders)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for candidate in (base, getattr(base, "language_model", None), getattr(base, "model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TargetError(f"cannot find the decoder layers of {type(model).__name__}")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm after the last decoder layer (a sibling of the layer list, as in Qwen3)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for candidate in (base, getattr(base, "language_model", None), getattr(base, "model", None)):
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            norm = getattr(candidate, "norm", None)
            if isinstance(norm, nn.Module):
                return norm
    raise TargetError(f"cannot find the final norm of {type(model).__name__}")


def num_decoder_layers(model: nn.Module) -> int:
    """The target's layer count from its config (its layer list may have been truncated)."""
    config = model.config.get_text_config() if hasattr(model, "config") else None
    layers = getattr(config, "num_hidden_layers", None)
    return int(layers) if layers is not None else len(decoder_layers(model))


def load_target(
    target: str, *, device: torch.device, last_layer: int, sharding: dict | None = None
) -> nn.Module:
    """Load the causal LM for capture: bf16 on GPU, fp32 on CPU, eval mode, and without the
    layers after `last_layer` (they would be computed for nothing). `sharding`: the arguments
    of transformers' DistributedConfig that shard it over this process group
    (`extract.parallel.engine_kwargs`); it then places the weights itself. A layout of one
    process (`--parallel fsdp=1`) is loaded as without one: the engine would shard nothing."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sharded = bool(sharding) and engine_places(sharding)
    if sharded:
        from transformers.distributed import DistributedConfig

        placement = {"distributed_config": DistributedConfig(**sharding)}
    else:
        # device_map loads weights straight onto the GPU (it needs `accelerate`); CPU needs none.
        placement = {"device_map": str(device)} if device.type == "cuda" else {}
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            target, dtype=dtype, output_loading_info=True, **placement
        )
    except OSError as e:  # a weight file gone or unreadable since planning checked them
        raise TargetError(
            f"--target {target}: its weights cannot be loaded ({e}); download or copy the "
            "model's files again"
        ) from None
    layer_types = text_config(model.config.to_dict()).get("layer_types")
    notice = linear_attention_notice(layer_types, device.type, fla_installed=_fla_usable())
    if notice is not None:
        log.log(*notice)
    try:
        model = truncate(model.eval().requires_grad_(False), last_layer)
    except TargetError as e:
        raise TargetError(
            f"--target {target}: {e}: extraction takes a decoder whose layers are a `layers` "
            "list (Qwen3, Qwen3.5/3.6, Llama-style)"
        ) from None
    # transformers fills weights its files lack with random values and only warns; those of the
    # layers kept are an error (extra tensors in the files stay its warning)
    kept = set(model.state_dict())
    missing = sorted(k for k in loading["missing_keys"] if k in kept)
    if missing:
        raise TargetError(missing_weights(target, missing))
    return model if sharded else model.to(device)


def missing_weights(target: str, names: list[str]) -> str:
    """The error for weights of the layers a run uses that the target's files do not hold.

    >>> missing_weights("t", ["model.layers.8.mlp.up_proj.weight"])[:62]
    '--target t: 1 weight of the layers this run uses is not in its'
    """
    shown = ", ".join(names[:MISSING_LISTED]) + (" ..." if len(names) > MISSING_LISTED else "")
    count = f"{len(names)} weight{'s' if len(names) > 1 else ''}"
    verb = "are" if len(names) > 1 else "is"
    return (
        f"--target {target}: {count} of the layers this run uses {verb} not in its weight "
        f"files ({shown}), and would run on random values: is a weight file missing, or is "
        "config.json (num_hidden_layers) another model's?"
    )


def linear_attention_notice(
    layer_types: list[str] | None, device_type: str, *, fla_installed: bool
) -> tuple[int, str] | None:
    """(log level, message) for a hybrid target's linear-attention layers on a GPU: without
    flash-linear-attention they run on transformers' PyTorch fallback; with it, its Triton
    kernels tune themselves the first time a machine sees a batch shape, which makes a first
    run's first parts slow.

    >>> linear_attention_notice(["full_attention"] * 4, "cuda", fla_installed=False) is None
    True
    """
    if device_type != "cuda" or "linear_attention" not in (layer_types or ()):
        return None
    if not fla_installed:
        return logging.WARNING, (
            "the target's linear-attention layers will run on transformers' PyTorch fallback: "
            "install flash-linear-attention (pip install flash-linear-attention) for its "
            "Triton kernels, much faster on a GPU"
        )
    return logging.INFO, (
        "flash-linear-attention tunes its kernels the first time this machine sees a batch "
        "shape (seconds each; see the README's Results), so a first run's first parts are slow; "
        "the results stay in Triton's cache (TRITON_CACHE_DIR, by default ~/.triton/cache) for "
        "later runs"
    )


def _fla_usable() -> bool:
    """Whether transformers will use flash-linear-attention (installed, a version it accepts)."""
    from transformers.utils.import_utils import is_flash_linear_attention_available

    return bool(is_flash_linear_attention_available())


def truncate(model: nn.Module, last_layer: int) -> nn.Module:
    layers = decoder_layers(model)
    del layers[last_layer + 1 :]
    return model
