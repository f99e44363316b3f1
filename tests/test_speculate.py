"""Speculative decoding: lossless against greedy, step-by-step agreement with z-lab's `dflash`
package, the command line's JSON line and its errors."""

import copy
import dataclasses
import json
import shutil
import time

import pytest
import torch
from click.testing import CliRunner

from train.data.batch import Batch
from train.drafters.config import DrafterConfig
from train.drafters.dflash import DFlashDrafter, init_drafter_weights
from train.export import export_drafter
from train.export_load import load_export
from train.proof.decode import context_features, greedy, speculate
from train.proof.lossless import divergence_gap, format_report, near_tie_tolerance
from train.proof.speculate import main
from train.step import forward_loss

LAYERS = (1, 4, 6)  # of the tiny target's 8
EOS = 2  # the tiny tokenizer's <|im_end|>

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()


def keep_only_dim0(norm: torch.nn.Module) -> None:
    """Make an RMSNorm output zero except hidden dim 0 (weight w, or 1 + w in Qwen3.5 norms)."""
    with torch.no_grad():
        norm.weight.zero_()
        offset = float(norm(torch.ones(1, norm.weight.shape[0]))[0, 0])  # 0 for w, 1 for 1 + w
        norm.weight.fill_(-offset)
        norm.weight[0] = 1.0 - offset


@pytest.fixture(scope="module")
def two_token_target(target):
    """The tiny target with a final norm that keeps only hidden dim 0: its greedy output is one
    of two tokens (the argmax or argmin of lm_head column 0), chosen by the sign of dim 0."""
    model = copy.deepcopy(target)
    keep_only_dim0(model.model.norm)
    return model


def drafter_config(tiny_qwen3, **over) -> DrafterConfig:
    target_cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    kwargs = dict(num_layers=2, target_layer_ids=LAYERS, block_size=8, tokenizer_vocab_size=500)
    return DrafterConfig.from_target_config(target_cfg, **{**kwargs, **over})


def two_token_drafter(cfg: DrafterConfig) -> DFlashDrafter:
    """A random drafter that proposes one of the same two tokens: its final norm also keeps dim 0
    only; larger weights make the choice depend on the context rather than on the mask token."""
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10.0)
    keep_only_dim0(drafter.norm)
    return drafter


def reference(dflash_model, monkeypatch, export_dir):
    # return_stats times with torch.cuda.synchronize; on a CPU build time with the plain clock.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    ref = dflash_model.DFlashDraftModel.from_pretrained(export_dir, dtype=torch.float32)
    return ref.eval()


def prompt(seed: int, length: int = 6) -> torch.Tensor:
    return torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(seed))


_greedy_outputs: dict = {}


def greedy_ids(target, ids, *, max_new_tokens, eos) -> list[int]:
    """Plain greedy output, computed once per (target, prompt, length, eos) in this module."""
    key = (id(target), tuple(ids.flatten().tolist()), max_new_tokens, tuple(eos))
    if key not in _greedy_outputs:
        out = greedy(target, ids, max_new_tokens=max_new_tokens, eos_ids=eos)
        _greedy_outputs[key] = (target, out.output_ids.tolist())  # pinned: its id stays unique
    return _greedy_outputs[key][1]


def agree_with_reference(ref_generate, ref, ours, target, prompts, *, max_new_tokens, eos):
    """Run both loops and plain greedy on every prompt; return all acceptance lengths."""
    lengths = []
    for ids in prompts:
        got = speculate(target, ours, ids, max_new_tokens=max_new_tokens, eos_ids=eos)
        expected = ref_generate(ref, target, ids, max_new_tokens, eos, return_stats=True)
        plain = greedy_ids(target, ids, max_new_tokens=max_new_tokens, eos=eos)
        assert got.acceptance_lengths == expected.acceptance_lengths
        if got.acceptance_lengths:  # tau within 0.05 of the reference: implied by the above
            ref_tau = sum(expected.acceptance_lengths) / len(expected.acceptance_lengths)
            assert abs(got.tau - ref_tau) <= 0.05
        assert got.output_ids.tolist() == plain  # lossless
        assert got.output_ids.tolist() == expected.output_ids.tolist()
        assert len(got.new_ids) == 1 + sum(got.acceptance_lengths)
        lengths += got.acceptance_lengths
    return lengths


