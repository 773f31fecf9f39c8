"""Where the engine's process groups meet, reachable from this machine only: the store is a
file in a directory of this user's alone, and gloo's sockets listen on the loopback interface.

A TCPStore's server listens on every interface, whatever host it is given, and takes any
client; gloo's default device listens on the address the machine's hostname resolves to, on
most hosts an external one. Both would let anyone who reaches the machine into a group that
carries every prompt's KV (disaggregation) or every step (tensor parallelism)."""

from __future__ import annotations

import datetime
import os
import tempfile

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
GLOO = "kvpool_gloo"  # gloo on the loopback interface: a backend dist.new_group takes


def private_directory() -> tempfile.TemporaryDirectory:
    """A directory for a group's store: mode 0700, removed by its cleanup() (or once
    dropped)."""
    return tempfile.TemporaryDirectory(prefix="kvpool-group-")


def store_path(directory: tempfile.TemporaryDirectory) -> str:
    """The store file of a group in `directory`."""
    return os.path.join(directory.name, "store")


def file_store(path: str, size: int, timeout: datetime.timedelta) -> dist.FileStore:
    """A handle on the store at `path` of a group of `size` ranks, whose waits raise after
    `timeout`."""
    store = dist.FileStore(path, size)
    store.set_timeout(timeout)
    return store


def loopback_gloo(store: dist.Store, rank: int, size: int,
                  timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose sockets listen on the loopback interface; its operations raise
    after `timeout`."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(store, rank, size, options)


# torch.distributed builds its gloo groups on gloo's default device; this backend builds them
# with loopback_gloo (dist.init_process_group and dist.new_group take it by its name).
dist.Backend.register_backend(GLOO, loopback_gloo, devices=["cpu"])
