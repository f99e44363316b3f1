"""Recipe knobs: --optimizer muon (Muon on the hidden matrices, AdamW on the rest) and
--noise-std (noise on the cached states of training steps only), each resumed exactly."""

import pytest
import torch

from shared.dist import DeviceSpec, RankInfo, launch
from shared.manifest import read_manifest
from tests.cachegen import write_cache
from tests.test_train_loop import final_state, records, tiny
from train.checkpoint import list_checkpoints
from train.data.batch import Batch
from train.drafters.config import DrafterConfig
from train.drafters.registry import build_drafter
from train.loop import Trainer
from train.optim import MuonAdamW, ShardedMuon, build_optimizer, hidden_matrices
from train.run import prepare as prepare_run
from train.run import run
from train.schedule import warmup_cosine

CPU = RankInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return write_cache(tmp_path_factory.mktemp("cache"), num_parts=3, samples_per_part=6)


def drafter(drafter_type="dflash"):
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=512,
        vocab_size=320,
        block_size=4,
        mask_token_id=300,
        target_layer_ids=(0, 1),
        num_target_layers=4,
        layer_types=("full_attention", "full_attention"),
        drafter_type=drafter_type,
        selector_rank=8,
        selector_top_k=4,
    )
    torch.manual_seed(0)
    model = build_drafter(cfg)
    for p in model.parameters():  # DFlash2's no-op zeros would make some updates trivial
        torch.nn.init.normal_(p, std=0.1)
    return model


@pytest.mark.parametrize("drafter_type", ["dflash", "dflash2"])
def test_hidden_matrices_are_the_linear_weights(drafter_type):
    model = drafter(drafter_type)
    hidden, rest = hidden_matrices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in hidden} | {names[id(p)] for p in rest} == set(names.values())
    assert not {id(p) for p in hidden} & {id(p) for p in rest}
    hidden_names = {names[id(p)] for p in hidden}
    assert "fc.weight" in hidden_names and "layers.0.self_attn.q_proj.weight" in hidden_names
    assert all(p.ndim == 2 for p in hidden)
    rest_names = {names[id(p)] for p in rest}
    assert "hidden_norm.weight" in rest_names and "layers.1.self_attn.k_norm.weight" in rest_names
    if drafter_type == "dflash2":  # lookup tables and 3-D kernels stay with AdamW
        assert "candidate_selector.predecessor_codebook" in rest_names
        assert "layers.0.attention_conv.base_kernel" in rest_names


def test_muon_steps_the_matrices_and_adamw_the_rest():
    """MuonAdamW's step equals torch's Muon on the Linear weights plus AdamW on the rest, both at
    their own rates scaled by one schedule."""
    model, reference = drafter(), drafter()
    opt = MuonAdamW(*hidden_matrices(model), lr=1e-3, muon_lr=0.02, weight_decay=0.0)
    hidden, rest = hidden_matrices(reference)
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.0)
    adamw = torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.0)
    schedules = [warmup_cosine(o, total=10, warmup=0.2) for o in (opt, muon, adamw)]
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(model.parameters(), reference.parameters(), strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        for o in (opt, muon, adamw):
            o.step()
        for s in schedules:
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [
        g["lr"] for g in (*muon.param_groups, *adamw.param_groups)
    ]
    factor = opt.param_groups[0]["lr"] / 0.02  # one schedule factor for both peak rates
    assert 0 < factor < 1 and opt.param_groups[-1]["lr"] == pytest.approx(1e-3 * factor)
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert not torch.equal(a, start[name]), name
    # Muon keeps a momentum buffer per matrix, AdamW its moments for the rest
    assert set(opt.muon.state) and set(opt.adamw.state)
    assert all(p.ndim == 2 for p in opt.muon.state) and "exp_avg" in next(
        iter(opt.adamw.state.values())
    )


def _sharded_muon_rank(info: RankInfo, nesterov: bool) -> None:
    """One gloo rank: ShardedMuon and torch's Muon from the same weights and gradients."""
    hidden, _ = hidden_matrices(drafter())
    reference = [p.detach().clone().requires_grad_() for p in hidden]
    sharded = ShardedMuon(hidden, lr=0.02, weight_decay=0.1, nesterov=nesterov)
    whole = torch.optim.Muon(reference, lr=0.02, weight_decay=0.1, nesterov=nesterov)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)  # the same averaged gradients on every rank
        for a, b in zip(hidden, reference, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        sharded.step()
        whole.step()
    for i, (a, b) in enumerate(zip(hidden, reference, strict=True)):
        assert torch.equal(a, b), f"rank {info.rank}: matrix {i}"
        assert torch.equal(sharded.state[a]["momentum_buffer"], whole.state[b]["momentum_buffer"])


@pytest.mark.parametrize("nesterov", [True, False])
def test_sharded_muon_equals_muon_on_every_rank(nesterov):
    """Two gloo ranks, each orthogonalising half the matrices and broadcasting them, end with
    the weights and momentum that torch's Muon computes alone (assertions run in the ranks)."""
    launch(_sharded_muon_rank, (nesterov,), DeviceSpec("cpu", (0, 0)))


def test_muon_state_round_trip_shares_the_groups(cache, tmp_path):
    model = drafter()
    cfg = tiny(cache, tmp_path, optimizer="muon")
    opt = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    other = build_optimizer(drafter(), cfg)
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0] is other.muon.param_groups[0]
    assert other.param_groups[-1] is other.adamw.param_groups[-1]
    assert isinstance(build_optimizer(model, tiny(cache, tmp_path)), torch.optim.AdamW)