@pytest.mark.parametrize(
    ("layer_types", "window"),
    [(("full_attention", "full_attention"), None), (("sliding_attention", "full_attention"), 3)],
)
def test_equals_greedy_and_reference_per_step(
    tmp_path, monkeypatch, tiny_qwen3, two_token_target, layer_types, window
):
    dflash_model = pytest.importorskip("dflash.model")
    cfg = drafter_config(tiny_qwen3, layer_types=layer_types, sliding_window=window)
    export_drafter(two_token_drafter(cfg), cfg, tmp_path / "export")
    ours, _ = load_export(tmp_path / "export")
    ref = reference(dflash_model, monkeypatch, tmp_path / "export")
    prompts = [prompt(seed) for seed in range(100, 104)]
    lengths = agree_with_reference(
        dflash_model.dflash_generate, ref, ours.eval(), two_token_target, prompts,
        max_new_tokens=32, eos=[EOS],
    )  # fmt: skip
    # Non-trivial: some blocks fully accepted, some rejected at once, some in between.
    assert max(lengths) == cfg.block_size and min(lengths) == 1
    assert any(1 < n < cfg.block_size for n in lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_greedy_and_reference_per_step(
    tmp_path, monkeypatch, tiny_qwen3, two_token_target
):
    dflash_model = pytest.importorskip("dflash.model")
    cfg = drafter_config(tiny_qwen3)
    export_drafter(two_token_drafter(cfg), cfg, tmp_path / "export")
    cuda_target = copy.deepcopy(two_token_target).cuda()
    ours, _ = load_export(tmp_path / "export")
    ref = reference(dflash_model, monkeypatch, tmp_path / "export").cuda()
    prompts = [prompt(seed).cuda() for seed in range(100, 104)]
    lengths = agree_with_reference(
        dflash_model.dflash_generate, ref, ours.cuda().eval(), cuda_target, prompts,
        max_new_tokens=32, eos=[EOS],
    )  # fmt: skip
    assert max(lengths) > 1


def test_drafter_trained_on_unsorted_layers_decodes_the_same_after_export(
    tmp_path, monkeypatch, tiny_qwen3, two_token_target
):
    """Trained on layers (6, 1, 4), exported as (1, 4, 6) with fc permuted: our loop with the
    unexported drafter, our loop with the export and the reference with the export agree."""
    dflash_model = pytest.importorskip("dflash.model")
    cfg = drafter_config(tiny_qwen3, target_layer_ids=(6, 1, 4))
    drafter = two_token_drafter(cfg)
    with torch.no_grad():  # the export's bf16 rounding, so both sides hold the same weights
        for p in drafter.parameters():
            p.copy_(p.bfloat16().float())
    export_drafter(drafter, cfg, tmp_path / "export")
    ours, sorted_cfg = load_export(tmp_path / "export")
    assert sorted_cfg.target_layer_ids == (1, 4, 6)
    ref = reference(dflash_model, monkeypatch, tmp_path / "export")
    assert list(ref.target_layer_ids) == [1, 4, 6]
    prompts = [prompt(seed) for seed in range(100, 104)]
    lengths = agree_with_reference(
        dflash_model.dflash_generate, ref, ours.eval(), two_token_target, prompts,
        max_new_tokens=32, eos=[EOS],
    )  # fmt: skip
    unexported = [
        speculate(two_token_target, drafter.eval(), ids, max_new_tokens=32, eos_ids=[EOS])
        for ids in prompts
    ]
    assert [n for r in unexported for n in r.acceptance_lengths] == lengths
    assert max(lengths) > 1 and min(lengths) == 1


def test_stops_at_eos_like_the_reference(tmp_path, monkeypatch, tiny_qwen3, two_token_target):
    dflash_model = pytest.importorskip("dflash.model")
    cfg = drafter_config(tiny_qwen3)
    export_drafter(two_token_drafter(cfg), cfg, tmp_path / "export")
    ours, _ = load_export(tmp_path / "export")
    ref = reference(dflash_model, monkeypatch, tmp_path / "export")
    ids = prompt(101)
    plain = greedy(two_token_target, ids, max_new_tokens=40).new_ids
    # The first token that differs from the first output token ends generation mid-stream.
    stop = next(t for t in plain if t != plain[0])
    agree_with_reference(
        dflash_model.dflash_generate, ref, ours.eval(), two_token_target, [ids],
        max_new_tokens=40, eos=[stop],
    )  # fmt: skip
    got = speculate(two_token_target, ours.eval(), ids, max_new_tokens=40, eos_ids=[stop])
    assert got.new_ids == plain[: plain.index(stop) + 1]


def test_short_generations(tiny_qwen3, target):
    cfg = drafter_config(tiny_qwen3)
    drafter = DFlashDrafter(cfg).eval()
    init_drafter_weights(drafter, 1)
    ids = prompt(7)
    one = speculate(target, drafter, ids, max_new_tokens=1)
    assert one.acceptance_lengths == [] and one.output_ids.shape == (1, ids.shape[1] + 1)
    assert one.output_ids.tolist() == greedy(target, ids, max_new_tokens=1).output_ids.tolist()
    first = one.new_ids[0]
    stopped = speculate(target, drafter, ids, max_new_tokens=20, eos_ids=[first])
    assert stopped.new_ids == [first] and stopped.acceptance_lengths == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculate(target, drafter, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="one non-empty sequence"):
        speculate(target, drafter, torch.zeros(2, 3, dtype=torch.long), max_new_tokens=4)


@pytest.mark.slow
def test_hybrid_target_rolls_back_recurrent_states(tiny_qwen35):
    """Gated DeltaNet states cannot be cropped: rejected drafts must not leak into the state."""
    from transformers import AutoModelForCausalLM

    hybrid = AutoModelForCausalLM.from_pretrained(tiny_qwen35, dtype=torch.float32).eval()
    cfg = drafter_config(tiny_qwen35, num_layers=1, block_size=4)
    drafter = DFlashDrafter(cfg).eval()
    init_drafter_weights(drafter, 0)
    for seed in (0, 1):  # a random drafter: nearly every block is rejected and rolled back
        got = speculate(hybrid, drafter, prompt(seed), max_new_tokens=24)
        assert got.new_ids == greedy(hybrid, prompt(seed), max_new_tokens=24).new_ids
        assert 1 in got.acceptance_lengths


def train_on_greedy_outputs(target, cfg: DrafterConfig, ids_BS: torch.Tensor, steps: int):
    """A drafter trained briefly (the real training forward) on the target's own continuations."""
    with torch.no_grad():
        hidden = target(ids_BS, output_hidden_states=True).hidden_states
        context_BSC = context_features(hidden, cfg.target_layer_ids)
    loss_mask = torch.ones_like(ids_BS)
    batch = Batch.one_per_row(
        torch.full((ids_BS.shape[0],), ids_BS.shape[1]),
        ids_BS=ids_BS,
        loss_mask_BS=loss_mask,
        context_BSC=context_BSC,
    )
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        out = forward_loss(
            drafter, embed.detach(), head.detach(), batch, num_anchors=8,
            block_size=cfg.block_size, gamma=4.0, mask_token_id=cfg.mask_token_id,
            attention="sdpa", generator=gen, grad_ckpt="none",
        )  # fmt: skip
        (out.weighted_sum / out.weight_total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return drafter


@pytest.mark.slow
def test_trained_drafter_accepts_more_and_matches_reference(
    tmp_path, monkeypatch, tiny_qwen3, target
):
    dflash_model = pytest.importorskip("dflash.model")
    cfg = drafter_config(tiny_qwen3, num_layers=1)
    ids_BS = torch.randint(3, 500, (16, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the target's greedy continuations, batched, without a cache
        for _ in range(32):
            ids_BS = torch.cat([ids_BS, target(ids_BS).logits[:, -1:].argmax(-1)], dim=1)
    untrained = DFlashDrafter(cfg).eval()
    init_drafter_weights(untrained, 0)
    export_drafter(train_on_greedy_outputs(target, cfg, ids_BS, 100), cfg, tmp_path / "export")
    ours, _ = load_export(tmp_path / "export")
    ref = reference(dflash_model, monkeypatch, tmp_path / "export")
    prompts = [ids_BS[n : n + 1, :4] for n in range(3)]
    lengths = agree_with_reference(
        dflash_model.dflash_generate, ref, ours.eval(), target, prompts, max_new_tokens=32,
        eos=[EOS],
    )  # fmt: skip
    before = [
        n
        for p in prompts
        for n in speculate(target, untrained, p, max_new_tokens=32).acceptance_lengths
    ]
    assert sum(lengths) / len(lengths) > sum(before) / len(before) + 1.0


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def random_export(tmp_path_factory, tiny_qwen3):
    cfg = drafter_config(tiny_qwen3)
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    return export_drafter(drafter, cfg, tmp_path_factory.mktemp("drafter") / "export")


def run_cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_cli_prints_report_and_json_line_last(tmp_path, tiny_qwen3, random_export):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Name a colour."}]
    prompts = ["Say hello.", messages, {"messages": messages}, [1, 5, 9, 13]]
    path = write_json(tmp_path / "prompts.json", prompts)
    result = run_cli(
        "--target", tiny_qwen3, "--drafter", random_export, "--prompts", path,
        "--device", "cpu", "--max-new-tokens", 12, "--warmup", 0, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("tau", "lossless", "tokens_per_s", "baseline_tokens_per_s", "speedup"):
        assert isinstance(summary[key], (int, float)), key
    assert summary["prompts"] == 4 and summary["lossless"] is True
    assert summary["near_ties"] == 0 and summary["lossless_up_to_near_ties"] is True
    assert summary["dtype"] == "float32"
    assert all(r["gap"] is None and not r["near_tie"] for r in summary["per_prompt"])
    assert summary["speedup"] == pytest.approx(
        summary["tokens_per_s"] / summary["baseline_tokens_per_s"]
    )
    rows = summary["per_prompt"]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], tokenize=False, add_generation_prompt=True
    )
    assert rows[0]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])
    assert rows[1]["prompt_tokens"] == rows[2]["prompt_tokens"] and rows[3]["prompt_tokens"] == 4
    assert summary["steps"] == sum(r["steps"] for r in rows)
    assert all(1 <= r["new_tokens"] <= 12 for r in rows)
    assert lines[0].split()[:2] == ["prompt", "in"] and "tau" in lines[-2]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ("not json", "not a readable JSON file"),
        ([], "non-empty JSON list"),
        (["fine", 5], "prompt 1: expected a string"),
        ([[{"role": "user"}]], "prompt 0: expected a string"),
        (["fine", "fine", [3, 100000]], "prompt 2: token ids [100000]"),
    ],
)
def test_cli_prompt_errors(tmp_path, tiny_qwen3, random_export, prompts, message):
    path = tmp_path / "prompts.json"
    path.write_text(prompts if isinstance(prompts, str) else json.dumps(prompts))
    result = run_cli("--target", tiny_qwen3, "--drafter", random_export, "--prompts", path)
    assert result.exit_code != 0
    assert message in result.output, result.output


