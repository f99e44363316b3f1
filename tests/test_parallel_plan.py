"""Layouts on paper: the `--parallel` grammar, transformers' arguments for the versions this
project supports, and the refusal of a target that does not fit, before anything loads."""

from __future__ import annotations

import pytest

from extract.fit import TargetSize, fit_problem, plan_layout
from extract.parallel import Layout, LayoutError, engine_kwargs, parse_layout

NEW = frozenset({"tp_size", "fsdp_size", "ep_size", "dp_replicate_size", "enable_expert_parallel"})
OLD = frozenset({"tp_size", "fsdp_size", "enable_expert_parallel", "pp_size"})  # 5.17's


def test_layouts_for_the_processes():
    assert parse_layout("tp=2", 4, fields=NEW) == Layout(tp=2, dp=2, shared=2)
    assert parse_layout("fsdp=2,dp=2", 4, fields=NEW) == Layout(fsdp=2, dp=2)
    assert parse_layout("ep=4", 4, fields=NEW) == Layout(fsdp=4, ep=4)
    assert parse_layout("tp=2,ep=2", 2, fields=NEW) == Layout(tp=2, ep=2, shared=2)
    assert not parse_layout("none", 3, fields=NEW).sharded
    groups = [Layout(tp=2, dp=2, shared=2).group(r) for r in range(4)]
    assert groups == [(0, True), (0, False), (1, True), (1, False)]


@pytest.mark.parametrize(
    "text,world,says",
    [
        ("tp=3", 4, "do not divide the 4 processes"),
        ("tp=2,dp=3", 4, "dp=2 would be"),
        ("pp=2", 2, "is not KEY=N"),
        ("tp=two", 2, "is not KEY=N"),
        ("ep=4,tp=8", 8, "ep must be a multiple of tp"),
    ],
)
def test_bad_layouts_say_why(text, world, says):
    with pytest.raises(LayoutError, match=says):
        parse_layout(text, world, fields=NEW)


def test_transformers_arguments_per_version():
    assert engine_kwargs(parse_layout("tp=2", 4, fields=NEW), NEW) == {
        "tp_size": 2,
        "fsdp_size": 1,
        "dp_replicate_size": 2,
    }
    assert engine_kwargs(parse_layout("ep=2", 2, fields=NEW), NEW) == {
        "tp_size": 1,
        "fsdp_size": 2,
        "ep_size": 2,
    }
    # Without ep_size, experts split over ranks that share their inputs.
    old_ep = parse_layout("ep=4", 4, fields=OLD)
    assert old_ep.shared == 4 and old_ep.groups == 1
    assert engine_kwargs(old_ep, OLD) == {"tp_size": 4, "enable_expert_parallel": True}
    with pytest.raises(LayoutError, match="dp_replicate_size"):
        engine_kwargs(parse_layout("tp=2", 4, fields=OLD), OLD)
    with pytest.raises(LayoutError, match="use ep=N alone"):
        parse_layout("fsdp=2,ep=2", 2, fields=OLD)


GB = 10**9
# Qwen3-235B-A22B-like: about 8 B parameters outside the experts, 227 B in them, 94 layers.
MOE_235B = TargetSize(dense=8 * GB, experts=227 * GB, layers=94, moe=True)
DENSE_70B = TargetSize(dense=70 * GB, experts=0, layers=80, moe=False)


def test_a_target_that_does_not_fit_is_refused_with_one_that_does():
    h200 = 141 * GB
    message = fit_problem(
        MOE_235B, Layout(dp=8), world=8, memory=h200, bytes_per_param=2, device="GPU", fields=NEW
    )
    assert "470.0 GB of weights" in message and "141.0 GB each has" in message
    assert "--parallel fsdp=4,ep=4,dp=2 fits (117.7 GB per GPU)" in message
    assert (
        fit_problem(
            MOE_235B,
            parse_layout("ep=8", 8, fields=NEW),
            world=8,
            memory=h200,
            bytes_per_param=2,
            device="GPU",
            fields=NEW,
        )
        is None
    )
    one = fit_problem(
        DENSE_70B, Layout(), world=1, memory=h200, bytes_per_param=2, device="GPU", fields=NEW
    )
    assert "no layout of 1 GPUs fits: it needs about 2 of them (--parallel tp=2)" in one


def test_plan_refuses_before_loading(tiny_qwen3):
    with pytest.raises(LayoutError, match="per process under --parallel none"):
        plan_layout("none", tiny_qwen3, num_layers=8, world=1, device="cpu", memory=10_000)
    assert plan_layout("auto", tiny_qwen3, num_layers=8, world=2, device="cpu", memory=GB) == (
        Layout(dp=2)
    )
