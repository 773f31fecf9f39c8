"""`kvpool chat` on the built-in tiny model, its turns read from stdin."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.cli.main import build_parser, main
from kvpool.engine import LLM

pytest.importorskip("jinja2")

SRC = Path(__file__).resolve().parents[1] / "src"


def _chat(lines: str, *extra: str) -> str:
    args = build_parser().parse_args(["chat", "--max-tokens", "8", *extra])
    stdout = io.StringIO()
    assert args.run(args, stdin=io.StringIO(lines), stdout=stdout) == 0
    return stdout.getvalue()


def _hits(out: str) -> list[tuple[int, int]]:
    """(prompt tokens, prefix-cache hits) of each turn."""
    return [(int(n), int(h)) for n, h in
            re.findall(r"\[(\d+) prompt tokens, (\d+) from the prefix cache", out)]


def test_each_turn_replays_the_history_from_the_prefix_cache():
    turns = _hits(_chat("hello there, model\nand a second question\n"))
    assert len(turns) == 2
    (first, first_hits), (second, second_hits) = turns
    assert first_hits == 0 and second > first
    assert second_hits >= first // 16 * 16  # every full page of the first turn's prompt


def test_reset_starts_a_new_history():
    out = _chat("hello there, model\n/reset\nhello there, model\n")
    assert "(history cleared)" in out
    (first, _), (again, _) = _hits(out)
    assert again == first


def test_the_system_message_opens_every_history():
    plain = _hits(_chat("hi\n"))[0][0]
    with_system = _hits(_chat("hi\n", "--system", "Be brief."))[0][0]
    assert with_system == plain + len("system: Be brief.\n")


def test_a_turn_too_long_is_refused_alone_and_the_chat_goes_on():
    out = _chat("hello there, model\n" + "x" * 5000 + "\nand a second question\n")
    assert "(not sent: prompt of 5" in out and "over max_model_len 4096)" in out
    (first, _), (second, second_hits) = _hits(out)
    assert second > first and second_hits >= first // 16 * 16  # the history before it


def test_a_failed_turn_is_reported_and_left_out_of_the_history(monkeypatch):
    import kvpool.cli.terminal_chat

    def nan_logits_once(*args, **kwargs) -> LLM:
        """An LLM whose first forward's logits are NaN: the engine fails that request."""
        llm = LLM(*args, **kwargs)
        forward = llm._forward

        def first(batch, previous):
            del llm._forward  # back to the real method
            return torch.full_like(forward(batch, previous), float("nan"))
        llm._forward = first
        return llm

    monkeypatch.setattr(kvpool.cli.terminal_chat, "LLM", nan_logits_once)
    out = _chat("hello there, model\nand a second question\n")
    assert "\n(failed: request '0' failed: the model's logits for its token at position " in out
    monkeypatch.undo()
    alone = _hits(_chat("and a second question\n"))
    assert _hits(out) == [(alone[0][0], 0)]  # the second turn, with no history before it


def test_kvpool_chat_reads_stdin_until_it_ends(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("> ") and out.endswith("> \n") and len(_hits(out)) == 1


def test_generate_chat_sends_the_prompt_in_the_chat_template(capsys):
    for extra in ([], ["--chat"]):
        assert main(["generate", "hello", "--max-tokens", "4", "--temperature", "0",
                     *extra]) == 0
    plain, chat = capsys.readouterr().out.splitlines()
    # The tiny model has no template of its own: the fallback's "user: hello\nassistant:".
    assert plain != chat


def test_chat_with_a_model_without_a_tokenizer_is_one_line_with_exit_2(tmp_path, capsys):
    from models_util import make_hf_model, save_hf_model

    folder = save_hf_model(make_hf_model("llama"), tmp_path)
    assert not (folder / "tokenizer.json").exists()
    for command in (["chat"], ["generate", "hi", "--chat"]):
        assert main([*command, "--model", str(folder)]) == 2
        assert capsys.readouterr().err.endswith(
            "error: this model has no tokenizer.json: a chat needs one\n")


def test_ctrl_c_ends_a_chat_with_exit_130_and_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    # A chat at a terminal takes Ctrl-C; a suite started in the background by a shell without
    # job control inherits SIGINT ignored, which the chat's process would inherit too.
    process = subprocess.Popen([sys.executable, "-m", "kvpool.cli.main", "chat"], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.read(2) == b"> "  # waiting for a turn
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
        assert process.returncode == 130
        assert err.decode().endswith("kvpool chat: interrupted\n") and b"Traceback" not in err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
