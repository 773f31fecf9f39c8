"""dev.py: gpu-check without CUDA says so and succeeds; with it, its summary names each
failed test with the first line of its error and counts the skipped ones by reason (read from
pytest's JUnit report). Installs through uv take pip's package sources."""

import importlib.util
import os
import subprocess
import sys
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
