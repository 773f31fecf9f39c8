"""Whether a process group is reachable from this machine only: the TCP sockets processes
listen on (read from Linux's /proc), gloo's default device moved to the default route's
interface, the store directories a module makes."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import stat
import sys
from pathlib import Path

import pytest

from kvpool.engine import rendezvous


def listening_addresses(pids) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of the TCP sockets the processes `pids` listen on (skips the test
    where /proc does not list them)."""
    if not Path("/proc/net/tcp").exists():
        pytest.skip("listening sockets are read from Linux's /proc")
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # closed meanwhile
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inodes.add(link.removeprefix("socket:[").removesuffix("]"))
    addresses = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                addresses.append(_address(local.split(":")[0]))
    return addresses


def _address(hex_words: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net shows it: 32-bit words in hex, each in the host's byte order."""
    raw = bytes.fromhex(hex_words)
    words = [raw[i:i + 4] for i in range(0, len(raw), 4)]
    address = ipaddress.ip_address(b"".join(
        w[::-1] if sys.byteorder == "little" else w for w in words))
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def beyond_loopback(addresses) -> list:
    """The addresses another machine may reach: not loopback ones (0.0.0.0 and :: are every
    interface)."""
    return [address for address in addresses if not address.is_loopback]


def gloo_default_device_beyond_loopback(monkeypatch) -> None:
    """Have gloo's default device listen on the interface of the default route (naming it in
    GLOO_SOCKET_IFNAME), as it does on most hosts, where the hostname resolves to the
    machine's address (here it resolves to 127.0.0.1); nothing where there is no such route.
    Processes started from now on inherit it."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/route").read_text().splitlines()[1:]:
            interface, destination = line.split()[:2]
            if destination == "00000000":
                monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
                return


def record_private_directories(monkeypatch, module) -> list:
    """The store directories `module` makes from now on (rendezvous.private_directory), in
    order."""
    made = []

    def private_directory():
        made.append(rendezvous.private_directory())
        return made[-1]

    monkeypatch.setattr(module, "private_directory", private_directory)
    return made


def assert_private_while_open(directory) -> None:
    """A store's directory: only its owner may enter it."""
    assert stat.S_IMODE(os.stat(directory.name).st_mode) == 0o700
