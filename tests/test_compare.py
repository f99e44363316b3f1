"""`python -m train.proof.compare`: the report from hand-written run folders, and its warnings."""

import importlib.util
import json

from click.testing import CliRunner

from train.proof.compare import main, markdown_report, mismatch_warnings, read_run

CACHE = {
    "format_version": 1,
    "format": "zarr",
    "store": "bf16",
    "target": "sha256:ab12",
    "tokenizer_sha256": "tok",
    "chat_template_sha256": "tpl",
    "layer_ids": [1, 3, 5],
    "max_length": 3072,
    "rows_per_part": 512,
    "sources": ["sha-of-demo"],
}


def write_run(folder, *, records, train=None, cache=None, ranks=1):
    """A run folder as train.run and train.metrics write it: config.json and metrics.jsonl."""
    config_train = {
        "data": "shards",
        "out": str(folder),
        "drafter_layers": 5,
        "block_size": 4,
        "lr": 6e-4,
        "seed": 0,
        "eval_fraction": 0.01,
        "eval_parts": None,
        "eval_batches": 0,
        "max_length": 3072,
        "log_every": 10,
        **(train or {}),
    }
    config = {"train": config_train, "drafter": {"block_size": 4}, "cache": cache or CACHE}
    if ranks is not None:  # None: a run folder written before the rank count was recorded
        config["ranks"] = ranks
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def train_record(step, loss, tau, acc):
    return {
        "kind": "train",
        "step": step,
        "epoch": 0,
        "loss": loss,
        "tau": tau,
        "acc": acc,
        "lr": 1e-4,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        "data_wait": 0.0,
    }


def eval_record(step, loss, tau, acc):
    return {"kind": "eval", "step": step, "loss": loss, "tau": tau, "acc": acc, "tokens": 4096.0}


def two_runs(tmp_path, **b_over):
    a = write_run(
        tmp_path / "runs" / "a",
        records=[
            train_record(10, 3.0, 1.5, [0.5, 0.3, 0.1]),
            eval_record(10, 3.1, 1.4, [0.4, 0.2, 0.1]),
            train_record(20, 2.0, 2.5, [0.8, 0.6, 0.4]),
            eval_record(20, 2.1, 2.2, [0.7, 0.5, 0.3]),
        ],
    )
    b = write_run(
        tmp_path / "runs" / "b",
        records=[
            eval_record(20, 1.9, 2.6, [0.75, 0.55, float("nan")]),
            eval_record(40, 1.5, 2.9, [0.85, 0.65, 0.45]),
        ],
        **{"train": {"drafter_layers": 3}, **b_over},
    )
    return a, b


def rows_of(report):
    """Markdown table rows as lists of cells (header and alignment rows included)."""
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in report.splitlines()
        if line.startswith("|")
    ]


def test_report_takes_the_last_eval_record_and_lists_settings_that_differ(tmp_path):
    a, b = two_runs(tmp_path)
    report = markdown_report([read_run(a), read_run(b)])
    assert "Warning" not in report  # same cache, same eval split, both from eval records
    rows = rows_of(report)
    assert rows[0] == ["run", "metrics", "step", "loss", "tau", "acc@1", "acc@2", "acc@3"]
    assert rows[2] == [str(a), "eval", "20", "2.1000", "2.200", "0.700", "0.500", "0.300"]
    assert rows[3] == [str(b), "eval", "40", "1.5000", "2.900", "0.850", "0.650", "0.450"]
    # The ablated setting appears once, with one value per run; bookkeeping fields do not.
    assert ["drafter_layers", "5", "3"] in rows
    assert not any(row[0] in ("out", "log_every", "ranks") for row in rows)


def test_the_number_of_training_processes_is_a_setting_and_the_cards_are_not(tmp_path):
    # Four processes take four micro-batches a step: the global batch differs.
    a, b = two_runs(tmp_path, ranks=4, train={"drafter_layers": 5, "gpus": "4-7"})
    rows = rows_of(markdown_report([read_run(a), read_run(b)]))
    assert ["ranks", "1", "4"] in rows
    assert not any(row[0] == "gpus" for row in rows)
    # A run folder without the record shows "-" beside the other's count.
    old = write_run(tmp_path / "old", records=[eval_record(5, 2.0, 2.0, [0.5])], ranks=None)
    rows = rows_of(markdown_report([read_run(old), read_run(b)]))
    assert ["ranks", "-", "4"] in rows