def test_cli_missing_files(tmp_path, tiny_qwen3, random_export):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    result = run_cli(
        "--target", tiny_qwen3, "--drafter", random_export, "--prompts", tmp_path / "x"
    )
    assert result.exit_code != 0 and f"--prompts: {tmp_path / 'x'} does not exist" in result.output
    result = run_cli("--target", tiny_qwen3, "--drafter", tmp_path, "--prompts", prompts)
    assert result.exit_code != 0 and "--drafter:" in result.output
    (tmp_path / "run" / "export").mkdir(parents=True)
    result = run_cli("--target", tiny_qwen3, "--drafter", tmp_path / "run", "--prompts", prompts)
    assert f"is a run folder: give its export, {tmp_path / 'run' / 'export'}" in result.output
    step = tmp_path / "run" / "checkpoints" / "step-4"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / "state.pt").write_bytes(b"")
    result = run_cli("--target", tiny_qwen3, "--drafter", step, "--prompts", prompts)
    assert f"is a checkpoint: export it first (python -m train.export {step}" in result.output
    result = run_cli("--target", "no-such-model", "--drafter", random_export, "--prompts", prompts)
    assert "--target no-such-model: no such folder, nor a model" in result.output, result.output
    for device, needle in [("foo", "not a torch device"), ("cuda", "no CUDA device here")]:
        if device == "cuda" and torch.cuda.is_available():
            continue
        result = run_cli("--target", tiny_qwen3, "--drafter", random_export, "--prompts", prompts,
                         "--device", device)  # fmt: skip
        assert result.exit_code != 0 and f"--device {device}: {needle}" in result.output
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_qwen3, weightless)
    for f in weightless.glob("*.safetensors"):
        f.unlink()
    result = run_cli("--target", weightless, "--drafter", random_export, "--prompts", prompts)
    assert result.exit_code != 0 and "cannot load its weights" in result.output, result.output
    assert "Traceback" not in result.output


