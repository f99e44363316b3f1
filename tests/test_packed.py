"""Packed rows (`extract.packing`, `extract.packed`, `extract.layouts`): whole samples back to
back in one static shape give each sample's states as if it ran alone, for dense, hybrid and
Llama-style targets, eager and compiled; the document mask equals the brute-force one."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import extract.packed_attention as pa
from extract.capture import LayerCapture
from extract.layouts import Sharded, choose_layout, compiled_graphs
from extract.packed_attention import (
    dense_document_mask,
    document_block_mask,
    document_mask_mod,
    packed_attention,
)
from extract.packing import pack_rows, packed_inputs, taper_end
from extract.target import load_target
from tests.test_extract import data_file, extract, samples_by_row  # noqa: F401

ROWS = [np.random.default_rng(i).integers(3, 300, n) for i, n in enumerate([50, 120, 7, 1, 33])]


def test_pack_rows_keeps_every_row_once_and_within_the_chunk():
    rng = np.random.default_rng(0)
    lengths = sorted(rng.integers(1, 300, 200).tolist(), reverse=True)
    chunks = pack_rows(lengths, chunk_tokens=512)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in c) <= 512 for c in chunks)
    # first fit decreasing: all chunks but the last few are nearly full
    assert sum(lengths) / (512 * len(chunks)) > 0.95


@pytest.mark.parametrize("seed", range(4))
def test_taper_end_moves_about_one_chunk_of_the_last_rows_into_small_rows(seed):
    rng = np.random.default_rng(seed)
    lengths = sorted(rng.integers(1, 300, 150).tolist(), reverse=True)
    chunks = pack_rows(lengths, chunk_tokens=1024)
    tapered = taper_end(chunks, lengths, chunk_tokens=1024, small=256)
    assert sorted(i for c in tapered for i in c) == list(range(len(lengths)))
    kept = 0  # the chunks before the moved rows, which stay as they were
    while kept < min(len(chunks), len(tapered)) and tapered[kept] == chunks[kept]:
        kept += 1
    assert 0 < kept < len(chunks)  # these lengths always leave some rows to move
    moved = [i for c in tapered[kept:] for i in c]
    assert all(sum(lengths[i] for i in c) <= 256 for c in tapered[kept:])
    # whole chunks moved, the last ones, until a chunk's worth (or a row too long for 256)
    assert sorted(moved) == sorted(i for c in chunks[kept:] for i in c)
    stopped_by_long_row = any(lengths[i] > 256 for i in chunks[kept - 1])
    assert sum(lengths[i] for i in moved) >= 1024 or stopped_by_long_row


def test_taper_end_leaves_rows_too_long_for_the_small_size():
    assert taper_end([[0], [1]], [300, 280], chunk_tokens=512, small=256) == [[0], [1]]


def test_packed_inputs_restart_positions_and_close_with_a_pad_segment():
    p = packed_inputs(ROWS[:3], chunk_tokens=256, pad_id=0)
    lengths = [len(r) for r in ROWS[:3]]
    assert p.real == sum(lengths) and p.ids.shape == (256,)
    assert p.cu_seqlens.tolist() == [0, 50, 170, 177, 256]
    for k, (a, b) in enumerate(zip(p.cu_seqlens[:-1], p.cu_seqlens[1:], strict=True)):
        assert (p.doc_ids[a:b] == k).all() and p.positions[a:b].tolist() == list(range(b - a))
    assert (p.ids[p.real :] == 0).all()
    full = packed_inputs([np.arange(128)], chunk_tokens=128, pad_id=0)
    assert full.cu_seqlens.tolist() == [0, 128]


@pytest.mark.parametrize("full_blocks", [False, True])
@pytest.mark.parametrize("block", [16, 64, 128])
def test_document_block_mask_equals_the_brute_force_mask(block, full_blocks):
    rng = np.random.default_rng(block)
    for _ in range(5):
        lengths = rng.integers(1, 200, 6).tolist()
        n = -(-sum(lengths) // 128) * 128
        p = packed_inputs([np.zeros(k) for k in lengths], chunk_tokens=n, pad_id=0)
        doc = torch.from_numpy(p.doc_ids).long()
        mask_mod = document_mask_mod(doc)
        ours = document_block_mask(doc, mask_mod, block_size=block, full_blocks=full_blocks)
        ref = create_block_mask(mask_mod, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
        assert torch.equal(ours.to_dense(), ref.to_dense())
        if full_blocks:
            assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
        else:  # one run of key blocks per query block: what BLOCKS_ARE_CONTIGUOUS assumes
            assert ours.full_kv_num_blocks is None
            for i, count in enumerate(ours.kv_num_blocks[0, 0].tolist()):
                run = ours.kv_indices[0, 0, i, :count]
                assert run.tolist() == list(range(i - count + 1, i + 1))
        q, k, v = torch.randn(1, 4, n, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        flex, _ = packed_attention(None, q, k, v, ours)
        sdpa, _ = packed_attention(None, q, k, v, dense_document_mask(doc))
        torch.testing.assert_close(flex, sdpa, atol=1e-4, rtol=1e-4)


def test_compiled_flex_equals_the_dense_mask():
    """flex_attention inside compiled code: the same attention as the dense mask's."""
    torch._dynamo.reset()
    lengths = [50, 100, 30, 60]
    p = packed_inputs([np.zeros(k) for k in lengths], chunk_tokens=256, pad_id=0)
    doc = torch.from_numpy(p.doc_ids).long()
    mask = document_block_mask(doc, document_mask_mod(doc), block_size=128, full_blocks=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 256, 16, generator=g) for n in (4, 2, 2))
    ref, _ = packed_attention(None, q, k, v, dense_document_mask(doc))

    def layer(q, k, v):  # noqa: ANN001, ANN202
        out, _ = packed_attention(None, q * 2.0, k, v, mask)
        return out.view(1, 256, -1)

    got = torch.compile(layer, dynamic=False)(q / 2.0, k, v)
    torch.testing.assert_close(got, ref.reshape(1, 256, -1), atol=1e-5, rtol=1e-5)


