"""`kvpool serve` as a command: it serves until SIGTERM and then exits 0; without the server
extra it says what to install and exits 2."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvpool.cli.main import main

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("flags", [[], ["--disaggregated"], ["--tensor-parallel-size", "2"]],
                         ids=["one-engine", "disaggregated", "two-ranks"])
def test_serve_answers_then_exits_0_on_sigterm_leaving_no_process(flags):
    """The server, its engine processes, a tensor-parallel engine's worker and the
    forkservers that started them: all gone once `kvpool serve` exits. It serves on the port
    the system picks for port 0, and says which."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.main", "serve", "--model", "tiny", "--port", "0",
         "--num-pages", "64", *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)  # a process group of its own: every process it starts
    try:
        url = _announced_url(process)
        deadline = time.monotonic() + 180  # a loaded 2-core machine starts 3 processes slowly
        while True:
            assert process.poll() is None, process.communicate()[1].decode()
            try:
                if httpx.get(f"{url}/health", timeout=30).status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, "kvpool serve did not answer in 180 s"
            time.sleep(0.1)
        # the first request of engines just started (httpx's own limit is 5 s)
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
        assert response.json()["usage"]["completion_tokens"] <= 3
        trackers = {pid for pid, cmdline in (_live_processes(process.pid) or {}).items()
                    if "multiprocessing.resource_tracker" in cmdline}
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, process.communicate()[1].decode()
        # It ends the processes it started, forkservers included, before it exits; only
        # multiprocessing's resource tracker ends on its own, once kvpool serve has exited.
        left = _live_processes(process.pid)
        assert left is None or set(left) <= trackers, left
        assert _group_ends(process.pid, 30), "processes of kvpool serve outlived it"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _announced_url(process: subprocess.Popen) -> str:
    """The address `kvpool serve` says it serves on, read from its stderr."""
    for line in process.stderr:
        if match := re.search(rb"on (http://127\.0\.0\.1:[1-9][0-9]*)/v1$", line.strip()):
            return match.group(1).decode()
    raise AssertionError(f"kvpool serve exited {process.wait()} without saying where it serves")


def _group_ends(group: int, seconds: float) -> bool:
    """Whether process group `group` has no process left within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        live = _live_processes(group)
        if live is None:  # no /proc: a zombie counts as a process
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                return True
        elif not live:
            return True
        time.sleep(0.05)
    return False


def _live_processes(group: int) -> dict[int, str] | None:
    """{pid: command line} of the processes of process group `group` that have not exited,
    read from /proc (None without it). A zombie, a process that has exited and waits for its
    parent to reap it (init, once its parent has exited, and that may take seconds), is
    not one."""
    if not os.path.isdir("/proc/self"):
        return None
    live = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            # after the command's name, in parentheses: state, parent, process group
            state, _, pgrp = stat[stat.rindex(b")") + 2:].split()[:3]
            if int(pgrp) != group or state == b"Z":
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):  # it ended while we read it
            continue
        live[int(entry.name)] = cmdline
    return live


def test_serve_without_the_server_extra_names_the_install_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import fails as if not installed
    assert main(["serve", "--model", "tiny"]) == 2
    assert capsys.readouterr().err == ("kvpool serve: error: needs uvicorn: "
                                       "pip install 'kvpool[server]'\n")


def test_serve_on_a_host_or_port_it_cannot_bind_is_one_line_with_exit_2_before_the_engine(
        capsys, monkeypatch):
    monkeypatch.setattr("kvpool.server.app.build_app", None)  # the engine must not start
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "tiny", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvpool serve: error: cannot listen on 127.0.0.1:{port}: ")
        assert "in use" in err and err.count("\n") == 1
    assert main(["serve", "--model", "tiny", "--host", "999.1.1.1"]) == 2
    assert capsys.readouterr().err.startswith(
        "kvpool serve: error: cannot listen on 999.1.1.1:8000: ")


@pytest.fixture
def taken_port():
    """A port another socket listens on: an option error must come before the port's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield str(taken.getsockname()[1])


def test_serve_with_prefix_isolation_per_key_but_no_key_is_one_line_with_exit_2(
        capsys, monkeypatch, taken_port):
    monkeypatch.delenv("KVPOOL_API_KEY", raising=False)
    assert main(["serve", "--model", "tiny", "--port", taken_port, "--prefix-isolation",
                 "per-key"]) == 2
    assert capsys.readouterr().err == \
        "kvpool serve: error: prefix isolation per key needs API keys\n"


def test_serve_with_an_empty_api_key_is_one_line_with_exit_2(capsys, taken_port):
    assert main(["serve", "--model", "tiny", "--port", taken_port, "--api-key", "a-key",
                 "--api-key", ""]) == 2
    assert capsys.readouterr().err == ("kvpool serve: error: api keys must be non-empty strings; "
                                       "key 2 of 2 is empty\n")


def test_serve_with_an_api_key_holding_whitespace_is_one_line_with_exit_2(capsys,
                                                                          monkeypatch):
    monkeypatch.setattr("kvpool.server.app.Server", None)  # the engine must not start
    argv = ["serve", "--model", "tiny", "--port", "0", "--api-key", " a key\n"]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("kvpool serve: error: api keys must hold no whitespace "
                                       "or control characters; key 1 of 1 holds U+0020\n")
