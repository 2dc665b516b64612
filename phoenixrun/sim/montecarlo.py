"""Monte Carlo simulator: checkpoint-restart vs hot swap on the same failure trajectories.

Failures arrive on the wall clock, as a Poisson process of rate 1/MTTF or from a
trace (absolute seconds since job start). They can strike anywhere, including a
restart, a replay or a checkpoint write, which the paper's first-order model
ignores; `model.expected_lost_ckpt` / `expected_lost_hotswap` are this
simulator's exact expectations.

* checkpoint-restart: a checkpoint of `ckpt_overhead_s` after every K steps; a
  failure throws away everything since the last completed checkpoint (the steps
  done, the interrupted step, a half-written checkpoint), then a restart of
  `t_restart_s` (a failure during it restarts it).
* hot swap: no per-step overhead; a failure keeps all progress and costs a
  recovery window of `t_hotswap_s` + phi * t_step (the redone fraction of the
  interrupted step); a failure inside the window starts it again.

Both strategies of one trial see the same failure times (common random numbers),
which narrows the CI of their ratio. Only `random` and `math`: numpy is optional.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from phoenixrun.sim.model import (
    Scenario,
    ckpt_segments,
    expected_lost_ckpt,
    failure_rate,
    system_mttf,
)

Z95 = 1.959963984540054  # two-sided 95% normal quantile; trials are many, so no t table

# Presets. `paper` is the worked example of the paper; it gives no job length,
# so we take 1000 steps (20000 s of compute, ~18.5 MTTFs). `paper-18.8x` is the
# paper's Monte Carlo scenario (2.3B model, 64 nodes, 100K steps); the paper's
# text here gives no MTTF, so we assume a per-node MTTF of 77 days (6.656e6 s),
# which makes the 64-node job's MTTF 104000 s, half the fault-free run of
# 208000 s: the job sees about two failures.
PAPER_18_8X_NODES = 64
PAPER_18_8X_NODE_MTTF_S = 6_656_000.0
PRESETS: dict[str, Scenario] = {
    "paper": Scenario(
        mttf_s=1080.0, t_step_s=20.0, steps=1000, ckpt_interval=100, ckpt_overhead_s=5.0,
        t_restart_s=600.0, t_hotswap_s=30.0, phi=0.5,
    ),
    "paper-18.8x": Scenario(
        mttf_s=system_mttf(PAPER_18_8X_NODE_MTTF_S, PAPER_18_8X_NODES), t_step_s=2.08, steps=100_000,
        ckpt_interval=5000, ckpt_overhead_s=8.9, t_restart_s=150.0, t_hotswap_s=30.0, phi=0.5,
    ),
}

# Refuse runs that would take minutes: checkpoint-restart's expected failure count
# explodes as K * t_step grows past the MTTF.
MAX_EXPECTED_FAILURES = 2_000_000
# Default trajectories: the presets take well under a second, and the CI is a few percent.
DEFAULT_TRIALS = 5000


@dataclass(frozen=True)
class Trajectory:
    """One simulated job. lost_s = overhead_s + recovery_s + rework_s."""

    failures: int
    overhead_s: float  # completed checkpoint writes
    recovery_s: float  # restart / hot-swap time, interrupted ones included
    rework_s: float  # compute thrown away and redone (replay, phi, lost writes)

    @property
    def lost_s(self) -> float:
        return self.overhead_s + self.recovery_s + self.rework_s


def _exposed_window(now: float, length: float, nxt: float, failures: Iterator[float]) -> tuple[float, float, int]:
    """Run a window of `length` seconds that starts over whenever a failure hits it.
    Returns (time it ends, next failure after it, failures that hit it)."""
    hits = 0
    while nxt < now + length:
        now, hits = nxt, hits + 1
        nxt = next(failures, math.inf)
    return now + length, nxt, hits


def simulate_ckpt(s: Scenario, failures: Iterator[float]) -> Trajectory:
    """Checkpoint-restart over ascending failure times."""
    nxt = next(failures, math.inf)
    now = rework = recovery = 0.0
    hits = 0
    segments = ckpt_segments(s)
    for work, count in segments:
        remaining = count
        while remaining:
            if nxt >= now + remaining * work:
                now += remaining * work
                break
            # skip the segments that finish before the failure, in O(1)
            done = min(int((nxt - now) // work), remaining - 1)
            now += done * work
            remaining -= done
            if nxt >= now + work:  # rounding edge: this segment finishes too
                now += work
                remaining -= 1
                continue
            rework += nxt - now
            now, hits = nxt, hits + 1
            nxt = next(failures, math.inf)
            start = now
            now, nxt, h = _exposed_window(now, s.t_restart_s, nxt, failures)
            recovery += now - start
            hits += h
    writes = segments[0][1]  # every write completes eventually
    return Trajectory(hits, writes * s.ckpt_overhead_s, recovery, rework)


def simulate_hotswap(s: Scenario, failures: Iterator[float]) -> Trajectory:
    """Hot swap over ascending failure times."""
    nxt = next(failures, math.inf)
    now = progress = window_s = 0.0
    opened = hits = 0
    replay = s.phi * s.t_step_s
    while nxt < now + (s.fault_free_s - progress):
        progress += nxt - now
        now, opened = nxt, opened + 1
        nxt = next(failures, math.inf)
        start = now
        now, nxt, h = _exposed_window(now, s.t_hotswap_s + replay, nxt, failures)
        window_s += now - start
        hits += h
    # each opened window completes once: its replay is rework, all other window time recovery
    rework = opened * replay
    return Trajectory(opened + hits, 0.0, window_s - rework, rework)


def poisson_failures(rate: float, rng: random.Random) -> Iterator[float]:
    """Endless ascending failure times of a Poisson process of `rate` per second."""
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t


def load_trace(path: str | Path) -> list[float]:
    """Failure times (seconds since job start), one per line; blank lines and '#' comments
    are skipped. Raises ValueError naming the bad line."""
    times = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            t = float(text)
        except ValueError:
            raise ValueError(f"line {lineno}: {text!r} is not a number of seconds") from None
        if not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"line {lineno}: failure time must be >= 0 and finite, got {text}")
        times.append(t)
    return sorted(times)


# --- statistics ---------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95% confidence interval (normal approximation)."""

    mean: float
    lo: float
    hi: float

    def contains(self, x: float) -> bool:
        return self.lo <= x <= self.hi


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = math.fsum(xs) / n
    var = math.fsum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, var


