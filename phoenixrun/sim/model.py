"""Closed-form cost model of checkpoint-restart vs PHOENIX hot swap (docs/simulate.md, "The model").

Two families of formulas live here, both pure functions of plain numbers:

* The paper's first-order model: each failure costs E[C] seconds and the job runs
  MTTF seconds between failures, so efficiency eta ~ MTTF / (MTTF + E[C]).
  It ignores failures that strike during a recovery and assumes the failure lands
  uniformly inside a checkpoint interval, so it is accurate when MTTF >> E[C] and
  MTTF >> K * t_step.
* The exact expectation of the Monte Carlo simulator (`montecarlo.py`): Poisson
  failures on the wall clock that may also strike a restart, a replay or a
  checkpoint write. The simulator's mean lost time must match these within its CI.

Reproducing the paper's worked example (MTTF 1080 s, t_step 20 s, K 100, restart
600 s, checkpoint overhead 5 s, hot swap 30 s, phi 0.5):
    E[C_ckpt]    = 5 + 600 + 20 * 99/2 = 1595 s -> eta = 1080/2675 = 0.4037
    E[C_phoenix] = 0 + 30 + 20 * 0.5   =   40 s -> eta = 1080/1120 = 0.9643
So the 5 s overhead is charged once per failure, and to checkpoint-restart only:
PHOENIX's per-step snapshot is overlapped with compute, C_overhead = 0 (charging
it the 5 s too would give 1080/1125 = 0.960, not 0.964). The checkpoint-restart
figure barely depends on the overhead convention (0.4045 with none, 0.4041 with
the write time amortised over one MTTF), and the paper's form also leaves out
the interrupted step that checkpoint-restart loses too (+ t_step/2 -> 0.4022).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# --- scenario ---------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One training job and its failure environment; all times in seconds.

    mttf_s is the whole job's (system) mean time to failure, see `system_mttf`.
    ckpt_overhead_s is the time to write one checkpoint, taken every
    ckpt_interval steps (and not after the last step: the final save is common
    to both strategies). phi is the fraction of a step PHOENIX redoes after a
    hot swap.
    """

    mttf_s: float
    t_step_s: float
    steps: int
    ckpt_interval: int
    ckpt_overhead_s: float
    t_restart_s: float
    t_hotswap_s: float
    phi: float = 0.5

    def __post_init__(self) -> None:
        for name in ("mttf_s", "t_step_s"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be a positive finite number, got {getattr(self, name)}")
        for name in ("ckpt_overhead_s", "t_restart_s", "t_hotswap_s"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.ckpt_interval < 1:
            raise ValueError(f"ckpt_interval (K) must be >= 1, got {self.ckpt_interval}")
        if not 0.0 <= self.phi < 1.0:
            raise ValueError(f"phi must be in [0, 1), got {self.phi}")

    @property
    def fault_free_s(self) -> float:
        """Useful compute time of the job: steps * t_step."""
        return self.steps * self.t_step_s


# --- the paper's first-order model -------------------------------------------


def failure_rate(mttf_s: float) -> float:
    """lambda = 1 / MTTF (failures per second)."""
    return 1.0 / mttf_s


def system_mttf(node_mttf_s: float, nodes: int) -> float:
    """MTTF of a job on `nodes` nodes with independent exponential failures: rates add."""
    return node_mttf_s / nodes


def expected_replay_steps(k: int) -> float:
    """E[R] = (K-1)/2 completed steps replayed after a restart from a checkpoint every K
    steps (the failure lands uniformly on steps 0..K-1 after the checkpoint)."""
    return (k - 1) / 2.0


def expected_cost_ckpt(c_overhead_s: float, t_restart_s: float, t_step_s: float, k: int) -> float:
    """E[C_ckpt] = C_overhead + E[T_restart] + t_step * E[R], seconds lost per failure."""
    return c_overhead_s + t_restart_s + t_step_s * expected_replay_steps(k)


def expected_cost_phoenix(t_hotswap_s: float, t_step_s: float, phi: float, c_overhead_s: float = 0.0) -> float:
    """E[C_phoenix] = C_overhead + E[T_hotswap] + t_step * phi, seconds lost per failure.

    C_overhead defaults to 0: the per-step snapshot overlaps compute (see module doc)."""
    return c_overhead_s + t_hotswap_s + t_step_s * phi


def efficiency(mttf_s: float, expected_cost_s: float) -> float:
    """eta ~ MTTF / (MTTF + E[C]): useful fraction of wall time, to first order."""
    return mttf_s / (mttf_s + expected_cost_s)


def p_loss_independent(shards: int, p: float, replicas: int) -> float:
    """Union bound on the per-step probability that some shard loses its owner and all
    `replicas` holders: P_loss <= D * p^(k+1), independent node faults of probability p."""
    return min(1.0, shards * p ** (replicas + 1))


def p_loss_fault_domains(shards: int, q: float, replicas: int) -> float:
    """Same bound with owner and replicas in k+1 distinct fault domains, each failing
    with per-step probability q: P_loss <= D * q^(k+1)."""
    return min(1.0, shards * q ** (replicas + 1))


@dataclass(frozen=True)
class Prediction:
    """Per-failure cost and efficiency of both strategies."""

    cost_ckpt_s: float
    cost_phoenix_s: float
    eta_ckpt: float
    eta_phoenix: float

    @property
    def speedup(self) -> float:
        """Ratio of lost time, checkpoint-restart over PHOENIX."""
        return self.cost_ckpt_s / self.cost_phoenix_s if self.cost_phoenix_s > 0 else math.inf


def paper_prediction(s: Scenario) -> Prediction:
    """The paper's model on a scenario: the checkpoint overhead is a lump per failure."""
    c_ckpt = expected_cost_ckpt(s.ckpt_overhead_s, s.t_restart_s, s.t_step_s, s.ckpt_interval)
    c_phx = expected_cost_phoenix(s.t_hotswap_s, s.t_step_s, s.phi)
    return Prediction(c_ckpt, c_phx, efficiency(s.mttf_s, c_ckpt), efficiency(s.mttf_s, c_phx))


# --- exact expectations of the Monte Carlo model -------------------------------


def expected_exposed_time(work_s: float, restart_s: float, rate: float) -> float:
    """Expected wall time to finish `work_s` of work under Poisson failures (rate lambda),
    when each failure throws the work away and costs a restart of `restart_s` that can
    itself be hit (Daly's formula with no fixed downtime): e^(lambda R) (e^(lambda W) - 1) / lambda.
    """
    try:
        return math.exp(rate * restart_s) * math.expm1(rate * work_s) / rate
    except OverflowError:  # the job (practically) never gets through this segment
        return math.inf


def ckpt_segments(s: Scenario) -> list[tuple[float, int]]:
    """(work seconds, count) of the job's checkpoint segments: K steps plus a write,
    except the last segment (the remainder, no write)."""
    n = -(-s.steps // s.ckpt_interval)  # ceil
    last_steps = s.steps - (n - 1) * s.ckpt_interval
    return [(s.ckpt_interval * s.t_step_s + s.ckpt_overhead_s, n - 1), (last_steps * s.t_step_s, 1)]


def expected_lost_ckpt(s: Scenario) -> float:
    """E[wall] - steps * t_step for checkpoint-restart under Poisson failures (exact)."""
    rate = failure_rate(s.mttf_s)
    wall = sum(n * expected_exposed_time(w, s.t_restart_s, rate) for w, n in ckpt_segments(s) if n)
    return wall - s.fault_free_s


def expected_lost_hotswap(s: Scenario) -> float:
    """E[wall] - steps * t_step for hot swap under Poisson failures (exact).

    Progress is kept; each failure during compute opens a recovery window of
    L = T_hotswap + phi * t_step that restarts if hit, lasting (e^(lambda L) - 1)/lambda
    on average; failures during compute number lambda * steps * t_step on average,
    so E[wall] = steps * t_step * e^(lambda L)."""
    rate = failure_rate(s.mttf_s)
    try:
        return s.fault_free_s * math.expm1(rate * (s.t_hotswap_s + s.phi * s.t_step_s))
    except OverflowError:
        return math.inf


def exact_prediction(s: Scenario) -> Prediction:
    """Lost time per mean failure interval, as `Prediction`, from the exact expectations:
    eta = useful / E[wall], and cost = lost time per MTTF of useful compute."""
    failures = s.fault_free_s / s.mttf_s
    lost_c, lost_h = expected_lost_ckpt(s), expected_lost_hotswap(s)
    return Prediction(
        cost_ckpt_s=lost_c / failures,
        cost_phoenix_s=lost_h / failures,
        eta_ckpt=s.fault_free_s / (s.fault_free_s + lost_c),
        eta_phoenix=s.fault_free_s / (s.fault_free_s + lost_h),
    )
