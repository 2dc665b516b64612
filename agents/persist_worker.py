"""The agent's checkpoint I/O process: DCP writes and reads of slot images, out of the agent's process.

Importing torch.distributed.checkpoint and serialising tensors hold the GIL for seconds on a busy
node; in the agent that would starve its heartbeat thread into a false "node lost". So the agent
hands images over in /dev/shm files and this process does the disk work. Protocol: one request per line
on stdin, one answer per line on stdout (protocol/persist_io.py: a write, then the old checkpoints pruned; a
read into a file). Errors come back as a `Failed` answer; the process keeps serving.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import sys
from pathlib import Path
from typing import Iterable, TextIO

from phoenixrun import persist
from phoenixrun.protocol import persist_io as pio


def serve(root: Path, world_size: int, keep: int, inp: Iterable[str] = sys.stdin,
          out: TextIO = sys.stdout) -> None:
    import torch.distributed.checkpoint  # noqa: F401 - pay the import once, before the first request
    out.write(json.dumps(pio.Ready().to_wire()) + "\n")
    out.flush()
    for line in inp:
        reply: pio.Answer
        try:
            reply = _handle(pio.decode_request(json.loads(line)), root, world_size, keep)
        except (persist.CheckpointError, OSError, ValueError) as e:
            reply = pio.Failed(str(e))
        except Exception as e:  # noqa: BLE001 - DCP wraps I/O failures in its own exception types
            reply = pio.Failed(f"{type(e).__name__}: {e}")
        out.write(json.dumps(reply.to_wire()) + "\n")
        out.flush()


def _handle(req: pio.Request, root: Path, world_size: int, keep: int) -> pio.Done:
    if isinstance(req, pio.WriteImage):
        path = Path(req.image)
        try:
            with open(path, "rb") as f:   # copy-on-write map: tensors view it, nothing is copied
                image = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        finally:
            path.unlink(missing_ok=True)
        step = persist.parse_image(image)[0].step
        persist.write_rank(root, req.rank, image)
        return pio.Done(step, tuple(persist.prune(root, world_size, keep)))
    data = persist.read_rank(root, req.step, req.rank)
    tmp = Path(req.out + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, req.out)
    return pio.Done(req.step)


if __name__ == "__main__":
    # the agent decides when this ends (stdin closes): a SIGTERM sent to the whole node must not
    # cut short the checkpoint the agent is writing because of that same SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(10)   # background work: on a busy node it yields the CPU to the training processes
    serve(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