def mean_ci(xs: Sequence[float]) -> Estimate:
    """Sample mean and 95% CI, mean +- 1.96 * sd / sqrt(n)."""
    m, var = _mean_var(xs)
    half = Z95 * math.sqrt(var / len(xs))
    return Estimate(m, m - half, m + half)


def ratio_ci(a: Sequence[float], b: Sequence[float]) -> Estimate | None:
    """mean(a) / mean(b) with a delta-method 95% CI for paired samples; None if mean(b) is 0."""
    n = len(a)
    ma, va = _mean_var(a)
    mb, vb = _mean_var(b)
    if mb <= 0:
        return None
    cov = math.fsum((x - ma) * (y - mb) for x, y in zip(a, b)) / (n - 1) if n > 1 else 0.0
    r = ma / mb
    var = max(0.0, (va - 2 * r * cov + r * r * vb) / (mb * mb * n))
    half = Z95 * math.sqrt(var)
    return Estimate(r, r - half, r + half)


@dataclass(frozen=True)
class StrategyStats:
    """Monte Carlo summary of one strategy. efficiency = useful / (useful + mean lost),
    its CI the image of lost time's CI."""

    lost_s: Estimate
    efficiency: Estimate
    failures: float  # mean failures per job
    overhead_s: float  # means of the lost-time parts
    recovery_s: float
    rework_s: float


def summarize(s: Scenario, runs: Sequence[Trajectory]) -> StrategyStats:
    lost = mean_ci([r.lost_s for r in runs])
    useful = s.fault_free_s
    eff = Estimate(useful / (useful + lost.mean), useful / (useful + max(lost.hi, 0.0)),
                   useful / (useful + max(lost.lo, 0.0)))
    n = len(runs)
    return StrategyStats(
        lost_s=lost,
        efficiency=eff,
        failures=sum(r.failures for r in runs) / n,
        overhead_s=math.fsum(r.overhead_s for r in runs) / n,
        recovery_s=math.fsum(r.recovery_s for r in runs) / n,
        rework_s=math.fsum(r.rework_s for r in runs) / n,
    )


@dataclass(frozen=True)
class MonteCarloResult:
    trials: int
    seed: int | None  # None for a trace
    ckpt: StrategyStats
    hotswap: StrategyStats
    speedup: Estimate | None  # lost-time ratio ckpt / hot swap; None if hot swap lost nothing


def run(s: Scenario, trials: int = DEFAULT_TRIALS, seed: int = 0, trace: Iterable[float] | None = None) -> MonteCarloResult:
    """Simulate both strategies. With a trace the outcome is deterministic: one trial.

    Raises ValueError when a Poisson run would need more than MAX_EXPECTED_FAILURES
    simulated failures in total."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if trace is not None:
        times = sorted(trace)
        runs = [(simulate_ckpt(s, iter(times)), simulate_hotswap(s, iter(times)))]
        trials, seed_used = 1, None
    else:
        rate = failure_rate(s.mttf_s)
        expected = (s.fault_free_s + expected_lost_ckpt(s)) * rate * trials
        if not expected <= MAX_EXPECTED_FAILURES:
            raise ValueError(
                f"checkpoint-restart would suffer ~{expected / trials:.3g} failures per job, too many to simulate "
                f"(checkpoint interval {s.ckpt_interval * s.t_step_s:g} s vs MTTF {s.mttf_s:g} s); "
                "raise the MTTF, lower the checkpoint interval or the number of trials")
        # a string seed is hashed with SHA-512: stable across runs and Python processes
        keys = [f"{seed}:{i}" for i in range(trials)]
        runs = [(simulate_ckpt(s, poisson_failures(rate, random.Random(k))),
                 simulate_hotswap(s, poisson_failures(rate, random.Random(k)))) for k in keys]
        seed_used = seed
    ckpt = [c for c, _ in runs]
    hot = [h for _, h in runs]
    return MonteCarloResult(trials, seed_used, summarize(s, ckpt), summarize(s, hot),
                            ratio_ci([r.lost_s for r in ckpt], [r.lost_s for r in hot]))
