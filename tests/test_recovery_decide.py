"""The recovery cycle's decisions as pure functions (control/decide.py): what a report means while a recovery
waits for acks (`midway`), what follows a failed cycle (`after_failure`), the end of a wait for a spare
(`no_spare`); and the master's phase transitions (control/state.py: `PHASE_MOVES`). Tables."""
import itertools

import pytest

from phoenixrun.control.decide import (CASCADE_LIMIT, MIDWAY_WORKER_ACTION, AfterFailure, Failure, Midway, Next,
                                       Recovery, after_failure, midway, mismatch_reason, no_spare)
from phoenixrun.control.state import PHASE_MOVES, Phase, PhaseError, phase_move
from phoenixrun.faults import Action
from phoenixrun.protocol import reports as r
from tests.transitions import check_move

G = 7   # the generation of the recovery in flight


@pytest.mark.parametrize("ev, in_play, verdict", [
    (r.RestoreFailed(mismatch=True, integrity=True), False, Midway.MISMATCH),  # from any node
    (r.RestoreFailed(integrity=True), False, Midway.PLAN_FAILED),
    (r.RestoreFailed(reason="port full"), True, Midway.RETRY),
    (r.RestoreFailed(), False, Midway.RETRY),
    (r.NodeLost(), True, Midway.NODE_LOST),
    (r.Left(), True, Midway.NODE_LOST),
    (r.NodeLost(), False, Midway.IGNORE),          # a spare, a failed node, a slot lost already
    (r.WorkerExit(generation=G, returncode=1), True, Midway.WORKER_LOST),
    (r.WorkerHang(generation=G), True, Midway.WORKER_LOST),
    (r.WorkerExit(generation=G - 1, returncode=1), True, Midway.IGNORE),   # the restore respawns those
    (r.WorkerExit(generation=G, returncode=1), False, Midway.IGNORE),
    (r.WorkerExit(returncode=1), True, Midway.IGNORE),
    (r.CommError(generation=G), True, Midway.IGNORE),         # expected while quiescing
    (r.WorkerError(generation=G), True, Midway.IGNORE),
    (r.Joined(), True, Midway.IGNORE),
    (r.Quiesced(generation=G - 1), True, Midway.IGNORE),      # an ack of an earlier phase
])
def test_midway(ev, in_play, verdict):
    assert midway(ev, in_play, G) is verdict


def test_a_worker_lost_midway_is_a_local_reset():
    assert MIDWAY_WORKER_ACTION is Action.LOCAL_RESET


def test_mismatch_reason_names_the_checkpoint_and_the_fix():
    ev = r.RestoreFailed(rank=3, reason="2 tensors, the script has 4", mismatch=True)
    assert mismatch_reason(ev, 40, "/ckpt").startswith(
        "checkpoint step 40 in /ckpt does not match the script (rank 3: 2 tensors, the script has 4)")
    assert mismatch_reason(ev, None, "/ckpt").startswith("the restored state does not match")
    assert "--persist-dir" in mismatch_reason(ev, 40, None)


H, D, S, GR, F = Recovery.HOT_SWAP, Recovery.DRAIN, Recovery.SHRINK, Recovery.GROW, Recovery.FALLBACK
C, P, N = Failure.CASCADE, Failure.PLAN, Failure.NO_SPARE