def test_cli_a_damaged_or_foreign_drafter_is_named(tmp_path, tiny_qwen3, random_export):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    cut, bare, keyless = (shutil.copytree(random_export, tmp_path / n) for n in ("c", "b", "k"))
    weights = (random_export / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(weights[:500])
    (bare / "model.safetensors").unlink()
    config = json.loads((keyless / "config.json").read_text())
    del config["num_attention_heads"]
    (keyless / "config.json").write_text(json.dumps(config))
    again = "export it again (python -m train.export CHECKPOINT"
    for drafter, needle in [
        (cut, f"--drafter {cut}: {cut / 'model.safetensors'} is damaged ("),
        (bare, f"--drafter {bare}: {bare / 'model.safetensors'} is missing; {again}"),
        (keyless, f"--drafter {keyless} is not a drafter export: its config.json has no "
                  f"num_attention_heads; {again}"),
        (tiny_qwen3, f"--drafter {tiny_qwen3} is not a drafter export: its config.json has no "
                     "num_target_layers, mask_token_id, target_layer_ids (a target model's"),
    ]:  # fmt: skip
        result = run_cli("--target", tiny_qwen3, "--drafter", drafter, "--prompts", prompts)
        assert result.exit_code == 1 and needle in result.output, result.output
    assert again in run_cli("--target", tiny_qwen3, "--drafter", cut, "--prompts", prompts).output


def test_cli_drafter_that_does_not_fit(tmp_path, tiny_qwen3):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    target_cfg = json.loads((tiny_qwen3 / "config.json").read_text())
    other = {**target_cfg, "hidden_size": 32, "num_hidden_layers": 12}
    cfg = DrafterConfig.from_target_config(
        other, num_layers=1, target_layer_ids=(1, 10), block_size=4, tokenizer_vocab_size=500
    )
    export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "export")
    result = run_cli("--target", tiny_qwen3, "--drafter", tmp_path / "export", "--prompts", prompts)
    assert result.exit_code != 0
    assert "drafter hidden size 32, target 64" in result.output
    assert "target layers [1, 10] not in a 8-layer target" in result.output


