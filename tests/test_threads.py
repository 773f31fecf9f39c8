"""CPU threads on a shared machine: idle OpenMP threads sleep (set before torch loads), and
torch's threads never outnumber the cores the affinity mask and cgroup quota leave."""

import os
import subprocess
import sys

import torch

from kvpool import threads


def _cgroup(tmp_path, path, quotas):
    """A fake cgroup v2 tree: the process sits at `path`; `quotas` maps a folder below the
    root ("" for the root) to its cpu.max text."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    root = tmp_path / "cgroup"
    for folder, text in quotas.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(text)
    return root, proc


def test_quota_is_rounded_up_to_whole_cores(tmp_path):
    root, proc = _cgroup(tmp_path, "/pod/app", {"pod/app": "150000 100000\n"})
    assert threads.cgroup_cpu_quota(root, proc) == 2


def test_smallest_quota_on_the_path_to_the_root_wins(tmp_path):
    root, proc = _cgroup(tmp_path, "/pod/app", {"": "max 100000", "pod": "100000 100000",
                                                "pod/app": "400000 100000"})
    assert threads.cgroup_cpu_quota(root, proc) == 1


def test_no_quota_when_unlimited_unreadable_or_not_cgroup_v2(tmp_path):
    root, proc = _cgroup(tmp_path, "/app", {"app": "max 100000"})
    assert threads.cgroup_cpu_quota(root, proc) is None
    root, proc = _cgroup(tmp_path / "garbled", "/app", {"app": "lots"})
    assert threads.cgroup_cpu_quota(root, proc) is None
    (tmp_path / "v1").write_text("4:cpu,cpuacct:/app\n")
    assert threads.cgroup_cpu_quota(root, tmp_path / "v1") is None
    assert threads.cgroup_cpu_quota(root, tmp_path / "missing") is None


def test_available_cpus_is_the_affinity_capped_by_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    root, proc = _cgroup(tmp_path, "/app", {"app": "250000 100000"})
    assert threads.available_cpus(root, proc) == 3
    root, proc = _cgroup(tmp_path / "wide", "/app", {"app": "5000000 100000"})
    assert threads.available_cpus(root, proc) == 6


def test_limit_threads_lowers_torchs_threads_to_the_available_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads.limit_threads()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
        torch.set_num_threads(2)
        threads.limit_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _policy_when_torch_loads(env: dict) -> str:
    """OMP_WAIT_POLICY at the moment torch is first imported, by `import kvpool.cache` (the
    package's __init__ runs first; it imports nothing that loads torch). The process ends
    there, before torch loads: what happens after is not the question, and loading takes
    seconds."""
    code = (
        "import builtins, os\n"
        "real = builtins.__import__\n"
        "def spy(name, *args, **kwargs):\n"
        "    if name == 'torch':\n"
        "        print(os.environ.get('OMP_WAIT_POLICY'), flush=True)\n"
        "        os._exit(0)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = spy\n"
        "import kvpool.cache\n"
        "print('torch was never imported')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, check=True)
    return result.stdout.strip()


def test_importing_kvpool_sets_passive_waiting_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy_when_torch_loads(env) == "PASSIVE"
    assert _policy_when_torch_loads({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
