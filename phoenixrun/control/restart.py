"""torchrun's restart, for a job whose workers do not use the phoenixrun API: every worker restarted from scratch
(spares fill the lost slots), counted once against --max-restarts. No quiesce and no restore: the recovery cycle
(control/cycle.py) has nothing to keep; only its spare promotion (`Cycle.fill`) is shared."""
from __future__ import annotations

import threading
from typing import Any

from phoenixrun.control.cycle import Cycle
from phoenixrun.control.decide import attempt_ranks, attempt_verdict
from phoenixrun.control.inflight import Stop
from phoenixrun.control.state import Phase
from phoenixrun.protocol import directives as cmd
from phoenixrun.protocol.events import Restarted
from phoenixrun.protocol.reports import AttemptCheck


class Restart:
    def __init__(self, cycle: Cycle):
        self.cycle, self.job, self.cfg = cycle, cycle.job, cycle.cfg
        self._attempt_stores: dict[int, Any] = {}     # generation -> the TCPStore of that restart attempt (torch's, untyped)

    def __call__(self, lost: set[int], failing_code: int | None, why: str) -> None:
        """Each attempt rendezvouses on a TCPStore of its own (a fresh port in the directive): scripts
        without the API join with TORCHELASTIC_USE_AGENT_STORE=True and no key prefix, so on a shared
        store the second attempt read the first attempt's gloo addresses (measured: 3 of 3 restarts failed
        in connectFullMesh, one hung for 10 minutes). An attempt that does not come up is stopped with
        the ranks that never arrived (`check`)."""
        job, cycle = self.job, self.cycle
        if job.course.restart_count >= self.cfg.recovery.max_restarts:
            raise Stop(failing_code or 1, f"{why}; no restarts left (--max-restarts {self.cfg.recovery.max_restarts})")
        cycle.fill(lost)
        with job.cv:
            job.course.restart_count += 1
            job.course.generation += 1
            job.members.done_nodes.clear()
            job.course.restored_step = None        # every worker starts from scratch
            port = self._attempt_store(job.course.generation)
            done = cycle.events.emit(Restarted(restart_count=job.course.restart_count, reason=why, store_port=port),
                                     job.course.generation)
            cycle.orders.direct_slots(cmd.Restart(restart_count=job.course.restart_count, restore_step=None, store_port=port))
            job.course.phase = Phase.RUNNING
        cycle.incidents.close(done)
        cycle.flight.drain_stale()
        self._arm_check(job.course.generation, None)

    def _attempt_store(self, generation: int) -> int:
        """A TCPStore for one restart attempt; the previous attempt's (its workers are gone) is closed."""
        from torch.distributed import TCPStore   # type: ignore[attr-defined]  # torch does not list it in __all__
        store = TCPStore(self.cfg.listen.host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self._attempt_stores = {generation: store}
        return store.port

    def _arm_check(self, generation: int, joined: int | None) -> None:
        timer = threading.Timer(self.cfg.recovery.recovery_timeout, self.cycle.flight.inbox.put,
                                args=(AttemptCheck(generation=generation, joined=joined),))
        timer.daemon = True
        timer.start()

    def check(self, ev: AttemptCheck) -> None:
        """Did restart attempt `generation` come up? (decide.attempt_verdict) Up: done; hanging: the job stops
        with the ranks that are missing; else look again one --recovery-timeout later."""
        g = ev.generation
        store = None if g is None else self._attempt_stores.get(g)
        if g is None or store is None or g != self.job.course.generation or self.job.course.phase != Phase.RUNNING:
            return
        world = self.job.course.layout.world_size
        joined = attempt_ranks(store.list_keys(), world)
        if len(joined) == world:
            return
        missing = attempt_verdict(joined, world, ev.joined)
        if missing is not None:
            raise Stop(1, f"restart {self.job.course.restart_count} did not come up: rank(s) {missing} never reached "
                          f"init_process_group within --recovery-timeout {self.cfg.recovery.recovery_timeout:g}s "
                          f"while {len(joined)} of {world} ranks waited for them")
        self._arm_check(g, len(joined))
