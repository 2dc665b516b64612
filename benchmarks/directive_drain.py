"""What one broadcast costs the master per node, with nothing else going on.

A Master and its ControlServer in this process, N registered nodes, N client sockets each with a
directive long-poll parked; then one `quiesce` broadcast, timed from the order until the master has
sent it to every connection (its `directive_sent` bookkeeping), and split into the master's
directive lookup and the response write. The clients only park their polls (they never read), so
this is the master's own cost, the loopback send included.

    python benchmarks/directive_drain.py [--nodes 8000]
"""
from __future__ import annotations

import argparse
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from phoenixrun.control import server as control_server
from phoenixrun.config import MasterConfig
from phoenixrun.control.master import Master
from phoenixrun.control.server import ControlServer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8000)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if 2 * args.nodes + 64 > hard:
        p.error(f"--nodes {args.nodes} needs {2 * args.nodes + 64} open files; this machine allows {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    with tempfile.TemporaryDirectory(prefix="phoenixrun-drain-") as tmp:
        m = Master(MasterConfig.build(run_dir=Path(tmp), nnodes=args.nodes, nproc_per_node=4), "secret")
        m.store_port = 1                      # no TCPStore: nothing here rendezvouses
        srv = ControlServer(m, "127.0.0.1", 0)
        m.orders.wake = srv.wake
        srv.start()
        ids = [f"n{i}" for i in range(args.nodes)]
        tokens = {nid: m.register({"node_id": nid, "host": "127.0.0.1", "agent_pid": 0,
                                   "peer_addr": "127.0.0.1:1"})["token"] for nid in ids}
        clients = []
        for nid in ids:
            c = socket.create_connection(srv.server_address)
            body = json.dumps({"node_id": nid, "token": tokens[nid], "version": 0, "timeout": 30}).encode()
            c.sendall(b"POST /v1/directive HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer secret\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            clients.append(c)
        deadline = time.time() + 60
        while srv.parked_polls() < args.nodes:
            if time.time() > deadline:
                print("error: the polls did not all park within 60 s", file=sys.stderr)
                return 1
            time.sleep(0.01)

        lookup, write = [0.0], [0.0]      # time in the master's lookup and in the response write
        answer_polls, send_response = m.answer_polls, control_server.Connection.send_response

        def timed_answer(payloads):
            t0 = time.perf_counter()
            try:
                return answer_polls(payloads)
            finally:
                lookup[0] += time.perf_counter() - t0

        def timed_send(conn, response):
            t0 = time.perf_counter()
            try:
                return send_response(conn, response)
            finally:
                write[0] += time.perf_counter() - t0
        m.answer_polls = timed_answer
        control_server.Connection.send_response = timed_send

        sent = threading.Event()
        m.directives.on_sent = lambda rollout, t: sent.set()   # the broadcast reached every connection
        t0 = time.perf_counter()
        with m.cv:
            m.orders.direct(ids, command="quiesce")
        if not sent.wait(60):
            print("error: the broadcast was not sent to every poll within 60 s", file=sys.stderr)
            return 1
        took = time.perf_counter() - t0
        control_server.Connection.send_response = send_response
        srv.shutdown()
        m.events.close()
        for c in clients:
            c.close()
    n = args.nodes
    print(f"one broadcast to {n} parked polls: sent to all in {took:.3f} s ({1e6 * took / n:.1f} us per node: "
          f"lookup {1e6 * lookup[0] / n:.1f} us, response write {1e6 * write[0] / n:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