def test_noise_touches_real_tokens_only_and_repeats_per_seed():
    lengths = torch.tensor([3, 1])
    ids = torch.zeros(2, 4, dtype=torch.long)
    batch = Batch.one_per_row(
        lengths, ids_BS=ids, loss_mask_BS=ids, hidden_BSKH=torch.ones(2, 4, 2, 8)
    )
    a, b = batch.noised(std=0.1, seed=7), batch.noised(std=0.1, seed=7)
    assert torch.equal(a.hidden_BSKH, b.hidden_BSKH)
    assert not torch.equal(a.hidden_BSKH, batch.noised(std=0.1, seed=8).hidden_BSKH)
    delta = a.hidden_BSKH - 1
    assert torch.equal(delta[0, 3], torch.zeros(2, 8)) and torch.equal(
        delta[1, 1:], 0 * delta[1, 1:]
    )
    assert delta[0, :3].abs().min() > 0 and 0.05 < delta[0, :3].std() < 0.2
    assert batch.noised(std=0.0, seed=7) is batch


def make_trainer(cache, out, **kw) -> Trainer:
    cfg = tiny(cache, out, eval_parts=1, epochs=2, **kw)
    cfg, prep = prepare_run(cfg, read_manifest(cache), device_kind="cpu")
    return Trainer(CPU, cfg, prep)


def test_noise_in_training_steps_only(cache, tmp_path):
    plain, noisy = (
        make_trainer(cache, tmp_path / "a"),
        make_trainer(cache, tmp_path / "b", noise_std=0.5),
    )
    for t in (plain, noisy):
        t.prepare()
    assert plain.evaluate() == noisy.evaluate()  # same weights: evaluation sees no noise
    plain.train_step()
    noisy.train_step()
    a, b = plain.model.state_dict(), noisy.model.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the training step saw the noise


@pytest.mark.parametrize("kw", [{"optimizer": "muon"}, {"noise_std": 0.3}])
def test_killed_run_resumes_bitwise(cache, tmp_path, kw):
    kw = dict(kw, steps=8, checkpoint_every=3, keep_checkpoints=1)
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run(tiny(cache, whole, **kw))
    run(tiny(cache, broken, stop_after_steps=4, **kw))
    assert [s for s, _ in list_checkpoints(broken)] == [3]
    run(tiny(cache, broken, **kw))
    a, b = final_state(whole), final_state(broken)
    assert a["step"] == b["step"] == 8
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert str(a["optimizer"]) == str(b["optimizer"])  # same keys and groups
    states = [a["optimizer"], b["optimizer"]]
    if kw.get("optimizer") == "muon":
        states = [s["muon"] for s in states]
        assert states[0]["state"]
    for s, t in zip(states[0]["state"].values(), states[1]["state"].values(), strict=True):
        for name in s:
            assert torch.equal(torch.as_tensor(s[name]), torch.as_tensor(t[name])), name
    assert [r["loss"] for r in records(broken)] == [r["loss"] for r in records(whole)]