def _per_row(model, rows, layer_ids, device) -> list[torch.Tensor]:
    cap = LayerCapture(model, layer_ids, own_masks=True)
    try:
        return [cap.run([r], device=device).clone() for r in rows]
    finally:
        cap.close()


def _packed(model, rows, layer_ids, device, **layout) -> tuple[list[torch.Tensor], object]:
    """Each row's states through packed rows of 256 tokens (several chunks for ROWS)."""
    cap = LayerCapture(
        model,
        layer_ids,
        layout=lambda body: choose_layout(body, packed=True, chunk_tokens=256, pad_id=0, **layout),
    )
    try:
        out = {}
        for chunk in cap.layout.batches([len(r) for r in rows], batch_tokens=256):
            states, start = cap.run([rows[i] for i in chunk], device=device), 0
            for i in chunk:
                out[i] = states[start : start + len(rows[i])].clone()
                start += len(rows[i])
        return [out[i] for i in range(len(rows))], cap.layout
    finally:
        cap.close()


@pytest.mark.parametrize("attention", ["dense", "flex", "sdpa"])
def test_a_row_filling_a_smaller_size_runs_at_it_with_the_same_states(targets, attention):
    """Rows of 256 tokens, or 128 for a row whose samples fill no more (a part's leftovers):
    the smaller row computes less padding and gives the same states."""
    cpu = torch.device("cpu")
    model = load_target(str(targets["qwen3_5"]), device=cpu, last_layer=3)
    rows = [np.random.default_rng(n).integers(3, 300, n) for n in (120, 100, 60, 30)]
    ref = _per_row(model, rows, [0, 3], cpu)
    got, layout = _packed(model, rows, [0, 3], cpu, compile_layers=False, attention=attention)
    assert layout.sizes == (256, 128)
    chunks = layout.batches([len(r) for r in rows], batch_tokens=256)
    assert chunks == [[0, 1, 3], [2]]
    with torch.inference_mode():  # as extraction runs it (the buffers are inference tensors)
        widths = [
            layout.inputs([rows[i] for i in c], lambda *t: list(t))[0]["input_ids"].shape[1]
            for c in chunks
        ]
    assert widths == [256, 128]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    layout.uninstall()


def _llama(tmp_path_factory) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def targets(tiny_qwen3, tiny_qwen35, tmp_path_factory) -> dict:
    return {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen35, "llama": _llama(tmp_path_factory)}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
