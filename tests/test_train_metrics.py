"""Metric sums, their summary and the JSONL sink."""

import json
import math
import os

import torch

from train.metrics import MetricsWriter, StatSums, json_line, summarise
from train.summary import format_summary


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


def test_empty_windows_are_strict_json_nulls_that_the_readers_take(tmp_path):
    # A DFlash2 log window where no data token was a candidate: selector_ce has no weight.
    writer = MetricsWriter(tmp_path, enabled=True)
    nan = math.nan
    writer.write({"kind": "train", "step": 1, "loss": 2.0, "tau": nan, "selector_ce": nan,
                  "acc": [0.5, nan]})  # fmt: skip
    writer.write({"kind": "train", "step": 2, "loss": 1.5, "tau": 1.25, "selector_ce": 0.7,
                  "acc": [0.5, 0.25]})  # fmt: skip
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def strict(token):
        raise ValueError(f"non-standard JSON number {token}")

    first = json.loads(lines[0], parse_constant=strict)
    assert first["selector_ce"] is None and first["tau"] is None and first["acc"] == [0.5, None]
    reread = MetricsWriter(tmp_path, enabled=True)  # rewind re-reads the file: nulls come back
    reread.rewind(1)
    reread.close()  # plots a history holding nulls, when matplotlib is installed
    summary = format_summary(tmp_path, export=tmp_path / "export", seconds=1.0)
    assert "loss 2.0000, tau n/a" in summary
    assert json_line({"grad_norm": math.inf, "nested": {"x": [nan, 1]}}) == (
        '{"grad_norm": null, "nested": {"x": [null, 1]}}'
    )


def test_plots_on_a_full_disk_name_the_file_and_leave_no_part_of_it(tmp_path):
    """A run's last write is its plots: on a full disk the error names the image it could not
    write (the run's message shows it), and no image is left cut short."""
    import errno

    import pytest

    from tests.test_extract_safety import small_disk
    from train.metrics import plot_metrics

    acc = [0.5] * 15
    history = [{"kind": "train", "step": s, "loss": 5.0 / s, "acc": acc} for s in range(1, 40)]
    with small_disk(tmp_path / "disk", "8k") as disk:
        with pytest.raises(OSError) as e:
            plot_metrics(history, disk / "plots")
        assert e.value.errno == errno.ENOSPC and e.value.filename == str(disk / "plots/loss.png")
        assert list((disk / "plots").iterdir()) == []


def test_a_finished_runs_last_record_with_nulls_goes_back_to_tensorboard(tmp_path):
    """The same command run again on a finished run (to evaluate and export it again) rewinds
    to its last step, whose record goes to TensorBoard again as read from the file: with the
    nulls of offsets that had no target in its window."""
    import pytest

    pytest.importorskip("tensorboard")
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write({"kind": "train", "step": 1, "loss": 2.0, "acc": [0.5, math.nan]})
    writer.close()
    again = MetricsWriter(tmp_path, enabled=True)
    again.rewind(1, last=True)
    again.close()
    assert [r["acc"] for r in again.history] == [[0.5, None]]


def test_an_image_a_killed_run_was_writing_is_removed_by_the_next_plots(tmp_path):
    from train.metrics import plot_metrics

    left = tmp_path / "plots" / ".loss.png.tmp.123.456"
    left.parent.mkdir()
    left.write_bytes(b"\x89PNG")
    os.utime(left, (1, 1))  # written long ago
    plot_metrics([{"kind": "train", "step": 1, "loss": 2.0, "acc": [0.5]}], tmp_path / "plots")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["accuracy.png", "loss.png"]