def test_cli_several_drafters_each_as_alone(tmp_path, tiny_qwen3, random_export):
    """Repeated --drafter: one report and one JSON line per drafter, in order, each equal to
    that drafter's run alone (the greedy reference is shared, not changed)."""
    cfg = drafter_config(tiny_qwen3, block_size=4)
    other = export_drafter(two_token_drafter(cfg), cfg, tmp_path / "other")
    prompts = write_json(tmp_path / "prompts.json", ["Say hello.", [1, 5, 9, 13]])
    common = ["--target", tiny_qwen3, "--prompts", prompts, "--device", "cpu"]
    common += ["--max-new-tokens", 10, "--warmup", 0, "--json"]

    def summaries(*drafters):
        args = [*common, *[a for d in drafters for a in ("--drafter", d)]]
        result = run_cli(*args)
        assert result.exit_code == 0, result.output
        lines = result.stdout.strip().splitlines()
        return result.stdout, [json.loads(line) for line in lines[-len(drafters) :]]

    text, both = summaries(random_export, other)
    alone = [summaries(random_export)[1][0], summaries(other)[1][0]]
    assert [s["drafter"] for s in both] == [str(random_export), str(other)]
    assert f"drafter {other}:" in text
    for together, single in zip(both, alone, strict=True):
        for key in ("tau", "lossless", "steps", "new_tokens", "block_size"):
            assert together[key] == single[key], key
        assert [r["steps"] for r in together["per_prompt"]] == [
            r["steps"] for r in single["per_prompt"]
        ]
    assert both[0]["block_size"] == 8 and both[1]["block_size"] == 4


