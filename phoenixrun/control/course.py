"""The job's course, as the master knows it: its phase and generation, the layout it runs in (fewer nodes while
shrunk), what it survived (restarts, recoveries, fallbacks, the faults acted on) and how it ends. Nothing here
acts on it.

Called with JobState.cv held (control/jobstate.py), like the rest of the master's data.
"""
from __future__ import annotations

from phoenixrun.control.state import PHASE_MOVES, Phase, phase_move
from phoenixrun.faults import Signal
from phoenixrun.faults.escalate import Attempt
from phoenixrun.redundancy import PeerSet
from phoenixrun.topology import Layout, place_replicas


class Course:
    def __init__(self, layout: Layout, replicas: int, fault_domains: dict[int, str]) -> None:
        self.fault_domains = fault_domains     # slot -> fault-domain label, for replica placement
        self.relayout(layout, replicas)
        self.generation = 0
        self._phase = Phase.WAITING      # moved only as state.PHASE_MOVES allows (the `phase` property)
        self.restart_count = 0
        self.recoveries = 0
        self.fallbacks = 0
        self.bad_checkpoints: set[int] = set()   # steps whose persistent checkpoint failed to load
        self.exit_code: int | None = None
        self.reason = ""
        self.api_mode = False
        self.protect_every = 1
        # where the job's DTensor state has copies, when it keeps it in the shared region (rank 0 says so at
        # protect()): the plan takes shared state from these peers instead of the --tp/--pp DP ring. Not rebuilt
        # by a restarted master: a plan then asks the DP ring, whose wrong bytes the checksum refuses (fallback)
        self.peer_set: PeerSet | None = None
        self.fault_history: dict[int, list[Signal]] = {}   # slot -> signals acted on (escalation)
        self.attempts: list[Attempt] = []   # every fault acted on, with the committed step then (no loop)
        self.restored_step: int | None = None   # the step the last recovery put every rank at (None: a fresh start)
        self.resumed_at: float | None = None      # set when agents of a running job rejoin (master restart)

    @property
    def phase(self) -> Phase:
        return self._phase

    @phase.setter
    def phase(self, to: Phase) -> None:
        self._phase = phase_move(self._phase, to)     # an illegal move raises PhaseError

    @property
    def over(self) -> bool:
        """The job has ended (finished or failed): no phase follows (state.PHASE_MOVES)."""
        return not PHASE_MOVES[self._phase]

    def relayout(self, layout: Layout, replicas: int) -> None:
        """The job's layout and replica placement (`replicas` copies: MasterConfig.shape.replicas_on): --nnodes
        at the start, fewer nodes while shrunk (control/reshape.py). Per slot: its ranks' replica holders, and
        the slots whose addresses it needs."""
        self.layout = layout
        self.placement = place_replicas(layout, replicas, self.fault_domains)
        self.slot_placement: dict[int, tuple[dict[int, list[int]], list[int]]] = {}
        self.needed_by: dict[int, list[int]] = {}   # slot -> the slots whose world holds its address
        for slot in range(layout.nnodes):
            placement = {r: self.placement.get(r, []) for r in layout.ranks_of_slot(slot)}
            need = sorted({h for hs in placement.values() for h in hs} | {slot})
            self.slot_placement[slot] = placement, need
            for s in need:
                self.needed_by.setdefault(s, []).append(slot)