def test_train_records_stand_in_without_evaluations(tmp_path):
    a, _ = two_runs(tmp_path)
    c = write_run(
        tmp_path / "runs" / "c",
        records=[train_record(5, 4.0, 1.2, [0.2]), train_record(15, 3.5, 1.3, [0.3, 0.1])],
    )
    report = markdown_report([read_run(a), read_run(c)])
    assert [str(c), "train", "15", "3.5000", "1.300", "0.300", "0.100", "-"] in rows_of(report)
    assert f"figures come from different records ({a}: eval, {c}: train)" in report


def test_warns_when_caches_or_eval_splits_differ(tmp_path):
    other_cache = {**CACHE, "layer_ids": [2, 4], "store": "fp8"}
    a, b = two_runs(tmp_path, cache=other_cache)
    warnings = mismatch_warnings([read_run(a), read_run(b)])
    expected = f"{b} was trained on another cache than {a} (manifest identity differs in: "
    assert warnings == [expected + "layer_ids, store)"]
    c = write_run(
        tmp_path / "runs" / "c",
        records=[eval_record(20, 2.0, 2.0, [0.5])],
        train={"data": "/elsewhere/shards", "eval_parts": 2, "eval_batches": 8},
    )
    warnings = mismatch_warnings([read_run(a), read_run(c)])
    assert warnings == [
        f"{c} read its cache from /elsewhere/shards, {a} from shards (same manifest identity)",
        f"eval splits differ between {a} and {c}: eval_parts None vs 2, eval_batches 0 vs 8",
    ]
    report = markdown_report([read_run(a), read_run(c)])
    assert report.count("> **Warning:**") == 2