def test_cli_names_the_drafter_that_does_not_fit(tmp_path, tiny_qwen3, random_export):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    cfg = drafter_config(tiny_qwen3, target_layer_ids=(1, 3))
    bad_cfg = dataclasses.replace(cfg, num_target_layers=12)
    export_drafter(DFlashDrafter(bad_cfg), bad_cfg, tmp_path / "bad")
    result = run_cli(
        "--target", tiny_qwen3, "--drafter", random_export, "--drafter", tmp_path / "bad",
        "--prompts", prompts,
    )  # fmt: skip
    assert result.exit_code != 0
    assert f"the drafter ({tmp_path / 'bad'}) does not fit the target" in result.output
    assert "made for a 12-layer target, this one has 8" in result.output


def test_divergence_gap_is_the_relative_gap_of_the_two_logits(target):
    prompt, common = [1, 5, 9, 13], [20, 7]
    with torch.no_grad():
        logits = target(torch.tensor([prompt + common])).logits[0, -1]
    top = logits.topk(2).indices.tolist()
    la, lb = float(logits[top[0]]), float(logits[top[1]])
    gap = divergence_gap(target, prompt, common, top[0], top[1])
    assert gap == pytest.approx(abs(la - lb) / max(abs(la), abs(lb), 1.0), rel=1e-5)
    assert divergence_gap(target, prompt, common, top[1], top[0]) == pytest.approx(gap)
    assert divergence_gap(target, prompt, common, top[0], top[0]) == 0.0


def summary_with(rows: list[dict], dtype: str = "bfloat16") -> dict:
    tolerance = near_tie_tolerance(getattr(torch, dtype))
    for r in rows:
        r["near_tie"] = r["gap"] is not None and r["gap"] <= tolerance
    return {
        "tau": 1.5, "steps": 10, "block_size": 16, "tokens_per_s": 10.0,
        "baseline_tokens_per_s": 8.0, "speedup": 1.25, "prompts": len(rows), "dtype": dtype,
        "lossless": all(r["lossless"] for r in rows), "near_tie_tolerance": tolerance,
        "near_ties": sum(r["near_tie"] for r in rows),
        "lossless_up_to_near_ties": all(r["lossless"] or r["near_tie"] for r in rows),
        "per_prompt": rows,
    }  # fmt: skip


def row(index: int, mismatch: int | None = None, gap: float | None = None) -> dict:
    return dict(
        index=index, prompt_tokens=5, new_tokens=8, steps=4, tau=2.0, tokens_per_s=10.0,
        baseline_tokens_per_s=8.0, lossless=mismatch is None, first_mismatch=mismatch, gap=gap,
    )  # fmt: skip


def test_report_tells_near_ties_from_real_divergences():
    assert near_tie_tolerance(torch.bfloat16) == 4 * 2**-7
    assert near_tie_tolerance(torch.float32) < 1e-5
    lossless = format_report(summary_with([row(0), row(1)]))
    assert lossless.endswith("lossless: yes")
    near = format_report(summary_with([row(0), row(1, mismatch=3, gap=0.004)]))
    assert "differs from greedy at token 3 (a near-tie: the two tokens' logits 0.4% apart)" in near
    assert "lossless: up to near-ties (1 of 2 prompts differ" in near
    assert "within 3.1% in bfloat16; --dtype float32 checks exactly)" in near
    # the same gap in float32 is far beyond its rounding: a real divergence
    real = format_report(summary_with([row(0), row(1, mismatch=3, gap=0.004)], "float32"))
    assert "NOT a near-tie" in real and real.endswith("lossless: NO")
    ended = format_report(summary_with([row(0, mismatch=8)]))
    assert "(one output ended first)" in ended and ended.endswith("lossless: NO")


