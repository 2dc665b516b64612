"""Which address a node is reached at, and which a master must refuse.

Defaults used to be 127.0.0.1 (agent `--host`, master `--host`) or the hostname's resolution (the launcher's
`--local-addr`, which is 127.0.0.1 wherever /etc/hosts maps the hostname there): fine on one machine, and on
several a node advertised an address nobody else could reach - the master's probes then declared healthy nodes
lost. The decisions are the pure functions here; `route_source` and `interfaces` are their only inputs from the
system.
"""
from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"     # what `phoenixrun master` listens on by default: nodes reach it from anywhere


def is_loopback(host: str) -> bool:
    """A loopback address (or the name localhost); other names are not judged (no lookups here)."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host_port(endpoint: str) -> tuple[str, int | None]:
    """'host:port', '[v6]:port' or 'host' -> (host, port or None)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or (host.count(":") and not host.endswith("]")):    # no port, or a bare IPv6 address
        return endpoint.strip("[]"), None
    return host.strip("[]"), int(port) if port.isdigit() else None


def choose_node_addr(explicit: str | None, endpoint_host: str, route_src: str | None) -> str:
    """The address a node advertises to its peers (agent `--host`, launcher `--local-addr`).

    explicit: what the user passed (wins); endpoint_host: the master's host; route_src: the local address the
    kernel picks to reach it (None: no route). A master on this machine (loopback endpoint) means a
    single-machine job: loopback. Otherwise the route's source address, which is by construction one the
    master can reach back; loopback only when there is no route at all (the master then refuses it with a
    clear error if the node is remote, rather than the job failing later)."""
    if explicit:
        return explicit
    if is_loopback(endpoint_host):
        return LOOPBACK
    if route_src and not ipaddress.ip_address(route_src).is_unspecified:
        return route_src
    return LOOPBACK


def loopback_refusal(advertised: list[str], remote_ip: str) -> str | None:
    """Why a registration must be refused, or None: a node that connects from another machine but advertises
    a loopback address (for its agent or its peer port) cannot be reached by the master's probes or its peers.
    advertised: the hosts it gave; remote_ip: where its connection comes from."""
    if not remote_ip or remote_ip == "?" or is_loopback(remote_ip):
        return None
    bad = [a for a in advertised if a and is_loopback(a)]
    if not bad:
        return None
    return (f"this node connects from {remote_ip} but advertises the loopback address {bad[0]}: the master and "
            f"the other nodes cannot reach it there. Start it with --host (agent) or --local-addr (launcher) set "
            f"to an address they reach it at, e.g. --host {remote_ip}, or leave the flag unset: the default is the "
            f"address that routes to the master")


def interface_for(addr: str, if_addrs: dict[str, list[str]]) -> str | None:
    """The network interface gloo must bind to (GLOO_SOCKET_IFNAME) for a node at addr, from {interface:
    [addresses]}. None - gloo keeps its own choice - for a loopback address (a single-machine job: gloo's choice
    is loopback already; in one run with `lo` forced, three fault-matrix tests had every rank stall over 4 s
    after a recovery, cause not established) and for an address no interface holds (a name, say)."""
    if is_loopback(addr):
        return None
    for name, addrs in sorted(if_addrs.items()):
        if addr in addrs:
            return name
    return None


# ---------------------------------------------------------------- the system's side
def route_source(host: str, port: int | None = None) -> str | None:
    """The local address the kernel would use to reach host (a UDP connect sends nothing); None: no route or
    the name does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                local: str = s.getsockname()[0]
                return local
        except OSError:
            continue
    return None


def interfaces() -> dict[str, list[str]]:
    """{interface name: its IPv4/IPv6 addresses} of this machine (network namespace)."""
    import psutil
    return {name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def node_addr(explicit: str | None, endpoint: str) -> str:
    """choose_node_addr with this machine's route to the endpoint."""
    host, port = split_host_port(endpoint)
    return choose_node_addr(explicit, host, None if explicit or is_loopback(host) else route_source(host, port))


def is_this_host(host: str) -> bool:
    """Does `host` name this machine (torchrun's test for the rendezvous host: the node that runs the master)?"""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs & {a for nic in interfaces().values() for a in nic})


def port_free(host: str, port: int) -> bool:
    """Can this process listen on host:port now? (On a cluster several processes on the rendezvous host may
    try to run the master: the first to take the port does.)"""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
