"""Address decisions as pure functions: what a node advertises, what the master refuses, where gloo binds."""
import pytest

from phoenixrun import netaddr


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.0.1.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("10.0.0.2", False), ("0.0.0.0", False), ("fe80::1", False), ("node7.cluster", False), ("", False),
])
def test_is_loopback(host, expected):
    assert netaddr.is_loopback(host) is expected


@pytest.mark.parametrize("endpoint,expected", [
    ("10.0.0.1:29500", ("10.0.0.1", 29500)), ("master:1", ("master", 1)), ("[fd00::1]:80", ("fd00::1", 80)),
    ("master", ("master", None)), ("fd00::1", ("fd00::1", None)),
])
def test_split_host_port(endpoint, expected):
    assert netaddr.split_host_port(endpoint) == expected


@pytest.mark.parametrize("explicit,endpoint_host,route_src,expected", [
    ("10.9.9.9", "10.0.0.1", "10.0.0.2", "10.9.9.9"),   # the user's choice wins
    (None, "127.0.0.1", "127.0.0.1", "127.0.0.1"),       # master on this machine: a single-machine job
    (None, "localhost", None, "127.0.0.1"),
    (None, "10.0.0.1", "10.0.0.2", "10.0.0.2"),          # the address the route to the master leaves from
    (None, "master.cluster", "192.168.1.5", "192.168.1.5"),   # /etc/hosts mapping our name to 127.0.0.1: irrelevant
    (None, "10.0.0.1", None, "127.0.0.1"),               # no route: loopback, which a remote master refuses clearly
    (None, "10.0.0.1", "0.0.0.0", "127.0.0.1"),
])
def test_choose_node_addr(explicit, endpoint_host, route_src, expected):
    assert netaddr.choose_node_addr(explicit, endpoint_host, route_src) == expected


@pytest.mark.parametrize("advertised,remote,refused", [
    (["127.0.0.1", "127.0.0.1"], "127.0.0.1", False),     # same machine: loopback is fine
    (["127.0.0.1", "127.0.0.1"], "10.0.0.2", True),       # another machine advertising loopback
    (["10.0.0.2", "127.0.0.1"], "10.0.0.2", True),        # its peer port on loopback
    (["localhost", "10.0.0.2"], "10.0.0.2", True),
    (["10.0.0.2", "10.0.0.2"], "10.0.0.2", False),
    (["10.0.0.3", "10.0.0.3"], "10.0.0.2", False),        # behind NAT or multi-homed: not ours to judge
    (["127.0.0.1", "127.0.0.1"], "?", False),             # transport could not tell
])
def test_loopback_refusal(advertised, remote, refused):
    why = netaddr.loopback_refusal(advertised, remote)
    assert (why is not None) is refused
    if refused:
        assert remote in why and "--host" in why and "loopback" in why


@pytest.mark.parametrize("addr,expected", [
    ("10.0.0.2", "eth0"), ("fd00::2", "eth1"), ("10.9.9.9", None), ("node7", None),
    ("127.0.0.1", None),      # single machine: gloo's own choice (loopback) stands
])
def test_interface_for(addr, expected):
    ifs = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.2"], "eth1": ["192.168.0.2", "fd00::2"]}
    assert netaddr.interface_for(addr, ifs) == expected


def test_route_source_of_this_machine():
    assert netaddr.route_source("127.0.0.1") == "127.0.0.1"
    assert netaddr.route_source("no-such-host.invalid") is None
    assert "lo" in netaddr.interfaces() and "127.0.0.1" in netaddr.interfaces()["lo"]


def test_this_host_and_a_free_port_are_told_apart():
    import socket
    assert netaddr.is_this_host("127.0.0.1") and netaddr.is_this_host("localhost")
    assert not netaddr.is_this_host("192.0.2.1")          # TEST-NET-1: never an address of this machine
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not netaddr.port_free("127.0.0.1", s.getsockname()[1])
