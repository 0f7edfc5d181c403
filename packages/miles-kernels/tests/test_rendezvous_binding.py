"""Multi-process tier (gloo, in threads of this process, on 127.0.0.1): a weight-update group, or any rendezvous
made with `rendezvous_store`, meeting on a loopback address listens on loopback only.

torch's own TCPStore server listens on every interface of the node whatever address it is given (checked here too,
so that this test notices the day torch changes), and gloo on the address of the host name. The sockets each
listens on are read from /proc/net/tcp{,6} by the port numbers this process holds open.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from miles_kernels import broadcast_tensors, destroy_weight_update_group, init_weight_update_group
from miles_kernels.weight_sync.distributed import rendezvous_store

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")


def listening() -> dict[int, set[str]]:
    """{port: the addresses something in this process listens on at that port}."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports: dict[int, set[str]] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            raw = b"".join(
                raw[i : i + 4][::-1] for i in range(0, len(raw), 4)
            )  # /proc prints 32-bit words, host order
            address = ipaddress.ip_address(raw if width == 16 else raw[:4])
            if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            ports.setdefault(int(hex_port, 16), set()).add(str(address))
    return ports


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_torch_alone_listens_on_every_interface() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))  # type: ignore[attr-defined]
    assert listening()[port] & {"0.0.0.0", "::"}, "torch's store binds its address now: rendezvous_store may go"
    del store


def test_the_store_listens_on_its_address_only() -> None:
    port = free_port()
    store = rendezvous_store("127.0.0.1", port, 1, is_host=True, timeout=timedelta(seconds=10))
    assert listening()[port] == {"127.0.0.1"}
    client = rendezvous_store("127.0.0.1", port, 1, is_host=False, timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_loopback_weight_group_listens_on_loopback_only() -> None:
    port, world_size = free_port(), 3
    before = set(listening())
    groups: list[object] = [None] * world_size
    errors: list[BaseException] = []

    def join(rank: int) -> None:
        try:
            groups[rank] = init_weight_update_group("127.0.0.1", port, rank, world_size, "bind_test", timeout_s=30)
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    opened = {port: addresses for port, addresses in listening().items() if port not in before}
    assert port in opened and len(opened) > 1  # the store, and gloo's pairs
    assert all(addresses == {"127.0.0.1"} for addresses in opened.values()), opened
    sent, received = torch.arange(6.0), [torch.zeros(6) for _ in range(world_size - 1)]
    threads = [threading.Thread(target=broadcast_tensors, args=(groups[0], [sent], 0))]
    threads += [
        threading.Thread(target=broadcast_tensors, args=(g, [r], 0)) for g, r in zip(groups[1:], received, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert all(torch.equal(r, sent) for r in received)  # still a working group
    for group in groups:
        destroy_weight_update_group(group)  # type: ignore[arg-type]
