"""protocol/peer_requests.py: what agents ask each other over the peer port are types - each round-trips through
its frame header, and a header that is not one is refused naming the field, by a real peer server that then
goes on serving."""
from __future__ import annotations

import json

import pytest

from phoenixrun.agents.peer import PeerClient, PeerError, PeerServer
from phoenixrun.protocol import PeerOp
from phoenixrun.protocol.peer_requests import Ping, RelayPoll, RelayReply, SlotRequest


def _through_json(h):
    return json.loads(json.dumps(h))


@pytest.mark.parametrize("req", [SlotRequest(PeerOp.PUT, 0, 5), SlotRequest(PeerOp.GET_SHARED, 3, 0),
                                 RelayPoll("n1", "k" * 64, -1), RelayPoll("n2", "k", 7, 0.5)])
def test_a_request_decodes_to_what_the_asking_agent_built(req):
    assert type(req).from_header(_through_json(req.to_header())) == req


@pytest.mark.parametrize("reply", [RelayReply(), RelayReply(12, "ab" * 32)])
def test_a_relay_reply_decodes_to_what_the_relay_built(reply):
    assert RelayReply.from_header(_through_json(reply.to_header())) == reply


@pytest.mark.parametrize("cls, header, named", [
    (SlotRequest, {"op": "put", "step": 1}, "rank"),
    (SlotRequest, {"op": "put", "rank": "0", "step": 1}, "rank"),
    (SlotRequest, {"op": "put", "rank": 0, "step": -1}, "step"),
    (SlotRequest, {"op": "teleport", "rank": 0, "step": 1}, "op"),
    (RelayPoll, {"op": "directive", "node_id": "n", "key": "k", "version": 1.5}, "version"),
    (RelayPoll, {"op": "directive", "node_id": "n", "version": 1}, "key"),
    (RelayPoll, {"op": "directive", "node_id": "n", "key": "k", "version": 1, "timeout": "x"}, "timeout"),
    (RelayReply, {"mac": "m"}, "version"),
])
def test_a_header_that_is_not_a_request_is_refused_by_name(cls, header, named):
    with pytest.raises(ValueError, match=named):
        cls.from_header(header)


def test_a_peer_server_refuses_a_malformed_request_and_goes_on():
    got: list[SlotRequest] = []

    def get(h, payload):
        got.append(SlotRequest.from_header(h))
        return {}, b"state"

    class Raw:                       # a header no agent of this version builds (another version's, or a stranger's)
        def to_header(self):
            return {"op": PeerOp.GET_SHARED.value, "rank": "zero", "step": 1}

    peer = PeerServer("127.0.0.1", "s", {PeerOp.GET_SHARED: get, Ping.OP: lambda h, p: ({"pong": True}, b"")})
    try:
        client = PeerClient("s")
        with pytest.raises(PeerError, match="rank must be an integer"):
            client.call(peer.addr, Raw())
        assert client.call(peer.addr, SlotRequest(PeerOp.GET_SHARED, 1, 4))[1] == b"state"
        assert client.call(peer.addr, Ping())[0]["pong"]
        assert got == [SlotRequest(PeerOp.GET_SHARED, 1, 4)]
    finally:
        peer.close()
