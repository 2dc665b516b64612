"""The agent's replicator: seals and commits each local snapshot after replicating its private part
(optimizer shard + metadata + RNG) to the holders the master placed (`topology.place_replicas`), serves peers'
replicas and restore reads (`agents/peer.py`), and fetches the snapshots a restore plan names from peers."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping, TypeVar

from phoenixrun.protocol import PeerOp, reports
from phoenixrun.protocol import worker_orders as wo
from phoenixrun.protocol.figures import Figures
from phoenixrun.protocol.peer_requests import SlotRequest
from phoenixrun.protocol.restore import Part, RankSource, Refusal
from phoenixrun.protocol.directives import World
from phoenixrun.protocol.timings import Timings
from phoenixrun.slot_format import HEADER_SIZE, SlotHeader, crc_shared
from phoenixrun.testing import corrupt_point, pause_point
from phoenixrun.agents.ipc import WorkerConn
from phoenixrun.agents.node import NodeState
from phoenixrun.agents.peer import Handler, Payload, PeerBusy, PeerClient, PeerError, Sink
from phoenixrun.agents.reporter import Reporter
from phoenixrun.agents.slots import (IntegrityError, LocalSlots, Params, Replica, ReplicaStore, SlotError,
                                     verify_params, verify_replica)

log = logging.getLogger("phoenixrun.agent")

# how long a put waits for a holder frozen by a recovery to thaw: the resume reaches every node within the
# recovery's broadcasts (under 1 s at 16K nodes: docs/benchmarks.md); a holder frozen for longer is in a new
# recovery, which freezes this node too and ends the wait
BUSY_WAIT_S = 5.0

T = TypeVar("T")


def holders_of(world: World, rank: int) -> list[int]:
    """The node slots holding `rank`'s replica in the master's world map. Pure."""
    return world.holders(rank)


def peer_addr_of(world: World, slot: int) -> str | None:
    """The peer address of node slot `slot` in the master's world map. Pure."""
    return world.slots.get(slot)