def test_cli_prints_writes_and_plots(tmp_path):
    a, b = two_runs(tmp_path)
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"kind": "eval", "step": 5')  # a run killed mid-write
    out, plot = tmp_path / "report" / "compare.md", tmp_path / "compare.png"
    result = CliRunner().invoke(main, [str(a), str(b), "--out", str(out), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == result.stdout
    assert [str(b), "eval", "40"] == rows_of(result.stdout)[3][:3]
    assert "metrics.jsonl line 3 is not JSON: skipped" in result.stderr
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not plot.exists()
        assert "matplotlib is not installed: no plot written" in result.stderr


def test_cli_names_a_report_path_it_cannot_write(tmp_path):
    a, b = two_runs(tmp_path)
    (tmp_path / "afile").write_text("")
    for option, path in [("--out", tmp_path), ("--out", tmp_path / "afile" / "r.md")]:
        result = CliRunner().invoke(main, [str(a), str(b), option, str(path)])
        assert result.exit_code == 1 and "cannot write" in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


def test_cli_refuses_a_folder_without_config(tmp_path):
    a, _ = two_runs(tmp_path)
    result = CliRunner().invoke(main, [str(a), str(tmp_path / "missing")])
    assert result.exit_code != 0
    assert f"{tmp_path / 'missing'}: no config.json, not a run folder" in result.output
    export = tmp_path / "run" / "export"  # a run's export, given instead of its run folder
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    (export / "model.safetensors").write_bytes(b"")
    result = CliRunner().invoke(main, [str(a), str(export)])
    assert result.exit_code == 1, result.output
    assert f"{export}: a drafter export, not a run folder (give {export.parent})" in result.output


def test_selected_tau_column_when_a_run_has_a_selector(tmp_path):
    rec = {"kind": "eval", "step": 5, "loss": 1.0, "tau": 1.5, "acc": [0.5, 0.25, 0.1]}
    a = write_run(tmp_path / "dflash", records=[rec])
    b = write_run(
        tmp_path / "dflash2", records=[{**rec, "selected_tau": 1.75}], train={"drafter_type": "x"}
    )
    report = markdown_report([read_run(a), read_run(b)])
    header, _, row_a, row_b = report.split("\n\n")[1].splitlines()[:4]
    assert "| tau | selected tau | acc@1 |" in header
    assert "| 1.500 | - | 0.500 |" in row_a and "| 1.500 | 1.750 | 0.500 |" in row_b
    assert "selected tau" not in markdown_report([read_run(a)])


def test_tau_prob_column_when_a_run_is_dspark(tmp_path):
    rec = {"kind": "eval", "step": 5, "loss": 1.0, "tau": 1.5, "acc": [0.5, 0.25, 0.1]}
    a = write_run(tmp_path / "dflash", records=[rec])
    b = write_run(
        tmp_path / "dspark", records=[{**rec, "tau_prob": 1.625, "acc": [0.75, 0.5, 0.25, 0.2]}]
    )
    report = markdown_report([read_run(a), read_run(b)])
    header, _, row_a, row_b = report.split("\n\n")[1].splitlines()[:4]
    assert "| tau | tau_prob | acc@1 | acc@2 | acc@3 | acc@4 |" in header
    assert "| 1.500 | - | 0.500 |" in row_a and row_a.endswith("| - |")
    assert "| 1.500 | 1.625 | 0.750 |" in row_b


def test_the_plot_draws_training_curves_with_the_eval_points(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from train.proof.compare import figure

    a, b = two_runs(tmp_path)
    fig = figure([read_run(a), read_run(b)])
    _, ax_tau, ax_loss = fig.axes
    lines = {line.get_label(): line for line in ax_tau.get_lines()}
    assert list(lines[f"{a} train"].get_xdata()) == [10, 20]  # the training curve
    assert list(lines[f"{a} train"].get_ydata()) == [1.5, 2.5]
    assert list(lines[f"{a} eval"].get_ydata()) == [1.4, 2.2]  # and the held-out points on it
    assert (
        list(lines[f"{b} eval"].get_xdata()) == [20, 40]
        and list(lines[f"{b} train"].get_xdata()) == []
    )  # b logged no train record
    losses = {line.get_label(): list(line.get_ydata()) for line in ax_loss.get_lines()}
    assert losses[f"{a} train"] == [3.0, 2.0] and losses[f"{a} eval"] == [3.1, 2.1]


def test_cli_names_the_path_given_when_it_is_a_folder(tmp_path):
    a, b = two_runs(tmp_path)
    folder = tmp_path / "taken"
    folder.mkdir()
    options = ["--out"] + (["--plot"] if importlib.util.find_spec("matplotlib") else [])
    for option in options:
        result = CliRunner().invoke(main, [str(a), str(b), option, str(folder)])
        assert result.exit_code == 1, result.output
        assert f"Error: cannot write {folder}: Is a directory" in result.output, result.output


def test_a_metrics_line_that_is_json_but_no_record_is_skipped(tmp_path):
    a, b = two_runs(tmp_path)
    with open(b / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n7\n")
    result = CliRunner().invoke(main, [str(a), str(b)])
    assert result.exit_code == 0, result.output
    assert [str(b), "eval", "40"] == rows_of(result.stdout)[3][:3]
    for number in (3, 4):
        assert f"metrics.jsonl line {number} is not a metrics record: skipped" in result.stderr


def test_one_cache_named_relative_and_absolute_is_no_warning(tmp_path, monkeypatch):
    """Training records --data and --out as typed: a run started in tmp_path with relative
    paths read the same cache as one given it absolute."""
    monkeypatch.chdir(tmp_path)
    records = [eval_record(20, 2.0, 2.0, [0.5])]
    a = write_run(tmp_path / "a", records=records, train={"data": str(tmp_path / "shards")})
    b = write_run(tmp_path / "b", records=records, train={"data": "shards", "out": "b"})
    c = write_run(tmp_path / "c", records=records, train={"data": "other", "out": "c"})
    for given in (b, "b"):
        assert mismatch_warnings([read_run(a), read_run(given)]) == []
    assert mismatch_warnings([read_run(a), read_run(c)]) == [
        f"{c} read its cache from other, {a} from {tmp_path / 'shards'} (same manifest identity)"
    ]
