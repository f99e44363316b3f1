"""Metric sums, their summary and the JSONL sink."""

import json
import math

import torch

from train.metrics import MetricsWriter, StatSums, summarise


def test_sums_give_weighted_loss_tau_and_accuracy_per_offset():
    sums = StatSums(4, torch.device("cpu"))
    stats = {
        "correct_per_offset": torch.tensor([0.0, 2.0, 1.0, 0.0]),
        "count_per_offset": torch.tensor([0.0, 2.0, 2.0, 1.0]),
        "accepted_sum": torch.tensor(3.0),
        "num_blocks": torch.tensor(2.0),
    }
    sums.add(torch.tensor(6.0), torch.tensor(2.0), stats, torch.tensor(100))
    sums.add(torch.tensor(2.0), torch.tensor(2.0), stats, torch.tensor(50))
    sums.add_step(torch.tensor(3.0))
    sums.add_step(torch.tensor(1.0))
    out = sums.reduce()
    assert out["loss"] == 2.0  # (6 + 2) / (2 + 2), not the mean of 3 and 1 per batch
    assert out["tau"] == 1.0 + 6.0 / 4.0
    assert out["acc"] == [1.0, 0.5, 0.0]
    assert out["tokens"] == 150 and out["grad_norm"] == 2.0
    again = sums.reduce()  # reset after reduce
    assert math.isnan(again["loss"]) and again["tokens"] == 0


def test_summarise_handles_empty_offsets():
    values = [0.0] * 7 + [0.0] * 3 + [0.0, 1.0, 0.0]
    out = summarise(values, 3)
    assert math.isnan(out["loss"]) and out["acc"][0] == 0.0 and math.isnan(out["acc"][1])


def test_writer_appends_jsonl_on_rank_zero_only(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"kind": "train", "step": 1, "loss": 2.0, "acc": [0.5]})
    writer.write({"kind": "eval", "step": 1, "loss": 3.0, "acc": [0.25]})
    writer.close()  # plots when matplotlib is installed, a log line otherwise
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == ["train", "eval"]
    other = tmp_path / "other"
    other.mkdir()
    quiet = MetricsWriter(other, enabled=False)
    quiet.write({"kind": "train", "step": 1})
    quiet.close()
    assert list(other.iterdir()) == []


def test_rewind_drops_records_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    for step in (1, 2, 3):
        writer.write({"kind": "train", "step": step, "loss": 1.0, "acc": []})
    MetricsWriter(tmp_path, enabled=True).rewind(2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