class Replicator:
    def __init__(self, node: NodeState, slots: LocalSlots, replicas: ReplicaStore, peers: PeerClient,
                 reporter: Reporter) -> None:
        self.node, self.slots, self.replicas, self.peers, self.reporter = node, slots, replicas, peers, reporter

    def freeze(self, frozen: bool) -> None:
        """During a recovery no snapshot is written and no replica taken: the restore reads them."""
        self.slots.frozen = self.replicas.frozen = frozen

    # ------------------------------------------------------------------ local snapshots
    def commit(self, conn: WorkerConn, idx: int, step: int, stats: Figures) -> None:
        """Seal the local slot, replicate its private part to the holders, then commit."""
        # a worker's hello, its first message (runtime/api.py), set its local rank before it wrote any snapshot
        assert conn.local_rank is not None, "a snapshot written before the worker's hello"
        rank = self.node.rank(conn.local_rank)
        t0 = time.time()
        try:
            h = self.slots.finish_write(rank, idx, step)
            holders = holders_of(self.node.world, rank)
            if holders:
                data = memoryview(self.slots.view(rank, idx))[:h.replicated_len]   # no copy: sent from shm
                for holder in holders:
                    addr = peer_addr_of(self.node.world, holder)
                    if addr is None:   # a slot the world map names no node for (vacant): as if it were unreachable
                        raise PeerError(f"replica holder slot {holder} of rank {rank} has no known address")
                    self._put(addr, rank, step, data)
            self.slots.commit(rank, idx, step)
        except (PeerError, SlotError) as e:
            conn.send(wo.CommitFailed(step=step, error=str(e)))
            if not self.slots.frozen:
                self.reporter.report(reports.CommError(rank=rank, text=f"replication failed: {e}", step=step,
                                                          t=time.time()))
            return
        h2h = time.time() - t0
        replicated = h.replicated_len if holders else 0
        conn.send(wo.Committed(step=step, h2h_s=round(h2h, 6), replicated_bytes=replicated))
        if self.node.persister is not None:
            self.node.persister.offer(rank, step)
        with self.node.lock:
            self.node.protection[rank] = stats.committed(step, round(h2h, 5), replicated, self.replicas.nbytes())

    def _put(self, addr: str, rank: int, step: int, data: Payload) -> None:
        """Send one replica. A holder still frozen by a recovery this node has already resumed from (the resume
        reaches nodes one by one) answers busy: tried again until it thaws. Reported as a fault, that passing
        state started a needless local reset right after a recovery (seen in tests/test_e2e_persistence.py).
        Stops once this node is frozen itself (a new recovery: the commit fails quietly) or after BUSY_WAIT_S."""
        deadline, pause = time.monotonic() + BUSY_WAIT_S, 0.005
        while True:
            try:
                self.peers.call(addr, SlotRequest(PeerOp.PUT, rank, step), data)
                return
            except PeerBusy:
                if self.slots.frozen or time.monotonic() > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.1)

    def restore_point(self, step: int) -> None:
        """Every local rank and every replica held goes back to `step`; later snapshots are dropped."""
        for lr in self.node.local_ranks():
            self.slots.restore_point(self.node.rank(lr), step)
        self.replicas.restore_point(step)

    # ------------------------------------------------------------------ restore fetches
    def fetch(self, plan: Mapping[int, RankSource], step: int) -> Timings:
        """Install the snapshots of step `step` that the restore plan says to fetch from peers (rank -> its
        RankSource); their timings. Each part is taken from the first of its options whose bytes pass
        the lost rank's own checksum; every option refused on the way is reported (`restore_refused`). Ranks that
        recorded the same parameters (same length and checksum: the DDP ranks of one node) take them from one
        fetch. Raises IntegrityError when every option of a part held other bytes, PeerError or SlotError when
        some could not be reached or had no such snapshot (the master plans again: a dead source is then known)."""
        if not plan:
            return Timings()
        t0 = time.time()
        pause_point("fetch", step)   # tests: a spare that dies while restoring
        replicas = {rank: self._first(rank, Part.PRIVATE, [(a, rank) for a in src.private], self._replica_of(step))
                    for rank, src in plan.items()}
        t1 = time.time()
        fetched: list[Params] = []
        install_s = 0.0
        for rank, src in plan.items():
            replica = replicas[rank]
            params = next((p for p in fetched if p.fits(replica)), None)
            if params is None:
                params = self._first(rank, Part.SHARED, list(src.shared), self._params_for(replica))
                fetched.append(params)
            t2 = time.time()
            self.slots.install_replica(replica, params)
            install_s += time.time() - t2
        return Timings(fetch_s=time.time() - t0, params_fetch_s=time.time() - t1 - install_s, install_s=install_s)

    def _replica_of(self, step: int) -> Callable[[str, int], Replica]:
        return lambda addr, rank: verify_replica(rank, bytes(self._get(addr, PeerOp.GET_PRIVATE, rank, step)), step)

    def _params_for(self, replica: Replica) -> Callable[[str, int], Params]:
        return lambda addr, peer: verify_params(replica, bytes(self._get(addr, PeerOp.GET_SHARED, peer,
                                                                         replica.step)))

    def fill(self, ranks: Iterable[int]) -> None:
        """After a fetch (its workers restore meanwhile): each fetched rank's second slot grown to size."""
        for rank in ranks:
            self.slots.fill(rank)

    def _get(self, addr: str, op: PeerOp, rank: int, step: int) -> bytearray:
        return self.peers.call(addr, SlotRequest(op, rank, step))[1]

    def _first(self, rank: int, part: Part, options: list[tuple[str, int]], take: Callable[[str, int], T]) -> T:
        """take(addr, source_rank) for each option in order until one succeeds; each failure is logged and
        reported as a refusal. All failed: IntegrityError if every one held bad bytes, else PeerError or
        SlotError (one was unreachable or lacked the step: the master plans again)."""
        refusals: list[Refusal] = []
        other: Exception | None = None      # the last failure that was not bad bytes
        for addr, source in options:
            try:
                return take(addr, source)
            except (PeerError, SlotError, OSError) as e:
                integrity = isinstance(e, IntegrityError)
                other = other if integrity else e
                r = Refusal(rank=rank, part=part, addr=addr, source_rank=source, reason=str(e), integrity=integrity)
                refusals.append(r)
                log.warning("restore of rank %d: %s part from %s (rank %d) refused: %s", rank, part.value, addr,
                            source, e)
                self.reporter.report(r.to_report())
        if not refusals:
            raise SlotError(f"rank {rank}: the restore plan names no source of its {part.value} state")
        why = "; ".join(f"{r.addr} (rank {r.source_rank}): {r.reason}" for r in refusals)
        if other is None:
            raise IntegrityError(f"rank {rank}: every source of its {part.value} state was refused: {why}")
        # some source was unreachable or lacked the step (not only bad bytes): planning again may find others
        cls = PeerError if isinstance(other, (PeerError, OSError)) else SlotError
        raise cls(f"rank {rank}: no source of its {part.value} state could be used: {why}") from None

    # ------------------------------------------------------------------ peer requests
    def peer_handlers(self) -> dict[str, Handler]:
        """The peer server's operations (agents/peer.py)."""
        return {PeerOp.PUT: self._peer_put, PeerOp.GET_PRIVATE: self._peer_get_private,
                PeerOp.GET_SHARED: self._peer_get_shared}

    def peer_sinks(self) -> dict[str, Sink]:
        """Where the peer server receives a put's payload: into the replica store's buffer for it."""
        return {PeerOp.PUT: lambda h, n: self.replicas.receive_buffer(SlotRequest.from_header(h).rank, n)}

    def _peer_put(self, h: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        req = SlotRequest.from_header(h)
        self.replicas.put(req.rank, req.step, payload)
        return {}, b""

    def _peer_get_private(self, h: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        req = SlotRequest.from_header(h)
        rank, step = req.rank, req.step
        idx = self.slots.slot_of(rank, step)
        if idx is None:
            # tests: a holder whose copy went bad (its first metadata byte, always under the checksum)
            return {}, corrupt_point("get_private", self.replicas.get(rank, step), HEADER_SIZE)
        # a rank of this node (a drain: the spare takes its state from here): the replicated prefix of its own
        # committed slot, as a holder would send it (the spare checks the owner's checksums when installing it)
        mm = self.slots.view(rank, idx)
        return {}, bytes(mm[:SlotHeader.unpack(mm).replicated_len])

    def _peer_get_shared(self, h: dict[str, Any], payload: bytearray) -> tuple[dict[str, Any], bytes]:
        req = SlotRequest.from_header(h)
        rank, step = req.rank, req.step
        idx = self.slots.slot_of(rank, step)
        if idx is None:
            raise SlotError(f"no local snapshot of rank {rank} at step {step}")
        mm = self.slots.view(rank, idx)
        hdr = SlotHeader.unpack(mm)
        data = bytes(mm[hdr.shared_off:hdr.shared_off + hdr.shared_len])
        if crc_shared(mm, hdr) != hdr.crc_shared:
            raise SlotError(f"local snapshot of rank {rank} step {step} fails its checksum")
        return {}, corrupt_point("get_shared", data)     # tests: a peer whose bytes are not the lost rank's
