"""A packed row equals its samples one by one: same loss sums, metrics and gradients (sdpa), and
flex equals sdpa on a packed row."""

import pytest
import torch

from shared.cache import open_part
from tests.cachegen import write_cache
from tests.drafters import tiny_drafter, tiny_drafter_config
from train.data.batch import Batch
from train.data.loader import collate_row, device_batch
from train.data.plan import SampleRef
from train.drafters.anchors import sample_anchors
from train.step import anchored_loss

H, K = 64, 3


def _samples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.rand(n, generator=gen) < 0.85).to(torch.uint8)
        mask[:2] = 0  # a prompt
        out.append(
            (
                torch.randint(0, 299, (n,), generator=gen),
                mask,
                torch.randn(n, K, H, generator=gen).bfloat16(),
            )
        )
    return out


def _packed(samples, row):
    ids = torch.zeros(1, row, dtype=torch.int64)
    mask = torch.zeros(1, row, dtype=torch.uint8)
    docs = torch.full((1, row), -1, dtype=torch.int32)
    pos = torch.zeros(1, row, dtype=torch.int32)
    hidden = torch.zeros(1, row, K, H, dtype=torch.bfloat16)
    start = 0
    for d, (i, m, h) in enumerate(samples):
        span = slice(start, start + len(i))
        ids[0, span], mask[0, span], hidden[0, span] = i, m, h
        docs[0, span], pos[0, span] = d, torch.arange(len(i), dtype=torch.int32)
        start += len(i)
    return Batch(
        ids_BS=ids, loss_mask_BS=mask, doc_ids_BS=docs, positions_BS=pos, hidden_BSKH=hidden
    )


def _alone(sample):
    i, m, h = sample
    return Batch.one_per_row(
        torch.tensor([len(i)]), ids_BS=i[None], loss_mask_BS=m[None], hidden_BSKH=h[None]
    )


def _run(cfg, drafter, embed, lm_head, batch, anchors, keep, ce="autograd"):
    drafter.zero_grad()
    out = anchored_loss(
        drafter,
        embed,
        lm_head,
        batch,
        anchors,
        keep,
        block_size=cfg.block_size,
        gamma=2.0,
        mask_token_id=cfg.mask_token_id,
        attention="sdpa",
        ce=ce,
        ce_chunk_blocks=3,
    )
    out.weighted_sum.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    return out, grads


def _split(anchors, keep, lengths):
    """Each sample's anchors, shifted to its own rows (only kept blocks)."""
    starts = torch.tensor([0, *lengths]).cumsum(0)
    per = []
    for d in range(len(lengths)):
        a = anchors[keep]
        inside = (a >= starts[d]) & (a < starts[d + 1])
        mine = a[inside] - starts[d]
        per.append((mine[None], torch.ones(1, len(mine), dtype=torch.bool)))
    return per


