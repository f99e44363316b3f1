"""DSpark speculative decoding on the tiny target: lossless against greedy, every step's drafts
equal to an uncached recomputation of the Markov walk, the confidence cut, speculative sampling's
output distribution, and the command line."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from tests.test_speculate import drafter_config, greedy_ids, keep_only_dim0, prompt
from train.drafters.anchors import block_inputs, block_positions
from train.drafters.dspark import DSparkDrafter, init_dspark_weights
from train.drafters.mask import build_masks
from train.export import export_drafter
from train.proof.decode import context_features
from train.proof.dspark_decode import rejection_sample, speculate_dspark
from train.proof.speculate import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    keep_only_dim0(model.model.norm)  # its greedy output: one of two tokens
    return model


def repeating_dspark(tiny_qwen3, target, **over) -> DSparkDrafter:
    """A random DSpark drafter whose Markov bias repeats the previous token when it is one of
    the two the target emits (which it does in long runs), over a small backbone term."""
    cfg = drafter_config(tiny_qwen3, drafter_type="dspark", block_size=5, markov_rank=8, **over)
    drafter = DSparkDrafter(cfg)
    init_dspark_weights(drafter, 0)
    lm_head = target.get_output_embeddings().weight
    pair = (int(lm_head[:, 0].argmax()), int(lm_head[:, 0].argmin()))
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if not name.endswith("norm.weight") and not name.startswith(("markov", "conf")):
                param.mul_(10.0)
        keep_only_dim0(drafter.norm)
        drafter.norm.weight.mul_(0.2)
        head = drafter.markov_head
        head.markov_w2.weight.normal_(0, 0.05, generator=torch.Generator())
        for column, token in enumerate(pair):
            head.markov_w1.weight[token, column] = 3.0
            head.markov_w2.weight[token, column] = 3.0
    return drafter.eval()


@torch.no_grad()
def uncached_walk(target, drafter, tokens, start, q_len):
    """The Markov walk of the block anchored at `start` recomputed without any cache: the
    target's states of every token before it, the drafter's training forward of one block."""
    cfg, lm_head = drafter.cfg, target.get_output_embeddings().weight
    embed = target.get_input_embeddings().weight
    ids = torch.tensor([tokens[: start + 1]])
    states = target(ids[:, :start], output_hidden_states=True).hidden_states
    context = context_features(states, cfg.target_layer_ids)
    anchors, keep = torch.tensor([[start]]), torch.tensor([[True]])
    masks = build_masks(
        anchors, keep, context_len=start, block_size=q_len, layer_types=cfg.layer_types,
        sliding_window=None, attention="sdpa",
    )  # fmt: skip
    positions = torch.arange(start + 1)[None]
    block = block_inputs(ids, anchors, block_size=q_len, mask_token_id=cfg.mask_token_id)
    block_pos = block_positions(anchors, positions, block_size=q_len)
    hidden = drafter(context, embed[block], positions[:, :start], block_pos, masks)
    return DSparkDrafter.walk(drafter, hidden, lm_head, ids[:, start])  # not the spy


def test_lossless_and_every_step_equals_the_uncached_walk(tiny_qwen3, target):
    drafter = repeating_dspark(tiny_qwen3, target)
    walks, walk = [], drafter.walk

    def spy(hidden, lm_head, first, **kw):  # records each step's walk, changes nothing
        walks.append((int(first), walk(hidden, lm_head, first, **kw)))
        return walks[-1][1]

    drafter.walk = spy
    all_lengths = []
    for seed in range(3):
        ids = prompt(seed)
        walks.clear()
        got = speculate_dspark(target, drafter, ids, max_new_tokens=20)
        plain = greedy_ids(target, ids, max_new_tokens=20, eos=())
        assert got.output_ids.tolist() == plain
        start = 6
        for (anchor, step), length in zip(walks, got.acceptance_lengths, strict=True):
            assert anchor == plain[0][start]
            expected = uncached_walk(target, drafter, plain[0], start, step.tokens_NQ.shape[1])
            torch.testing.assert_close(step.logits_NQV, expected.logits_NQV, atol=1e-4, rtol=1e-4)
            assert torch.equal(step.tokens_NQ, expected.tokens_NQ)
            torch.testing.assert_close(step.confidence_NQ, expected.confidence_NQ)
            drafts = step.tokens_NQ[0].tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == plain[0][start + 1 + accepted]:
                accepted += 1
            assert length == min(accepted + 1, 6 + 20 - start - 1)
            start += length
        all_lengths += got.acceptance_lengths
    assert max(all_lengths) == 6  # a whole block of 5 drafts and the bonus token
    assert sum(all_lengths) / len(all_lengths) > 2


def test_confidence_cut(tiny_qwen3, target):
    drafter = repeating_dspark(tiny_qwen3, target)
    ids = prompt(1)
    whole = speculate_dspark(target, drafter, ids, max_new_tokens=16)
    none_cut = speculate_dspark(target, drafter, ids, max_new_tokens=16, confidence_threshold=0.0)
    assert none_cut.acceptance_lengths == whole.acceptance_lengths
    all_cut = speculate_dspark(target, drafter, ids, max_new_tokens=16, confidence_threshold=1.0)
    assert all_cut.acceptance_lengths == [1] * 15  # no drafts: one token per target forward
    assert all_cut.output_ids.tolist() == whole.output_ids.tolist()
    with torch.no_grad():  # confidence 0.5 everywhere: a cut at 0.6 drafts nothing either
        drafter = copy.deepcopy(drafter)
        drafter.confidence_head.proj.weight.zero_()
    cut = speculate_dspark(target, drafter, ids, max_new_tokens=16, confidence_threshold=0.6)
    assert cut.acceptance_lengths == [1] * 15
    kept = speculate_dspark(target, drafter, ids, max_new_tokens=16, confidence_threshold=0.4)
    assert kept.acceptance_lengths == whole.acceptance_lengths


def test_rejection_sampling_emits_the_target_distribution():
    # V 4, two drafts per step from q; the target's p at the first two positions and the bonus.
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.25, 0.15, 0.1], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.4, 0.4]])
    num = 60000
    gen = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[k], num, replacement=True, generator=gen)
                          for k in range(2)], dim=1)  # fmt: skip
    accepted, following = rejection_sample(
        p.expand(num, -1, -1), q.expand(num, -1, -1), drafts, generator=gen
    )
    first = torch.where(accepted > 0, drafts[:, 0], following)
    tolerance = 4 * (0.25 / num) ** 0.5
    torch.testing.assert_close(torch.bincount(first, minlength=4) / num, p[0], atol=tolerance,
                               rtol=0)  # fmt: skip
    kept = accepted > 0  # the token after an accepted first draft is distributed as p[1]
    second = torch.where(accepted[kept] > 1, drafts[kept, 1], following[kept])
    share = torch.bincount(second, minlength=4) / int(kept.sum())
    torch.testing.assert_close(share, p[1], atol=4 * (0.25 / int(kept.sum())) ** 0.5, rtol=0)
    # a draft is kept with probability min(1, p / q): slot 0's expected acceptance
    assert float((accepted > 0).float().mean()) == pytest.approx(
        float(torch.minimum(p[0], q[0]).sum()), abs=tolerance
    )


def test_sampling_near_zero_temperature_is_greedy_and_seeded(tiny_qwen3, target):
    drafter = repeating_dspark(tiny_qwen3, target)
    ids = prompt(2)
    greedy = speculate_dspark(target, drafter, ids, max_new_tokens=16)
    cold = speculate_dspark(target, drafter, ids, max_new_tokens=16, temperature=1e-6,
                            generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert cold.output_ids.tolist() == greedy.output_ids.tolist()
    assert cold.acceptance_lengths == greedy.acceptance_lengths
    runs = [
        speculate_dspark(target, drafter, ids, max_new_tokens=16, temperature=1.0,
                         generator=torch.Generator().manual_seed(5))
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0].output_ids.tolist() == runs[1].output_ids.tolist()


def test_cli_decodes_a_dspark_export_greedy_and_sampled(tmp_path, tiny_qwen3, target):
    drafter = repeating_dspark(tiny_qwen3, target)
    heads = (target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    export = export_drafter(drafter, drafter.cfg, tmp_path / "export", heads=heads)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Say hello.", [1, 5, 9, 13]]))
    common = ["--target", tiny_qwen3, "--drafter", export, "--prompts", prompts, "--device",
              "cpu", "--max-new-tokens", 10, "--warmup", 0, "--json"]  # fmt: skip

    def run(*extra):
        args = [str(a) for a in (*common, *extra)]
        return CliRunner().invoke(main, args, catch_exceptions=False)

    greedy = run("--confidence-threshold", 0.3)
    assert greedy.exit_code == 0, greedy.output
    summary = json.loads(greedy.stdout.strip().splitlines()[-1])
    assert summary["lossless"] is True and summary["block_size"] == 5
    sampled = run("--temperature", 0.8, "--seed", 3)
    assert sampled.exit_code == 0, sampled.output
    summary = json.loads(sampled.stdout.strip().splitlines()[-1])
    assert summary["tau"] >= 1.0 and summary["temperature"] == 0.8 and summary["prompts"] == 2
    assert "sampled at temperature 0.8" in sampled.stdout


def test_cli_refuses_sampling_a_dflash_drafter(tmp_path, tiny_qwen3):
    from train.drafters.dflash import DFlashDrafter, init_drafter_weights

    cfg = drafter_config(tiny_qwen3)
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, 0)
    export = export_drafter(drafter, cfg, tmp_path / "export")
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[1, 5, 9]]))
    args = ["--target", tiny_qwen3, "--drafter", export, "--prompts", prompts, "--temperature", 1]
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code != 0 and "DSpark drafters only" in result.output
