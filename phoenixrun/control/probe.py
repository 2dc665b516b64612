"""Is an agent still there? Concurrent TCP connect probes (the master's fast root-cause check).

A killed agent's port refuses at once; a partitioned or crashed host answers nothing, which costs
one timeout. Probing thousands of agents one after another would cost seconds per round, so all
distinct addresses are probed together with non-blocking connects, in batches under the fd limit.
"""
from __future__ import annotations

import errno
import selectors
import socket
import time
from typing import Iterable

BATCH = 512


def unreachable(addrs: Iterable[str], timeout: float, silent_is_dead: bool = True) -> set[str]:
    """The "host:port" addresses that do not accept a TCP connection within `timeout` seconds.

    silent_is_dead=False: only addresses that refuse (or fail) count; one that merely does not
    answer in time is left to the heartbeat timeout. For probes under load, where a slow answer is
    not evidence of death (an overloaded peer, or the prober itself short of CPU)."""
    todo = sorted(set(addrs))
    dead: set[str] = set()
    for i in range(0, len(todo), BATCH):
        dead |= _probe_batch(todo[i:i + BATCH], timeout, silent_is_dead)
    return dead


def _probe_batch(addrs: list[str], timeout: float, silent_is_dead: bool) -> set[str]:
    dead: set[str] = set()
    sel = selectors.DefaultSelector()
    socks: dict[str, socket.socket] = {}   # addr -> its socket, while registered
    try:
        for addr in addrs:
            host, _, port = addr.rpartition(":")
            try:
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                dead.add(addr)
                continue
            s.setblocking(False)
            try:
                rc = s.connect_ex((host.strip("[]"), int(port)))
            except (OSError, ValueError):
                rc = errno.EINVAL
            if rc == 0:
                s.close()
            elif rc in (errno.EINPROGRESS, errno.EAGAIN):
                sel.register(s, selectors.EVENT_WRITE, addr)
                socks[addr] = s
            else:
                s.close()
                dead.add(addr)
        deadline = time.monotonic() + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                s = socks[key.data]
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    dead.add(key.data)
                sel.unregister(s)
                s.close()
        for key in list(sel.get_map().values()):   # no answer within the timeout
            if silent_is_dead:
                dead.add(key.data)
            s = socks[key.data]
            sel.unregister(s)
            s.close()
    finally:
        sel.close()
    return dead