@pytest.mark.parametrize(
    "layer_types,window",
    [(("full_attention", "full_attention"), None), (("sliding_attention", "full_attention"), 5)],
)
@pytest.mark.parametrize("ce", ["autograd", "fused"])
def test_packed_row_equals_its_samples_one_by_one(layer_types, window, ce):
    cfg = tiny_drafter_config(layer_types=layer_types, sliding_window=window)
    drafter = tiny_drafter(cfg).train()
    gen = torch.Generator().manual_seed(9)
    embed = torch.randn(300, H, generator=gen)
    lm_head = torch.randn(300, H, generator=gen) / 8
    lengths = [13, 21, 9]
    samples = _samples(lengths)
    packed = _packed(samples, row=48)  # 5 rows of padding
    anchors, keep = sample_anchors(
        packed.loss_mask_BS, packed.doc_ids_BS, num_anchors=40, generator=gen
    )
    assert keep.sum() > 8 and not keep.all()  # some dropped blocks too
    got, got_grads = _run(cfg, drafter, embed, lm_head, packed, anchors, keep, ce)
    sums = {"weighted_sum": 0.0, "weight_total": 0.0, "accepted_sum": 0.0, "num_blocks": 0.0}
    grads = {n: torch.zeros_like(g) for n, g in got_grads.items()}
    for sample, (a, k) in zip(samples, _split(anchors, keep, lengths), strict=True):
        out, g = _run(cfg, drafter, embed, lm_head, _alone(sample), a, k, ce)
        sums["weighted_sum"] += out.weighted_sum.item()
        sums["weight_total"] += float(out.weight_total)
        sums["accepted_sum"] += float(out.stats["accepted_sum"])
        sums["num_blocks"] += float(out.stats["num_blocks"])
        for n in grads:
            grads[n] += g[n]
    assert got.weighted_sum.item() == pytest.approx(sums["weighted_sum"], rel=1e-5)
    assert float(got.weight_total) == pytest.approx(sums["weight_total"], rel=1e-6)
    assert float(got.stats["accepted_sum"]) == sums["accepted_sum"]
    assert float(got.stats["num_blocks"]) == sums["num_blocks"]
    for n, g in got_grads.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_packed_rows_of_a_cache_equal_their_samples(tmp_path):
    """The loader's own collation of cached samples gives the per-sample sums."""
    cache = write_cache(tmp_path / "c", num_parts=1, samples_per_part=3, lengths=(20, 40))
    reader = open_part(cache / "part-000000")
    refs = [SampleRef(0, n, int(reader.lengths[n])) for n in range(3)]
    samples = [reader.read(n) for n in range(3)]
    cfg = tiny_drafter_config(target_layer_ids=(0, 1, 2), block_size=4)
    drafter = tiny_drafter(cfg).train()
    gen = torch.Generator().manual_seed(2)
    embed, lm_head = torch.randn(320, H, generator=gen), torch.randn(320, H, generator=gen) / 8
    row = device_batch(collate_row(samples, refs, row_tokens=128), torch.device("cpu"))
    anchors, keep = sample_anchors(row.loss_mask_BS, row.doc_ids_BS, num_anchors=24, generator=gen)
    got, got_grads = _run(cfg, drafter, embed, lm_head, row, anchors, keep)
    lengths = [r.length for r in refs]
    total, grads = 0.0, {n: torch.zeros_like(g) for n, g in got_grads.items()}
    for s, (a, k) in zip(samples, _split(anchors, keep, lengths), strict=True):
        alone = (
            torch.from_numpy(s.input_ids).long(),
            torch.from_numpy(s.loss_mask),
            s.hidden_tensor(),
        )
        out, g = _run(cfg, drafter, embed, lm_head, _alone(alone), a, k)
        total += out.weighted_sum.item()
        for n in grads:
            grads[n] += g[n]
    assert got.weighted_sum.item() == pytest.approx(total, rel=1e-5)
    for n, g in got_grads.items():
        torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_forward_equals_sdpa_on_a_packed_row():
    pytest.importorskip("torch.nn.attention.flex_attention")
    cfg = tiny_drafter_config(layer_types=("sliding_attention", "full_attention"), sliding_window=5)
    drafter = tiny_drafter(cfg)
    gen = torch.Generator().manual_seed(4)
    embed, lm_head = torch.randn(300, H, generator=gen), torch.randn(300, H, generator=gen) / 8
    packed = _packed(_samples([30, 50, 27, 17], seed=3), row=128)
    anchors, keep = sample_anchors(
        packed.loss_mask_BS, packed.doc_ids_BS, num_anchors=32, generator=gen
    )
    outs = {}
    with torch.no_grad():
        for attention in ("sdpa", "flex"):
            outs[attention] = anchored_loss(
                drafter,
                embed,
                lm_head,
                packed,
                anchors,
                keep,
                block_size=cfg.block_size,
                gamma=2.0,
                mask_token_id=cfg.mask_token_id,
                attention=attention,
            )
    a, b = outs["sdpa"], outs["flex"]
    assert float(a.weighted_sum) == pytest.approx(float(b.weighted_sum), rel=1e-4)
    torch.testing.assert_close(a.stats["correct_per_offset"], b.stats["correct_per_offset"])
