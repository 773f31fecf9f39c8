"""dev.py gpu-check: without CUDA it says so and succeeds; with it, its summary names each
failed test with the first line of its error and counts the skipped ones by reason (read from
pytest's JUnit report)."""

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