def test_cli_full_blocks_keeps_the_last_blocks_whole(tmp_path, tiny_qwen3):
    """Each prompt's JSON row holds its steps' lengths and new ids, those of `speculate` on the
    same prompt; --full-blocks drafts the last blocks whole (another schedule, same output)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = copy.deepcopy(AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32))
    keep_only_dim0(target.model.norm)  # one of two tokens, as the drafter: blocks get accepted
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(tmp_path / "target")
    cfg = drafter_config(tiny_qwen3)
    export = export_drafter(two_token_drafter(cfg), cfg, tmp_path / "export")
    prompts = [prompt(seed).flatten().tolist() for seed in range(100, 104)]
    path = write_json(tmp_path / "prompts.json", prompts)
    args = ["--target", tmp_path / "target", "--drafter", export, "--prompts", path]
    args += ["--device", "cpu", "--max-new-tokens", 13, "--warmup", 0, "--json"]
    drafter = load_export(export)[0].eval()
    rows = {}
    for full_blocks in (False, True):
        result = run_cli(*args, *(["--full-blocks"] if full_blocks else []))
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["full_blocks"] is full_blocks and summary["lossless"] is True
        rows[full_blocks] = summary["per_prompt"]
        for ids, row in zip(prompts, rows[full_blocks], strict=True):
            run = speculate(target.eval(), drafter, ids, max_new_tokens=13, full_blocks=full_blocks)
            assert row["lengths"] == run.acceptance_lengths
            assert row["new_ids"] == run.new_ids
            assert sum(row["lengths"]) == row["new_tokens"] - 1  # the prefill's token
    assert [r["new_ids"] for r in rows[False]] == [r["new_ids"] for r in rows[True]]
    assert [r["lengths"] for r in rows[False]] != [r["lengths"] for r in rows[True]]


def test_cli_shards_joined_in_order_are_the_whole_run(tmp_path, tiny_qwen3, random_export):
    """--shard K/N decodes a contiguous share; train.proof.tau joins the shares' JSON lines, in
    K's order, into the whole run's per-prompt figures, indices into the whole prompt list."""
    from train.proof.tau import read_runs

    prompts = write_json(tmp_path / "prompts.json", ["Say hello.", [1, 5, 9, 13], [2, 7], "Hi."])
    common = ["--target", tiny_qwen3, "--drafter", random_export, "--prompts", prompts]
    common += ["--device", "cpu", "--max-new-tokens", 10, "--warmup", 0, "--json"]
    outputs = []
    for shard in (None, "1/3", "2/3", "3/3"):
        result = run_cli(*common, *(() if shard is None else ("--shard", shard)))
        assert result.exit_code == 0, result.output
        path = tmp_path / f"spec-{len(outputs)}.txt"
        path.write_text(result.stdout)
        outputs.append((path, json.loads(result.stdout.strip().splitlines()[-1])))
    (_, whole), *shards = outputs
    assert [[r["index"] for r in s["per_prompt"]] for _, s in shards] == [[0, 1], [2], [3]]
    assert [s["shard"] for _, s in shards] == ["1/3", "2/3", "3/3"] and whole["shard"] is None
    joined, alone = read_runs([p for p, _ in shards]), read_runs([outputs[0][0]])
    for key in ("n", "s", "prompts"):
        assert joined[0][key] == alone[0][key], key
    assert [r["steps"] for r in whole["per_prompt"]] == joined[0]["s"]


@pytest.mark.parametrize(
    ("shard", "message"), [("3/2", "1 <= K <= N"), ("2", "K/N"), ("0/4", "K/N"), ("a/b", "K/N")]
)
def test_cli_bad_shard_is_refused(tmp_path, tiny_qwen3, random_export, shard, message):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    result = run_cli(
        "--target", tiny_qwen3, "--drafter", random_export, "--prompts", prompts, "--shard", shard
    )
    assert result.exit_code != 0 and message in result.output, result.output


def test_cli_shard_without_prompts_is_refused(tmp_path, tiny_qwen3, random_export):
    prompts = write_json(tmp_path / "prompts.json", ["hi"])
    result = run_cli(
        "--target", tiny_qwen3, "--drafter", random_export, "--prompts", prompts, "--device",
        "cpu", "--shard", "2/2",
    )  # fmt: skip
    assert result.exit_code != 0, result.output
    assert "no prompt falls in this share of 1; give N <= 1" in result.output
