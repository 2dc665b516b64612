"""What an abortable wait costs a collective (phoenixrun/runtime/abortable.py): two processes over gloo, each round
timing `--small` one-float and `--large` 64K-float all-reduces issued raw and the same wrapped in an AbortableWork
(waited in POLL_S ticks, as the runtime waits), the two arms alternated round by round in one run. Prints the
median per-op time of each arm and their ratio, and checks the two arms' sums agree bit for bit.

    python benchmarks/abortable_overhead.py --rounds 6 --small 2000 --large 500 --json FILE
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phoenixrun.runtime.abortable import InFlight


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time(pg: Any, n: int, numel: int, flight: InFlight | None) -> tuple[float, torch.Tensor]:
    """Seconds per op over n all-reduces of numel floats, and the last result (each op sums fresh values: in place,
    repeated sums of the same tensor would overflow to inf, which compares equal whatever the arms did)."""
    t = torch.empty(numel)
    dist.barrier(group=pg)
    t0 = time.perf_counter()
    for i in range(n):
        t.fill_(float(i % 7 + dist.get_rank(pg)) / 3)
        work = pg.allreduce([t])
        (flight.track(work) if flight is not None else work).wait()
    return (time.perf_counter() - t0) / n, t


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    pg = dist.distributed_c10d._get_default_group()
    flight = InFlight(0)
    rows: dict[str, list[float]] = {"small_raw": [], "small_wrapped": [], "large_raw": [], "large_wrapped": []}
    same = True
    for r in range(args.rounds):
        arms = [None, flight] if r % 2 == 0 else [flight, None]      # alternated: neither arm always goes first
        for size, n, numel in (("small", args.small, 1), ("large", args.large, 65536)):
            got = {}
            for arm in arms:
                name = f"{size}_{'raw' if arm is None else 'wrapped'}"
                per_op, result = _time(pg, n, numel, arm)
                rows[name].append(per_op)
                got[name] = result
            same = same and torch.equal(got[f"{size}_raw"], got[f"{size}_wrapped"])
    if rank == 0:
        out.put({"rows": rows, "bit_identical": same})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds (each times both arms)")
    ap.add_argument("--small", type=int, default=2000, help="one-float all-reduces per arm and round")
    ap.add_argument("--large", type=int, default=500, help="64K-float all-reduces per arm and round")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.small < 1 or args.large < 1:
        ap.error("--rounds, --small and --large must be at least 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=600)
    for p in procs:
        p.join(60)
    if any(p.exitcode != 0 for p in procs):
        print(f"abortable_overhead: a worker failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    med = {k: statistics.median(v) for k, v in got["rows"].items()}
    result = {"rounds": args.rounds, "small_ops": args.small, "large_ops": args.large,
              "median_us": {k: round(v * 1e6, 1) for k, v in med.items()},
              "ratio_small": round(med["small_wrapped"] / med["small_raw"], 3),
              "ratio_large": round(med["large_wrapped"] / med["large_raw"], 3),
              "bit_identical": got["bit_identical"], "per_round_s": got["rows"]}
    m = result["median_us"]
    print(f"one-float all-reduce: {m['small_wrapped']:.0f} us wrapped vs {m['small_raw']:.0f} us raw "
          f"(x{result['ratio_small']}); 64K floats: {m['large_wrapped']:.0f} vs {m['large_raw']:.0f} us "
          f"(x{result['ratio_large']}); results bit-identical: {got['bit_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if got["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