@pytest.mark.parametrize("kind, failure, attempts, tries, after", [
    (H, C, 1, 0, AfterFailure(Next.RETRY, 0.0)),          # at once after the first failure
    (H, C, 2, 0, AfterFailure(Next.RETRY, 0.25)),         # then backing off
    (H, C, CASCADE_LIMIT, 0, AfterFailure(Next.RETRY, 2.0)),
    (H, C, CASCADE_LIMIT + 1, 0, AfterFailure(Next.FALL_BACK)),   # in-memory recovery given up
    (H, P, 1, 0, AfterFailure(Next.FALL_BACK)),           # the same plan cannot succeed
    (H, N, 1, 0, AfterFailure(Next.SHRINK)),
    (D, C, 1, 1, AfterFailure(Next.HOT_SWAP)),
    (D, P, 1, 1, AfterFailure(Next.HOT_SWAP)),
    (S, C, 1, 1, AfterFailure(Next.STOP)),                # the old snapshots are gone
    (GR, C, 1, 1, AfterFailure(Next.STOP)),
    (GR, P, 1, 1, AfterFailure(Next.STOP)),
    (F, C, 1, 3, AfterFailure(Next.RETRY)),               # the next older checkpoint
    (F, P, 2, 3, AfterFailure(Next.RETRY)),
    (F, C, 3, 3, AfterFailure(Next.STOP)),                # --max-fallbacks used up
    (F, C, 1, 1, AfterFailure(Next.STOP)),
])
def test_after_failure(kind, failure, attempts, tries, after):
    assert after_failure(kind, failure, attempts, tries) == after


@pytest.mark.parametrize("kind, failure", list(itertools.product(Recovery, Failure)))
def test_after_failure_always_ends_a_recovery(kind, failure):
    """Property: every recovery stops retrying within CASCADE_LIMIT + 1 cycles (or its tries), whatever fails."""
    nexts = [after_failure(kind, failure, a, tries=3).next for a in range(1, CASCADE_LIMIT + 2)]
    assert nexts[-1] is not Next.RETRY
    assert all(n is Next.RETRY for n in nexts[:nexts.index(nexts[-1])])


@pytest.mark.parametrize("may_shrink, on_no_spare, promoted_any, verdict", [
    (True, "shrink", False, Next.SHRINK),
    (True, "shrink", True, Next.STOP),        # some slots got a spare in this cycle: they keep it
    (True, "stop", False, Next.STOP),
    (False, "shrink", False, Next.STOP),      # spares promoted in an earlier cycle hold the restore
])
def test_no_spare(may_shrink, on_no_spare, promoted_any, verdict):
    assert no_spare(may_shrink, on_no_spare, promoted_any) is verdict


W, R, Q, RS, FI, FA = Phase.WAITING, Phase.RUNNING, Phase.QUIESCE, Phase.RESTORE, Phase.FINISHED, Phase.FAILED


@pytest.mark.parametrize("now, to, legal", [
    (W, R, True),       # the start; a restarted master's resume
    (W, FA, True),      # a join that timed out
    (W, Q, False),      # nothing is recovered before the start
    (W, RS, False),
    (R, R, True),       # a torchrun-style restart
    (R, Q, True),       # a hot swap, a drain, a grow
    (R, RS, True),      # a fallback (the job resuming from its checkpoints)
    (R, W, False),
    (Q, Q, True),       # a cascade: the next cycle
    (Q, RS, True),
    (Q, R, True),       # given up: torchrun's restart
    (RS, Q, True),      # a cascade during the restore
    (RS, RS, True),     # the fallback's next checkpoint
    (RS, R, True),
    (RS, FI, True),
    (FI, R, False),     # the end is the end
    (FA, Q, False),
    (FI, FA, False),
])
def test_phase_moves(now, to, legal):
    check_move(phase_move, now, to, legal, PhaseError)


def test_every_phase_has_its_row_and_every_live_phase_can_end():
    assert set(PHASE_MOVES) == set(Phase)
    for p in (W, R, Q, RS):
        assert {FI, FA} <= PHASE_MOVES[p]


def test_the_job_state_refuses_an_illegal_phase(tmp_path):
    from phoenixrun.config import MasterConfig
    from phoenixrun.control.jobstate import JobState
    job = JobState(MasterConfig.build(run_dir=tmp_path, nnodes=1, nproc_per_node=1))
    assert job.course.phase is W
    with pytest.raises(PhaseError):
        job.course.phase = Q
    job.course.phase = R
    job.course.phase = FI
    assert job.course.phase is FI
