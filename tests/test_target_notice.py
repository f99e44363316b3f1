"""extract.target.linear_attention_notice: what a rank says about a hybrid target's
linear-attention layers, read from the tiny targets' own configs."""

from __future__ import annotations

import doctest
import logging

import extract.target
from extract.target import linear_attention_notice, read_config, text_config


def layer_types(folder) -> list[str] | None:
    return text_config(read_config(str(folder))).get("layer_types")


def test_a_hybrid_target_on_a_gpu_without_fla_is_warned_to_install_it(tiny_qwen35):
    level, message = linear_attention_notice(layer_types(tiny_qwen35), "cuda", fla_installed=False)
    assert level == logging.WARNING and "pip install flash-linear-attention" in message


def test_with_fla_the_first_runs_tuning_is_announced(tiny_qwen35):
    level, message = linear_attention_notice(layer_types(tiny_qwen35), "cuda", fla_installed=True)
    assert level == logging.INFO and "first run" in message and "Triton's cache" in message


def test_nothing_to_say_on_a_cpu_or_for_a_target_without_linear_attention(tiny_qwen3, tiny_qwen35):
    assert linear_attention_notice(layer_types(tiny_qwen35), "cpu", fla_installed=False) is None
    for installed in (False, True):
        assert (
            linear_attention_notice(layer_types(tiny_qwen3), "cuda", fla_installed=installed)
            is None
        )
    assert linear_attention_notice(None, "cuda", fla_installed=False) is None


def test_doctests():
    result = doctest.testmod(extract.target)
    assert result.failed == 0 and result.attempted > 0
