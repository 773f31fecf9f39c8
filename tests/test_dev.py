"""dev.py: gpu-check without CUDA says so and succeeds; with it, its summary names each
failed test with the first line of its error and counts the skipped ones by reason (read from
pytest's JUnit report). Installs through uv take pip's package sources. A kvpool command runs
where dev.py was started, and a Ctrl-C reaches it, which dev.py waits out."""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)


def test_gpu_check_without_cuda_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "dev.py", "gpu-check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"gpu-check: no CUDA device visible to {sys.executable} (")
    assert done.stdout.rstrip().endswith("nothing checked")


def test_failures_are_each_test_with_the_first_line_of_its_error(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok[cpu]"/>'
        '<testcase classname="tests.test_a" name="test_bad[cuda]">'
        '<failure message="AssertionError: assert 1 == 2&#10;+ where 1 = f()">trace</failure>'
        '</testcase>'
        '<testcase classname="tests.test_b" name="test_setup"><error message="">'
        'fixture broke&#10;more</error></testcase>'
        '<testcase classname="tests.test_b" name="test_skipped"><skipped message="no"/></testcase>'
        '</testsuite></testsuites>')
    assert dev.failures(report) == [
        ("tests.test_a::test_bad[cuda]", "AssertionError: assert 1 == 2"),
        ("tests.test_b::test_setup", "fixture broke"),
    ]


def test_skips_are_counted_by_reason_most_first(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="a"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="t" name="b"><skipped message="redis-server is missing"/>'
        '</testcase>'
        '<testcase classname="t" name="c"><skipped message="needs CUDA"/></testcase>'
        '<testcase classname="t" name="d"/>'
        '</testsuite></testsuites>')
    assert dev.skip_reasons(report) == [(2, "needs CUDA"), (1, "redis-server is missing")]



def test_pips_sources_become_uv_options_that_choose_across_indexes_as_pip_does(monkeypatch):
    listed = ("global.cert='/etc/ssl/certs/ca.crt'\n"
              "global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/opt/wheels'\n"
              ":env:.find-links='/opt/wheels'\n"
              "global.constraint='/etc/pip/constraints.txt'\n")
    monkeypatch.setattr(dev.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, listed, ""))
    assert dev._pip_sources() == [
        "--extra-index-url", "file:///a/simple", "--extra-index-url", "file:///b/simple",
        "--find-links", "/opt/wheels", "--constraint", "/etc/pip/constraints.txt",
        "--index-strategy", "unsafe-best-match"]


def test_without_pip_sources_uv_keeps_its_own_defaults(monkeypatch):
    monkeypatch.setattr(dev.subprocess, "run",
                        lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "", ""))
    assert dev._pip_sources() == []


def fake_kvpool(folder: Path, body: str) -> Path:
    """A bin folder whose `kvpool` is a Python script of `body` (for dev.BIN)."""
    script = folder / "bin" / "kvpool"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return script.parent


def test_a_kvpool_command_runs_where_dev_py_was_started(tmp_path, monkeypatch):
    """So that a relative path given (a model folder, --plot, --disk-tier) is the caller's."""
    bin_folder = fake_kvpool(tmp_path, """
        import os, sys
        with open(sys.argv[1], "w") as f:
            f.write(os.getcwd())
        """)
    monkeypatch.setattr(dev, "BIN", bin_folder)
    monkeypatch.setattr(dev, "ensure_venv", lambda: None)
    monkeypatch.setattr(sys, "argv", ["dev.py", str(tmp_path / "cwd.txt")])
    monkeypatch.chdir(tmp_path)
    assert dev.main() == 0
    assert (tmp_path / "cwd.txt").read_text() == str(tmp_path)


# Runs dev.main() with dev.BIN the folder given first, the rest its arguments.
DRIVER = f"""
import importlib.util, pathlib, sys
spec = importlib.util.spec_from_file_location("dev", {str(ROOT / "dev.py")!r})
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)
dev.BIN, dev.ensure_venv = pathlib.Path(sys.argv[1]), lambda: None
sys.argv = ["dev.py", *sys.argv[2:]]
sys.exit(dev.main())
"""


def ctrl_c(bin_folder: Path) -> subprocess.CompletedProcess:
    """Start dev.py on the fake kvpool in a process group of its own, wait for the kvpool to
    print "ready", then send the group SIGINT, as a terminal's Ctrl-C does."""
    # A suite started in the background by a shell without job control inherits SIGINT
    # ignored, which dev.py would inherit too.
    process = subprocess.Popen([sys.executable, "-c", DRIVER, str(bin_folder), "serve"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout.readline() == "ready\n"
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_ctrl_c_reaches_the_command_and_dev_py_waits_for_it_to_finish(tmp_path):
    """kvpool serve drains on SIGINT before it exits: dev.py kills nothing meanwhile."""
    done = ctrl_c(fake_kvpool(tmp_path, """
        import signal, sys, time
        def drain(*_):
            time.sleep(1)
            print("drained", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGINT, drain)
        print("ready", flush=True)
        time.sleep(60)
        """))
    assert (done.returncode, done.stdout, done.stderr) == (0, "drained\n", "")


def test_a_command_ended_by_ctrl_c_is_exit_130(tmp_path):
    done = ctrl_c(fake_kvpool(tmp_path, """
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("ready", flush=True)
        time.sleep(60)
        """))
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")
