"""Our cache in speculators' offline layout, and speculators' DFlash checkpoint in z-lab's format.

The layout (speculators 0.9.0, `speculators.train.data.ArrowDataset` over a `FileTransfer`):
`OUT/` a `datasets.save_to_disk` folder with columns `input_ids`, `loss_mask`, `seq_len` (torch
format), and `OUT/hidden_states/hs_{i}.safetensors` for dataset row i, holding `token_ids`
int64 [S] and `hidden_states` [S, taps + 1, H]: the taps, then the target's final layer output
*before* the final norm (speculators applies the verifier's norm and lm_head to that last slot
to make its targets). Its layer ids are ours + 1: speculators names a state by its index in
Hugging Face's `hidden_states` (0 the embeddings), we name it by the decoder layer that made it.

Our cache stores the last layer *after* the final norm (`shared.manifest.LAYER_CONVENTION`), so
the pre-norm state itself is gone: the last slot holds y / w instead (y the cached state, w the
final norm's weight). RMSNorm is invariant to the scale of its input, so w * z / rms(z) with
z = y / w is y again up to the norm's eps (relative 1e-5) and the cache's bf16 rounding of y,
which moves rms(z) off 1: on SmolLM2's real cache speculators' norm of the slot gave y back
within 0.15% (a scale of the logits; their argmax is the next data token at 98.4% of the
supervised rows). Speculators' targets are thus the target's own logits, which is all that
slot is used for (`DFlashDraftModel._backbone_forward`: verifier_lm_head(verifier_norm(.))).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from shared.cache import open_part
from shared.manifest import read_manifest

HS_DIR = "hidden_states"


def spec_layer_ids(our_ids: Sequence[int]) -> list[int]:
    """Speculators' id of each of our layer ids (its `hidden_states` index).

    >>> spec_layer_ids([1, 8, 14, 20, 27])
    [2, 9, 15, 21, 28]
    """
    return [int(i) + 1 for i in our_ids]


def prenorm_equivalent(post_TH: torch.Tensor, norm_weight_H: torch.Tensor) -> torch.Tensor:
    """A state whose RMSNorm with `norm_weight_H` is `post_TH` (to the norm's eps): post / w.

    >>> w = torch.tensor([2.0, 0.5]); x = torch.tensor([[3.0, -4.0]])
    >>> y = w * x / x.pow(2).mean(-1, keepdim=True).sqrt()
    >>> z = prenorm_equivalent(y, w)
    >>> torch.allclose(w * z / z.pow(2).mean(-1, keepdim=True).sqrt(), y)
    True
    """
    return post_TH.float() / norm_weight_H.float()


def layout_order(num_samples: int, held: Sequence[int]) -> list[int]:
    """Stored positions in layout order: the trained ones, then the `held` ones (speculators
    holds out the tail of its dataset, `train_data_ratio`).

    >>> layout_order(5, [1, 3])
    [0, 2, 4, 1, 3]
    """
    held_set = set(held)
    return [i for i in range(num_samples) if i not in held_set] + sorted(held_set)


def train_ratio(num_samples: int, num_held: int) -> float:
    """The `--train-data-ratio` whose split (`int(n * ratio)` rows trained) keeps exactly the
    first `num_samples - num_held` rows.

    >>> n, r = 460, train_ratio(460, 23); int(n * r)
    437
    """
    return (num_samples - num_held + 0.5) / num_samples


def write_layout(
    cache: Path,
    out: Path,
    *,
    taps: Sequence[int],
    norm_weight: torch.Tensor,
    held: Sequence[int] = (),
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Write `cache`'s samples (our layer ids `taps`, then its last layer) into speculators'
    layout under `out`; `held` are stored positions put last. Returns what it wrote (also in
    `out/peer_layout.json`). `dtype`: float32 keeps the bf16 cache exact and y / w unrounded."""
    from datasets import Dataset  # speculators' own reader is datasets.load_from_disk

    manifest = read_manifest(cache)
    last = manifest.target.num_layers - 1
    ids = list(manifest.layer_ids)
    missing = [i for i in [*taps, last] if i not in ids]
    if missing:
        raise ValueError(
            f"{cache}: layers {missing} are not cached (it holds {ids}); the last layer "
            f"({last}) is the target state speculators needs: extract with --layers ...,{last}"
        )
    positions = [ids.index(i) for i in [*taps, last]]
    samples = [s for rec in manifest.parts for s in open_part(cache / rec.name).iter_samples()]
    order = layout_order(len(samples), held)
    (out / HS_DIR).mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row, pos in enumerate(order):
        s = samples[pos]
        hidden = s.hidden_tensor("cpu")[:, positions].float()  # [S, taps + 1, H]
        hidden[:, -1] = prenorm_equivalent(hidden[:, -1], norm_weight)
        token_ids = torch.from_numpy(s.input_ids.astype(np.int64))
        save_file(
            {"token_ids": token_ids, "hidden_states": hidden.to(dtype).contiguous()},
            str(out / HS_DIR / f"hs_{row}.safetensors"),
        )
        rows["input_ids"].append(token_ids.tolist())
        rows["loss_mask"].append(s.loss_mask.astype(np.int64).tolist())
        rows["seq_len"].append(len(token_ids))
    data = Dataset.from_dict(rows)
    data.set_format(type="torch")
    data.save_to_disk(str(out))
    info = {
        "cache": str(cache),
        "samples": len(order),
        "held_last": len(held),
        "sample_index_order": [int(samples[p].sample_index) for p in order],
        "our_layer_ids": list(taps),
        "last_layer": last,
        "aux_hidden_state_layer_ids": spec_layer_ids(taps),
        "tokens": int(sum(rows["seq_len"])),
        "dtype": str(dtype).removeprefix("torch."),
    }
    (out / "peer_layout.json").write_text(json.dumps(info, indent=2))
    return info


def zlab_config(spec_config: dict[str, Any], *, num_target_layers: int) -> dict[str, Any]:
    """z-lab's DFlash `config.json` for a speculators DFlash checkpoint's config (the tensor
    names are the same): the Qwen3 decoder config at the top level, the DFlash fields beside it,
    the layer ids back in z-lab's convention (speculators' - 1, as its converter adds 1).
    Speculators' sliding layers are causal inside the block unless `sliding_window_non_causal`;
    `is_causal` says so explicitly (our loaders' default for sliding layers, written anyway)."""
    layer = dict(spec_config["transformer_layer_config"])
    for key in ("_attn_implementation", "architectures", "auto_map", "transformers_version"):
        layer.pop(key, None)
    aux = list(spec_config["aux_hidden_state_layer_ids"])
    layer_types = layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"]
    out = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "layer_types": list(layer_types),
        "block_size": int(spec_config["block_size"]),
        "num_target_layers": int(num_target_layers),
        "tie_word_embeddings": False,
        "dflash_config": {
            "mask_token_id": int(spec_config["mask_token_id"]),
            "target_layer_ids": [i - 1 for i in aux],
        },
    }
    if "sliding_attention" in layer_types:
        out["is_causal"] = not bool(spec_config.get("sliding_window_non_causal", False))
    return out


def write_zlab_export(checkpoint: Path, out: Path, *, num_target_layers: int) -> Path:
    """A speculators DFlash checkpoint folder (`config.json`, `model.safetensors`) as a z-lab
    DFlash export in `out`: the config rewritten (`zlab_config`), the tensors copied as they are
    (speculators saves exactly the export's names: no embedding, no lm_head for a full-vocabulary
    drafter, no verifier weights)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads((checkpoint / "config.json").read_text())
    config = zlab_config(spec, num_target_layers=num_target_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copyfile(checkpoint / "model.safetensors", out / "model.safetensors")
    return out
