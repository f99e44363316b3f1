"""Our DSpark export loaded into `speculators` 0.9.0's `DSparkDraftModel` (the reference model of
a peer trainer, eager attention, fp32) gives our per-slot corrected logits, Markov bias and
confidence logits within 1e-5 on a packed row of two samples with fixed anchors.

`speculators` pins an older transformers than this project's, so it is installed without its
requirements (`pip install --no-deps speculators==0.9.0` plus the few it imports: see
`.ci/run`). Its forward picks anchors at random among the supervised positions before the last
block; with as many anchors as such positions it takes them all, sorted, which fixes them. The
loss it computes (KL by default, and a final norm of its own on the target's state) is not
compared: the model is.
"""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.drafters import tiny_drafter_config
from train.data.batch import Batch
from train.drafters.anchors import block_inputs, block_positions, block_targets, context_starts
from train.drafters.dspark import DSparkDrafter, init_dspark_weights
from train.drafters.mask import build_masks
from train.export import export_drafter
from train.export_load import load_export

pytestmark = pytest.mark.usefixtures("one_thread")

H, V = 64, 300


def _reference_modules() -> SimpleNamespace:
    """The speculators pieces the test builds its reference from; skips when not installed."""
    try:
        import speculators
        import speculators.models.dspark.core as core
        import speculators.proposals.greedy as greedy
    except ImportError as e:
        pytest.skip(
            f"speculators is not importable ({e}): `pip install --no-deps speculators==0.9.0` "
            "and its light imports (loguru, openai, datasets, hs-connectors, httpx, aiohttp)"
        )
    return SimpleNamespace(
        SpeculatorsConfig=speculators.SpeculatorsConfig,
        VerifierConfig=speculators.VerifierConfig,
        DSparkDraftModel=core.DSparkDraftModel,
        DSparkSpeculatorConfig=speculators.DSparkSpeculatorConfig,
        GreedyTokenProposalConfig=greedy.GreedyTokenProposalConfig,
        dspark_core=core,
    )


def reference_from_export(folder):
    """A speculators DSparkDraftModel built from our config.json and loaded with our tensors."""
    from transformers import Qwen3Config

    ref = _reference_modules()
    data = json.loads((folder / "config.json").read_text())
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    layer = Qwen3Config(
        **{k: data[k] for k in sizes},
        head_dim=data["head_dim"],
        num_hidden_layers=data["num_hidden_layers"],
        vocab_size=data["vocab_size"],
        rms_norm_eps=data["rms_norm_eps"],
        max_position_embeddings=data["max_position_embeddings"],
        rope_parameters=data["rope_parameters"],
        layer_types=data["layer_types"],
    )
    layer._attn_implementation = "eager"
    proposal = ref.GreedyTokenProposalConfig(speculative_tokens=data["block_size"])
    config = ref.DSparkSpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=data["vocab_size"],
        block_size=data["block_size"],
        aux_hidden_state_layer_ids=data["target_layer_ids"],
        mask_token_id=data["mask_token_id"],
        sample_from_anchor=True,
        markov_rank=data["markov_rank"],
        markov_head_type=data["markov_head_type"],
        enable_confidence_head=data["enable_confidence_head"],
        confidence_head_with_markov=data["confidence_head_with_markov"],
        speculators_config=ref.SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[proposal],
            default_proposal_method="greedy",
            verifier=ref.VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    model = ref.DSparkDraftModel(config).float().eval()
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["verifier_lm_head.weight"] = tensors["lm_head.weight"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert unexpected == [] and missing == ["verifier_norm.weight"]
    return model, ref.dspark_core


def packed_row(gen):
    """Two samples (15 and 17 tokens) in one row; supervised positions = the anchors."""
    lengths, seq = (15, 17), 32
    ids = torch.randint(0, 299, (1, seq), generator=gen)
    docs = torch.tensor([[0] * lengths[0] + [1] * lengths[1]])
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    anchors = torch.tensor([[3, 7, 8, 16, 20, 25]])  # < seq - block: speculators' candidates
    mask = torch.zeros(1, seq, dtype=torch.uint8)
    mask[0, anchors[0]] = 1
    hidden = torch.randn(1, seq, 3, H, generator=gen)
    return Batch(ids_BS=ids, loss_mask_BS=mask, doc_ids_BS=docs, positions_BS=pos.int(),
                 hidden_BSKH=hidden), anchors  # fmt: skip


def ours_per_slot(drafter, batch, anchors, embed, lm_head):
    cfg = drafter.cfg
    keep = torch.ones_like(anchors, dtype=torch.bool)
    block = cfg.block_size
    masks = build_masks(
        anchors, keep, context_len=batch.ids_BS.shape[1], block_size=block,
        layer_types=cfg.layer_types, sliding_window=None, attention="sdpa",
        starts_BN=context_starts(anchors, batch.positions_BS),
    )  # fmt: skip
    ids = block_inputs(batch.ids_BS, anchors, block_size=block, mask_token_id=cfg.mask_token_id)
    hidden = drafter(
        batch.context(), embed[ids], batch.positions_BS.long(),
        block_positions(anchors, batch.positions_BS, block_size=block), masks,
    )  # fmt: skip
    emb = drafter.prev_embeddings(block_targets(batch.ids_BS, anchors, block_size=block))
    return {
        "logits": drafter.slot_logits(hidden, lm_head, emb),
        "bias": drafter.markov_bias(emb),
        "confidence": drafter.confidence(hidden, emb),
    }


@pytest.mark.parametrize("with_markov", [True, False])
def test_speculators_reference_gives_our_logits_bias_and_confidence(tmp_path, with_markov):
    _reference_modules()
    cfg = tiny_drafter_config(
        drafter_type="dspark", markov_rank=8, confidence_head_with_markov=with_markov
    )
    drafter = DSparkDrafter(cfg)
    init_dspark_weights(drafter, 0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # norms away from one, a Markov bias and a confidence bias
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=gen)
        drafter.confidence_head.proj.bias.fill_(0.25)
    embed, lm_head = torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen) * 0.3
    export = export_drafter(drafter, cfg, tmp_path / "export", heads=(embed, lm_head))
    reference, core = reference_from_export(export)
    ours, _ = load_export(export)  # the same bf16-rounded weights
    embed, lm_head = embed.bfloat16().float(), lm_head.bfloat16().float()
    batch, anchors = packed_row(gen)
    seen = {}
    block_bias = reference.markov_head.block_bias

    def record_bias(**kwargs):
        seen["bias"] = block_bias(**kwargs)
        return seen["bias"]

    def record_metrics(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    reference.markov_head.block_bias = record_bias
    original, core.compute_metrics = core.compute_metrics, record_metrics
    try:
        with torch.no_grad():
            reference(
                hidden_states=batch.context(),
                input_ids=batch.ids_BS,
                loss_mask=batch.loss_mask_BS,
                verifier_last_hidden_states=torch.randn(1, 32, H, generator=gen),
                document_ids=batch.doc_ids_BS,
                position_ids=batch.positions_BS.long(),
                max_anchors=anchors.shape[1],
            )
            got = ours_per_slot(ours.eval(), batch, anchors, embed, lm_head)
    finally:
        core.compute_metrics = original
    q = anchors.shape[1] * cfg.block_size
    torch.testing.assert_close(got["logits"].view(q, V), seen["logits"].view(q, V),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(
        got["bias"].view(q, V), seen["bias"].view(q, V), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(got["confidence"].view(q), seen["confidence"].view(q),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert float(seen["bias"].abs().max()) > 0.1 and float(seen["confidence"].std()) > 0
