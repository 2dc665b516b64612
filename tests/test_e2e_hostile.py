"""End to end: an authenticated caller sends the master the malformed and forged messages of issue 20 while a
real job runs; each is refused (4xx), and the job finishes bit-identical to a fault-free torchrun run."""
import json
import socket

import pytest

from phoenixrun import auth
from tests.harness import assert_identical, launch, torchrun

STEPS = 40
pytestmark = pytest.mark.e2e


def _post(endpoint: str, secret: str, path: str, body) -> tuple[int, dict]:
    host, port = endpoint.rsplit(":", 1)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer {secret}\r\n"
                   f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, rest = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(rest)


@pytest.mark.smoke
def test_malformed_and_forged_messages_are_refused_while_the_job_finishes_bit_identical(tmp_path):
    ref = torchrun(tmp_path, "ref", nproc=2, steps=STEPS)
    job = launch(tmp_path, "hostile", nnodes=2, nproc=1, steps=STEPS)
    state = job.wait_step(3)
    endpoint, secret = state["endpoint"], auth.read_secret(run_dir=job.run_dir)
    ids = {n["slot"]: n["node_id"] for n in state["nodes"] if n["role"] == "active"}
    live = next(n for n in state["nodes"] if n["slot"] == 0)
    gen = state["generation"]
    cases = [
        ("/v1/report", {"node_id": ids[0], "kind": "worker_exit", "rank": 0, "returncode": "abc", "generation": gen}),
        ("/v1/report", {"node_id": ids[0], "kind": "worker_exit", "rank": 0, "returncode": 1, "t": "abc"}),
        ("/v1/register", {"node_id": "intruder", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                          "rejoin": {"role": "active", "slot": 7, "generation": gen}}),
        ("/v1/register", {"node_id": "intruder", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                          "rejoin": {"role": "active", "slot": "abc", "generation": gen}}),
        ("/v1/register", {"node_id": "intruder", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                          "rejoin": {"role": "active", "slot": 1, "generation": 1e12}}),
        ("/v1/register", {"node_id": "intruder", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                          "rejoin": {"role": "active", "slot": 1, "generation": gen + 1}}),
        ("/v1/register", {"node_id": live["node_id"], "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9"}),
        # issue 31: a live node's registration as /v1/state shows it (its token was handed out), and a forged rejoin
        # on a master that never restarted (it was answered 200)
        ("/v1/register", {k: live[k] for k in ("node_id", "host", "agent_pid", "peer_addr", "fault_domain")}),
        ("/v1/register", {"node_id": "intruder", "host": "127.0.0.1", "agent_pid": 1, "peer_addr": "127.0.0.1:9",
                          "rejoin": {"role": "spare", "slot": None, "generation": 2 ** 31 - 1}}),
        ("/v1/inject", {"slot": 0, "fault": "xid:abc"}),
        *[("/v1/report", {"node_id": nid, "kind": "workers_done", "generation": gen, "slot": s})
          for s, nid in ids.items()],
        ("/v1/heartbeat", {"node_id": ids[1], "snapshots": {"0": "abc"}}),
        ("/v1/directive", {"node_id": ids[0], "version": 1e30, "timeout": 30}),
        ("/v1/report", {"node_id": ids[1], "kind": "comm_error", "rank": 1, "generation": 0, "text": "replayed"}),
    ]
    for path, body in cases:
        code, reply = _post(endpoint, secret, path, body)
        assert 400 <= code < 500 and reply.get("error"), (path, body, code, reply)
    after = job.current()
    assert after["generation"] == gen and after["rejected_requests"]["total"] >= len(cases)
    assert sorted((n["slot"], n["node_id"]) for n in after["nodes"]) == sorted(
        (n["slot"], n["node_id"]) for n in state["nodes"])
    assert job.finish() == 0, job.log()[-3000:]
    ev = job.events()
    assert not [e for e in ev if e["event"] in ("fault_detected", "fault_injected", "recovery_started")]
    assert_identical(job.out, ref)
