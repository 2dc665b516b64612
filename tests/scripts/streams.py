"""Writes to both streams like a real script (tests of worker output and stdin under phoenixrun)."""
import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"out-line rank {rank}", flush=True)
print(f"err-line rank {rank}", file=sys.stderr, flush=True)
if rank == 0:
    line = sys.stdin.readline().strip()
    print(f"got {line!r} from stdin", flush=True)
    sys.stdout.write("partial-no-newline")
    sys.stdout.flush()
dist.barrier()
dist.destroy_process_group()
if rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    raise RuntimeError("boom from rank 0")
