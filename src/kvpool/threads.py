"""CPU threads on a shared machine: torch's OpenMP threads sleep when idle instead of
spinning, and there are no more of them than the cores this process may use, so kvpool slows
down in proportion to the cores other processes take instead of fighting them for theirs.

OpenMP reads its wait policy once, when torch loads it. `kvpool/__init__.py` therefore calls
`prefer_passive_wait()` before anything imports torch: it takes effect for the `kvpool`
command and for programs that import kvpool before torch. This module must not import torch
at the top for the same reason.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def prefer_passive_wait() -> None:
    """Make idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose a
    policy. Spinning threads keep a core busy between parallel regions; when another
    process holds that core, every region then waits for the thread it preempted."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cpus(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """Cores this process may use: its CPU affinity, capped by the CPU quota (cgroup v2
    `cpu.max`, rounded up) of its cgroup and the cgroups above it, where one is set."""
    has_affinity = hasattr(os, "sched_getaffinity")  # Linux; elsewhere count every core
    cpus = len(os.sched_getaffinity(0)) if has_affinity else os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, cpus if quota is None else min(cpus, quota))


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT,
                     proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The smallest CPU quota, in whole cores rounded up, on the path from this process's
    cgroup (v2) to the root; None when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    folder = cgroup_root / path.strip("/")
    quotas = []
    for directory in (folder, *folder.parents):
        quotas.append(_read_cpu_max(directory / "cpu.max"))
        if directory == cgroup_root:
            break
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def limit_threads() -> None:
    """Cap torch's intra-op threads at `available_cpus()`: torch counts the machine's
    cores, not the ones a container's quota or the affinity mask leaves. Threads are only
    ever lowered, and not at all when OMP_NUM_THREADS states the user's choice."""
    import torch

    if "OMP_NUM_THREADS" in os.environ:
        return
    cpus = available_cpus()
    if torch.get_num_threads() > cpus:
        torch.set_num_threads(cpus)


def _read_cpu_max(path: Path) -> int | None:
    """Cores of a `cpu.max` file ("QUOTA PERIOD" in microseconds, or "max PERIOD")."""
    try:
        quota, period = path.read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None
