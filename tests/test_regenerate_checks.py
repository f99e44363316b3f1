"""`python -m extract.regen`: what needs no server and no target is checked before either. A
mistyped --data, an --out that would be refused, a bad --target: each is named at once with
--server at a URL nothing listens on, and the server is never what the message is about.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from extract.regen.config import RegenConfig, RegenError
from extract.regen.regenerate import run
from extract.regen.state import STATE, parts_dir, read_state
from tests.completions_server import CompletionsServer
from tests.test_regenerate import write_chats

pytestmark = pytest.mark.usefixtures("one_thread")
NO_SERVER = "no OpenAI-compatible server answers there"


@pytest.fixture()
def nobody() -> str:
    """The URL of a port that was bound, then closed: nothing listens there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl")


def _cli(target: Path, data: Path, out: Path, *more: str) -> tuple[int, str]:
    from click.testing import CliRunner

    from extract.regen.__main__ import main

    args = ["--target", str(target), "--data", str(data), "--out", str(out), *more]
    result = CliRunner().invoke(main, args)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def test_the_url_nothing_listens_on_is_a_message_about_the_server(
    tiny_qwen3, data_file, nobody, tmp_path
):
    code, output = _cli(tiny_qwen3, data_file, tmp_path / "o.jsonl", "--server", nobody)
    assert code == 1 and f"Error: --server {nobody}: {NO_SERVER}" in output, output


def test_a_mistyped_data_path_is_named_before_the_server_is_contacted(
    tiny_qwen3, data_file, nobody, tmp_path
):
    typo = data_file.with_name("chat.jsonl")
    code, output = _cli(tiny_qwen3, typo, tmp_path / "o.jsonl", "--server", nobody)
    assert code == 1 and f"Error: --data: no such file: {typo}" in output, output
    assert "--server" not in output
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, output = _cli(tiny_qwen3, empty, tmp_path / "o.jsonl", "--server", nobody)
    assert code == 1 and f"Error: --data: {empty} holds no rows" in output, output


@pytest.mark.parametrize("out", ["folder", "data", "foreign"])
def test_an_out_that_is_refused_is_named_before_the_server_is_contacted(
    tiny_qwen3, nobody, tmp_path, out
):
    data = write_chats(tmp_path / "chats.jsonl")
    said = {
        "folder": "is a folder; give a .jsonl file path",
        "data": "is one of the --data files",
        "foreign": "exists without state.json, so this command did not write it",
    }[out]
    path = {"folder": tmp_path / "d", "data": data, "foreign": tmp_path / "mine.jsonl"}[out]
    if out == "folder":
        path.mkdir()
    if out == "foreign":
        path.write_text("someone's file\n")
    code, output = _cli(tiny_qwen3, data, path, "--server", nobody, "--overwrite")
    assert code == 1 and f"Error: --out {path}" in output and said in output, output
    assert "--server" not in output
    if out == "foreign":
        assert path.read_text() == "someone's file\n"


def test_a_bad_target_is_named_before_the_server_is_contacted(data_file, nobody, tmp_path):
    missing = tmp_path / "no-target"
    code, output = _cli(missing, data_file, tmp_path / "o.jsonl", "--server", nobody)
    assert code == 1 and str(missing) in output and "--server" not in output, output


def test_another_regeneration_in_out_is_refused_before_the_server_is_contacted(
    tiny_qwen3, data_file, nobody, tmp_path
):
    out = tmp_path / "served.jsonl"
    server = CompletionsServer(tiny_qwen3)
    try:
        cfg = dict(target=str(tiny_qwen3), data=(data_file,), out=out, max_new_tokens=4)
        run(RegenConfig(**cfg, server=server.url, max_rows=4, rows_per_chunk=2, retries=0))
    finally:
        server.stop()
    recorded, written = read_state(parts_dir(out)).settings, out.read_bytes()
    assert recorded["server_model"] == "tiny" and recorded["max_length"] == 4096  # the server's
    again = dict(cfg, server=nobody, max_rows=4, rows_per_chunk=2, retries=0)
    # The same settings: nothing to refuse without the server, which is then contacted.
    with pytest.raises(RegenError, match=NO_SERVER):
        run(RegenConfig(**again))
    with pytest.raises(RegenError) as refused:
        run(RegenConfig(**{**again, "max_new_tokens": 5}))
    message = str(refused.value)
    assert message.startswith(f"--out {out} holds another regeneration:\n"), message
    assert "max_new_tokens: output has 4, requested 5" in message
    assert "server" not in message.replace(f"{out}", "")  # its model and length: not compared
    with pytest.raises(RegenError, match="max_length: output has 4096, requested 100"):
        run(RegenConfig(**again, max_length=100))  # given: known without the server
    assert read_state(parts_dir(out)).settings == recorded and out.read_bytes() == written


def test_a_named_target_is_not_materialized_for_a_mistyped_data_path(
    data_file, tmp_path, monkeypatch
):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    typo = data_file.with_name("chat.jsonl")
    code, output = _cli("smollm2-135m-instruct", typo, tmp_path / "o.jsonl")
    assert code == 1 and f"Error: --data: no such file: {typo}" in output, output
    assert not (tmp_path / "cache").exists()


def test_an_empty_state_file_is_named_before_the_server_is_contacted(
    tiny_qwen3, data_file, nobody, tmp_path
):
    out = tmp_path / "o.jsonl"
    parts_dir(out).mkdir()
    (parts_dir(out) / STATE).write_text(json.dumps({"version": 1}))
    code, output = _cli(tiny_qwen3, data_file, out, "--server", nobody)
    assert code == 1 and f"Error: --out {out}: " in output and "malformed state" in output, output
    assert "--server" not in output


def test_vllm_under_torchrun_is_refused_before_the_target_is_read(tmp_path, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    missing = tmp_path / "no-target"
    cfg = RegenConfig(target=str(missing), out=tmp_path / "o.jsonl", engine="vllm")
    with pytest.raises(RegenError, match="^--engine vllm: vLLM starts its own processes"):
        run(cfg)