@pytest.mark.parametrize("attention", ["dense", "flex", "sdpa"])
def test_packed_rows_equal_each_row_alone_in_fp32(targets, kind, attention):
    model = load_target(str(targets[kind]), device=torch.device("cpu"), last_layer=3)
    cpu = torch.device("cpu")
    ref = _per_row(model, ROWS * 3, [0, 2, 3], cpu)
    got, layout = _packed(
        model, ROWS * 3, [0, 2, 3], cpu, compile_layers=False, attention=attention
    )
    assert layout.name == "packed"
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    layout.uninstall()
    again = _per_row(model, ROWS[:2], [0, 2, 3], cpu)  # the model as loaded once more
    for a, b in zip(again, ref[:2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_flash_rows_reach_the_attention_as_flex_rows_do(targets, kind, monkeypatch):
    """`--attention flash` asks each attention call for flex_attention's FLASH backend through
    the model's own forward (a keyword its layers pass down, dense and hybrid targets alike);
    with the backend's options left out (flash-attention 4 runs on GPUs only) its rows give each
    row's states as flex's do."""
    monkeypatch.setattr(pa, "FLASH_OPTIONS", {})
    model = load_target(str(targets[kind]), device=torch.device("cpu"), last_layer=3)
    cpu = torch.device("cpu")
    ref = _per_row(model, ROWS, [0, 3], cpu)
    got, layout = _packed(model, ROWS, [0, 3], cpu, compile_layers=False, attention="flash")
    assert layout.name == "packed" and layout.attention == "flash"
    with torch.inference_mode():
        kwargs, _ = layout.inputs(ROWS[:2], lambda *a: list(a))
    assert kwargs["flash"] is True
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("kind", "attention"), [("qwen3", "dense"), ("qwen3_5", "dense"), ("qwen3", "sdpa")]
)
def test_compiled_layers_share_their_graphs_and_never_recompile(targets, kind, attention):
    """Layers of a kind share their compiled graphs (backend "eager": dynamo's graphs without
    Inductor's code generation): a model of 8 layers compiles nothing a model of 4 did not, and
    chunks of other rows compile nothing."""
    cpu = torch.device("cpu")
    torch._dynamo.reset()
    made = []
    for last in (3, 7):
        model = load_target(str(targets[kind]), device=cpu, last_layer=last)
        ref = _per_row(model, ROWS, [1, last], cpu)
        before = compiled_graphs()
        got, layout = _packed(
            model, ROWS, [1, last], cpu, compile_layers=True, backend="eager", attention=attention
        )
        assert layout.compiled and compiled_graphs() == layout.graphs_after_probe
        made.append(compiled_graphs() - before)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        layout.uninstall()
    assert made[0] > 0 and made[1] == 0


LEAKY = lambda doc: torch.tril(torch.ones(len(doc), len(doc), dtype=torch.bool))[None, None]
NAN = lambda doc: torch.full((1, 1, len(doc), len(doc)), float("nan"))  # an additive mask


@pytest.mark.parametrize(
    "mask,says",
    [
        (LEAKY, "packed rows changed a probe forward"),
        # NaN compares as within any tolerance: the probe counts it as a failure instead
        (NAN, "packed rows failed on this target (a probe forward gave NaN)"),
    ],
)
def test_a_layout_that_changes_the_states_is_refused(targets, monkeypatch, caplog, mask, says):
    """The probe compares packed rows with rows alone: a mask that leaks across samples, or one
    that gives NaN, fails it and extraction keeps padded batches."""
    import extract.packed as packed

    monkeypatch.setattr(packed, "dense_document_mask", mask)
    model = load_target(str(targets["qwen3"]), device=torch.device("cpu"), last_layer=3)
    layout = choose_layout(
        model.get_decoder(),
        packed=True,
        compile_layers=False,
        chunk_tokens=256,
        pad_id=0,
        attention="dense",
    )
    assert layout.name == "padded"
    assert says in caplog.text


def test_the_ranks_of_a_sharded_target_keep_the_layout_they_agree_on(targets, caplog):
    """Each rank probes through the whole model and takes the ranks' largest figures: a probe
    that failed on another rank makes this one keep padded batches too (with the model's own
    masks, the model given back as loaded); agreement on a good probe keeps packed rows."""
    model = load_target(str(targets["qwen3"]), device=torch.device("cpu"), last_layer=3)
    body, seen = model.get_decoder(), []
    loaded = body.config._attn_implementation

    def another_rank_failed(values: list[float]) -> list[float]:
        seen.append(values)
        return [math.inf, values[1]]

    options = dict(packed=True, compile_layers=False, chunk_tokens=256, pad_id=0)
    layout = choose_layout(body, **options, sharded=Sharded(model, another_rank_failed))
    assert layout.name == "padded" and layout.masks is None
    assert seen[0][0] < 1e-3  # this rank's own probe passed
    assert "packed rows failed on this target (on another rank)" in caplog.text
    assert body.config._attn_implementation == loaded
    layout = choose_layout(body, **options, sharded=Sharded(model, lambda values: values))
    assert layout.name == "packed"
    layout.uninstall()


def test_cli_packed_cache_equals_the_padded_one(tmp_path, tiny_qwen35, data_file):  # noqa: F811
    """Through `python -m extract`'s run: --packing on stores what padded batches store (the
    hybrid target: its convolution and recurrent state restart at every sample)."""
    padded = extract(tmp_path / "padded", tiny_qwen35, data_file, packing="off")
    packed = extract(tmp_path / "packed", tiny_qwen35, data_file, packing="on")
    counts = lambda m: {k: v for k, v in m.totals().items() if k != "nbytes"}  # compressed size
    assert counts(packed) == counts(padded)
    a, b = samples_by_row(tmp_path / "padded"), samples_by_row(tmp_path / "packed")
    assert a.keys() == b.keys() and len(a) > 10
    cpu = torch.device("cpu")
    for row in a:
        assert np.array_equal(a[row].input_ids, b[row].input_ids)
        torch.testing.assert_close(
            b[row].hidden_tensor(cpu).float(), a[row].hidden_tensor(cpu).float(),
            atol=1e-2, rtol=1e-2,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "llama"])
