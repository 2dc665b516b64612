"""Run: python benchmarks/hostile_memory.py.
RSS growth of one process hosting a real Master and a PeerServer under oversized claims from unauthenticated
connections (what tests/test_control_fuzz.py bounds), printed per part."""
import json, socket, struct, tempfile, time
from pathlib import Path
import psutil
from phoenixrun import auth
from phoenixrun.agents.peer import PeerServer
from phoenixrun.config import MasterConfig
from phoenixrun.control.master import Master

def rss(): return psutil.Process().memory_info().rss >> 20
def send(s, d):
    try: s.sendall(d)
    except OSError: pass
def drain(socks):
    for s in socks:
        s.settimeout(15)
        try:
            while s.recv(65536): pass
        except OSError: pass

secret = auth.new_secret()
tmp = Path(tempfile.mkdtemp())
m = Master(MasterConfig.build(run_dir=tmp, nnodes=2, nproc_per_node=1), secret); m.start()
peer = PeerServer("127.0.0.1", secret, {"ping": lambda h, p: ({}, b"")})
host, port = peer.addr.rsplit(":", 1)
r0 = rss()
socks = []
for _ in range(3):
    s = socket.create_connection((host, int(port))); h = json.dumps({"op": "put", "auth": "wrong", "nbytes": 1 << 30}).encode()
    send(s, struct.pack("!I", len(h)) + h + b"x" * (1 << 20)); socks.append(s)
drain(socks); r1 = rss()
print(f"peer: 3 unauthenticated connections claiming 1 GiB payloads: RSS {r0} -> {r1} MB")
mh, mp = m.endpoint.rsplit(":", 1); socks = []
for i in range(60):
    s = socket.create_connection((mh, int(mp)))
    send(s, f"POST /v1/heartbeat HTTP/1.1\r\nHost: m\r\nContent-Length: {16 << 20}\r\n\r\n".encode() + b"x" * (16 << 20)); socks.append(s)
drain(socks); r2 = rss()
print(f"master: 60 unauthenticated connections sending 16 MiB bodies: RSS {r1} -> {r2} MB")
socks = [socket.create_connection((mh, int(mp))) for _ in range(2000)]
for s in socks: send(s, b"POST /v1/heartbeat HTTP/1.1\r\nHost: m\r\n")   # slowloris: never completes the head
r3 = rss(); t = time.time(); drain(socks); r4 = rss()
print(f"master: 2,000 slowloris connections: RSS {r2} -> {r3} MB while held, all closed by the master after {time.time() - t:.1f} s, RSS {r4} MB after")
print("state rejected_requests:", m.state()["rejected_requests"], "rejected_request events:",
      sum(1 for l in open(tmp / "events.jsonl") if '"rejected_request"' in l))
