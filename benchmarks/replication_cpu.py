"""CPU one replica costs its sender and its holder: real agents' peer transport over loopback, in two processes.

A holder process runs the agents' PeerServer with a ReplicaStore behind it (as agents/agent.py builds it); this
process sends the same rank's replica to it `--puts` times from a shared-memory slot, as the replicator does
(PeerClient.call from a memoryview of the mapped file, no copy), and reads both processes' CPU time (user + system,
getrusage) around the puts. Two arms, alternated in rounds: the holder receiving each replica into a new buffer
(the agents before c40c913) and into the store's reused buffer (`ReplicaStore.receive_buffer`). The replica is a
sealed slot prefix of --mb megabytes (default: d256's 4.3 MB per rank and step); the holder checks its checksum
on every put, as it always does.

    python benchmarks/replication_cpu.py [--mb 4.3] [--puts 200] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from phoenixrun.agents.peer import PeerClient, PeerServer  # noqa: E402
from phoenixrun.agents.slots import ReplicaStore  # noqa: E402
from phoenixrun.slot_format import SlotHeader, crc_private  # noqa: E402

SECRET = "bench"


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def holder(reused: bool, port_out, stop) -> None:
    store = ReplicaStore()

    def put(h: dict, payload: bytearray) -> tuple[dict, bytes]:
        store.put(int(h["rank"]), int(h["step"]), payload)
        return {}, b""
    sinks = {"put": lambda h, n: store.receive_buffer(int(h["rank"]), n)} if reused else None
    server = PeerServer("127.0.0.1", SECRET, {"put": put, "cpu": lambda h, p: ({"cpu": cpu_s()}, b"")}, sinks=sinks)
    port_out.put(server.port)
    stop.wait()


def replica_file(nbytes: int) -> tuple[Path, int]:
    """A sealed slot prefix of about `nbytes` (random private state) in a shared-memory file."""
    h = SlotHeader(1, 4096, 2, nbytes, 0)
    path = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)) / "replica"
    buf = bytearray(h.replicated_len)
    buf[64:66] = b"{}"
    buf[h.private_off:] = os.urandom(nbytes)
    buf[:64] = SlotHeader(1, 4096, 2, nbytes, 0, crc_private(buf, h), 0).pack()
    path.write_bytes(buf)
    return path, h.replicated_len


def run_arm(reused: bool, data: memoryview, puts: int) -> dict:
    ctx = mp.get_context("spawn")
    port, stop = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=holder, args=(reused, port, stop), daemon=True)
    p.start()
    addr = f"127.0.0.1:{port.get(timeout=60)}"
    client = PeerClient(SECRET)
    try:
        for step in (1, 1):   # warm: the connection, and (reused) the store's two buffers
            client.call(addr, {"op": "put", "rank": 0, "step": step}, data)
        h0, s0, t0 = client.call(addr, {"op": "cpu"})[0]["cpu"], cpu_s(), time.perf_counter()
        for _ in range(puts):
            client.call(addr, {"op": "put", "rank": 0, "step": 1}, data)
        t1, s1, h1 = time.perf_counter(), cpu_s(), client.call(addr, {"op": "cpu"})[0]["cpu"]
    finally:
        client.drop_all()
        stop.set()
        p.join(timeout=30)
    return {"wall_ms": 1e3 * (t1 - t0) / puts, "sender_cpu_ms": 1e3 * (s1 - s0) / puts,
            "holder_cpu_ms": 1e3 * (h1 - h0) / puts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=4.3, help="replica size, MB (d256: 4.3 per rank and step)")
    ap.add_argument("--puts", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    path, n = replica_file(int(a.mb * 1e6))
    arms: dict[str, list[dict]] = {"new buffer": [], "reused buffer": []}
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), n, prot=mmap.PROT_READ) as mm:
            data = memoryview(mm)
            for i in range(a.rounds):
                for name in (list(arms) if i % 2 == 0 else list(reversed(arms))):
                    arms[name].append(run_arm(name == "reused buffer", data, a.puts))
            data.release()
    finally:
        path.unlink()
        path.parent.rmdir()
    out = {"replica_bytes": n, "puts": a.puts, "rounds": a.rounds, "load_average_1min": round(os.getloadavg()[0], 1),
           "arms": {name: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
                    for name, runs in arms.items()}}
    for name, r in out["arms"].items():
        print(f"{n / 1e6:.1f} MB replica, holder receives into a {name}: sender {r['sender_cpu_ms']:.2f} ms CPU, "
              f"holder {r['holder_cpu_ms']:.2f} ms CPU, {r['wall_ms']:.2f} ms wall per put (median of {a.rounds} "
              f"rounds x {a.puts} puts)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