@pytest.mark.parametrize("attention", ["flex", "flash", "sdpa"])
def test_compiled_packed_rows_on_cuda_match_rows_alone(targets, kind, attention):
    """The product's default on a GPU: compiled layers (Inductor), the attention by flex (or
    through flash-attention 4, where installed) or by sdpa over sample groups, and on the hybrid
    flash-linear-attention's varlen kernels; bf16 against each row alone."""
    if attention == "flash" and pa.flash_unavailable():
        pytest.skip(f"--attention flash: {pa.flash_unavailable()}")
    cuda = torch.device("cuda")
    model = load_target(str(targets[kind]), device=cuda, last_layer=7 if kind != "llama" else 3)
    layers = [1, 3]
    ref = _per_row(model, ROWS * 2, layers, cuda)
    got, layout = _packed(model, ROWS * 2, layers, cuda, compile_layers=True, attention=attention)
    assert layout.name == "packed" and layout.attention == attention and layout.compiled
    for a, b in zip(got, ref, strict=True):
        err = (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-6)
        assert err.max() < 0.05
    assert compiled_graphs() == layout.graphs_after_probe


def test_only_the_runs_last_part_ends_in_small_rows(tmp_path, tiny_qwen3):
    """Through `python -m extract`'s run, the forwards the target sees: only the rank's last part
    ends in rows of the smallest size (`taper_end`), so little is left to write after the last
    forward."""
    lines = [
        {"messages": [
            {"role": "user", "content": " ".join(["hello there"] * (7 + i % 3))},
            {"role": "assistant", "content": " ".join(["fine thanks"] * (7 + i % 4))},
        ]}
        for i in range(40)
    ]  # fmt: skip
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    sizes: list[int] = []  # the packed rows' sizes, once the layout's probe is done
    started = logging.Handler()
    started.emit = lambda record: sizes.clear() if "the target runs" in record.getMessage() else 0

    def seen(module, args):
        if isinstance(module, torch.nn.Embedding):
            sizes.append(args[0].shape[-1])

    hook = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    logging.getLogger("extract.worker").addHandler(started)
    try:
        manifest = extract(
            tmp_path / "c", tiny_qwen3, data, packing="on", rows_per_part=20, max_length=384
        )
    finally:
        hook.remove()
        logging.getLogger("extract.worker").removeHandler(started)
    assert [p.rows_kept for p in manifest.parts] == [20, 20]
    lengths = [len(s.input_ids) for s in samples_by_row(tmp_path / "c").values()]
    assert 80 < min(lengths) and max(lengths) < 128  # four or five to a packed row of 512
    # four rows to a packed row of 512: the first part in whole rows, untapered; the last part's
    # last rows (about one packed row's worth) one to a row of the smallest size, 128
    assert sizes[-1] == 128
    full = sizes.index(128)
    assert sizes[:full] == [512] * full and full > sum(lengths[:20]) / 512
    assert sizes[full:] == [128] * (len(sizes) - full) and len(sizes) - full >= 4
