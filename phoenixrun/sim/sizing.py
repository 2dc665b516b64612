"""Sizing advice: how many replicas and spares a job needs, from per-step fault probabilities. Pure.

The model (docs/simulate.md, "Sizing"):
- `nodes` nodes in `domains` fault domains of equal size (contiguous: nodes 0..s-1 in domain 0, s = nodes /
  domains; `domains` = `nodes` means every node is its own domain).
- Every step each node fails independently with probability `p_fault`, and each domain fails with probability
  `p_domain` (all its nodes at once: a rack's switch or power).
- A node's private state (a ZeRO/FSDP shard, a pipeline stage without peers) has its owner's copy and
  `replicas` copies on other nodes, in other fault domains when there are enough: node i's holders are
  i + s, i + 2s, ... (one per following domain) when replicas < domains, else i + 1, i + 2, ... (the ring).
- A failed node's copies are gone until its replacement and the replicas it held are protected again:
  `window` steps (phoenixrun replicates every step, so 1: a node failing in the step after is covered).
- The state is lost - no in-memory recovery, the job falls back to a disk checkpoint - when at some step the
  owner and all holders of one node's state have all failed within the last `window` steps.
- Every node failure uses up a spare (a domain failure, s of them); spares are not returned during the run
  (an allocation keeps its nodes). The spares run out when the failures exceed them.

`loss_probability_exact` is the closed form for independent faults with window 1 (the test's hand-computed
values); the Monte Carlo covers correlated faults and longer windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Fleet:
    nodes: int
    steps: int
    p_fault: float            # per node, per step
    p_domain: float = 0.0     # per fault domain, per step
    domains: int = 0          # 0: every node is its own domain
    window: int = 1           # steps a failed node's copies stay missing

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.steps < 1 or self.window < 1:
            raise ValueError("nodes, steps and window must be >= 1")
        for name in ("p_fault", "p_domain"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if self.domains and (self.domains > self.nodes or self.nodes % self.domains):
            raise ValueError(f"{self.domains} fault domains do not divide {self.nodes} nodes evenly; "
                             "give a number of domains that divides the node count")

    @property
    def n_domains(self) -> int:
        return self.domains or self.nodes

    @property
    def domain_size(self) -> int:
        return self.nodes // self.n_domains

    def stride(self, replicas: int) -> int:
        """Distance between a node and its next holder: one domain on, while the domains last."""
        return self.domain_size if replicas < self.n_domains else 1


@dataclass(frozen=True)
class Estimate:
    mean: float
    lo: float
    hi: float

    @staticmethod
    def of(hits: int, trials: int) -> "Estimate":
        """A proportion with its Wilson 95% interval (sound at 0 hits: the upper end is ~3.8/trials)."""
        p = hits / trials
        z2 = Z95 * Z95
        centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
        half = Z95 * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / (1 + z2 / trials)
        return Estimate(p, 0.0 if hits == 0 else max(0.0, centre - half),
                        1.0 if hits == trials else min(1.0, centre + half))


def _run_probabilities(length: int, m: int, p: float) -> list[float]:
    """g[i] = P(a string of i independent Bernoulli(p) has a run of m ones), i = 0..length.

    Carried as the probability of a run, not of none: every term is a sum of non-negative parts, so a
    probability of 1e-20 keeps its digits (1 - P(no run) would be 0 below ~1e-16)."""
    g = [0.0] * (length + 1)
    q, pm = 1.0 - p, p ** m
    for i in range(m, length + 1):
        # a run first completes at i when ones fill i-m+1..i after a zero (or from the start, at i = m)
        g[i] = g[i - 1] + (q * pm * (1.0 - g[i - m - 1]) if i > m else pm)
    return g


def run_probability_cyclic(length: int, m: int, p: float) -> float:
    """P(a cyclic string of `length` independent Bernoulli(p) has a run of m ones, around the end too).

    Split by the a leading ones before the first zero and the b trailing ones after the last: the run wraps
    around when a + b >= m, else it lies in the free middle between the two zeros. All ones is a run. Every
    part is non-negative, so tiny probabilities are exact to rounding (no 1 - x)."""
    if m > length:
        return 0.0
    q = 1.0 - p
    # all ones; a zero at a >= m (a run of a ones before it); a < m leading ones with m - a trailing ones
    # (one position each, so m * q * p^m, when the string has room for the zero: m <= length - 1)
    wrap = p ** length + sum(p ** a * q for a in range(m, length)) + (m * q * p ** m if m <= length - 1 else 0.0)
    g = _run_probabilities(length, m, p)
    inner = 0.0
    for a in range(m):
        for b in range(m - a):
            middle = length - a - b - 2
            if middle >= 0:          # two zeros with `middle` free positions between them
                inner += p ** a * q * g[middle] * q * p ** b
    return wrap + inner


def loss_probability_exact(fleet: Fleet, replicas: int) -> float:
    """P(some node's private state is lost during the run), independent faults, window 1, no domain faults.

    The groups (owner + holders) are `replicas + 1` consecutive nodes of the `stride`-cycles of the ring;
    within a step a group is lost when all its nodes fail; steps are independent. Computed as
    1 - (1 - x)^n = -expm1(n log1p(-x)) from the per-cycle loss x, so 1e-17 does not round to 0 or 2.2e-11
    (issue 32: 128 nodes, p 1e-6, 100K steps gave 2.22e-11 for 2 and 3 replicas)."""
    if fleet.p_domain or fleet.window != 1:
        raise ValueError("the closed form covers independent faults with window 1; use the Monte Carlo")
    s = fleet.stride(replicas)
    cycles = math.gcd(fleet.nodes, s)
    per_cycle = run_probability_cyclic(fleet.nodes // cycles, replicas + 1, fleet.p_fault)
    if per_cycle >= 1.0:
        return 1.0
    return -math.expm1(fleet.steps * cycles * math.log1p(-per_cycle))


def exhaustion_probability_exact(fleet: Fleet, spares: int) -> float:
    """P(more node failures than spares during the run), independent faults only: a binomial tail."""
    if fleet.p_domain:
        raise ValueError("the closed form covers independent faults only; use the Monte Carlo")
    n, p = fleet.nodes * fleet.steps, fleet.p_fault
    if p in (0.0, 1.0):
        return float(n * p > spares)
    # the pmf in log space (n is large: 64 nodes x 100K steps)
    logq, logp, lgn = math.log1p(-p), math.log(p), math.lgamma(n + 1)

    def pmf(k: int) -> float:
        return math.exp(lgn - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * logp + (n - k) * logq)

    if spares < n * p:       # the tail is not small: 1 - cdf loses nothing that matters
        return max(0.0, 1.0 - sum(pmf(k) for k in range(min(spares, n) + 1)))
    # past the mean the terms fall faster than geometrically: sum the tail itself (1 - cdf is 0 below 1e-16)
    tail, k = 0.0, spares + 1
    while k <= n:
        term = pmf(k)
        tail += term
        if term <= tail * 1e-17:
            break
        k += 1
    return min(1.0, tail)


@dataclass(frozen=True)
class Trial:
    lost: dict[int, bool]     # replicas -> state lost in this trial
    failures: int             # nodes failed (spares used up)


def _failures(fleet: Fleet, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(step, node) of every node failure in one run, independent and domain faults together."""
    out: list[tuple[int, int]] = []
    n = rng.binomial(fleet.nodes * fleet.steps, fleet.p_fault)
    if n:
        cells = rng.choice(fleet.nodes * fleet.steps, size=n, replace=False) if n < 1e6 else \
            rng.integers(0, fleet.nodes * fleet.steps, size=n)
        out += [(int(c) // fleet.nodes, int(c) % fleet.nodes) for c in cells]
    d = rng.binomial(fleet.n_domains * fleet.steps, fleet.p_domain) if fleet.p_domain else 0
    if d:
        size = fleet.domain_size
        for c in rng.choice(fleet.n_domains * fleet.steps, size=d, replace=False):
            step, dom = int(c) // fleet.n_domains, int(c) % fleet.n_domains
            out += [(step, dom * size + j) for j in range(size)]
    return out


def losses(fleet: Fleet, replicas: list[int], failures: list[tuple[int, int]]) -> dict[int, bool]:
    """For each replica count: is some node's private state lost, given the (step, node) failures of a run?"""
    events = sorted(set(failures))
    out = {}
    for k in replicas:
        s, group = fleet.stride(k), range(k + 1)
        down: dict[int, int] = {}      # node -> step of its latest failure
        hit = False
        for step, node in events:
            down[node] = step
            # every group containing this node: owners node - j*s for j in 0..k
            for j in group:
                owner = (node - j * s) % fleet.nodes
                members = [(owner + i * s) % fleet.nodes for i in group]
                if len(set(members)) == len(members) and all(
                        step - down.get(m, -fleet.window) < fleet.window for m in members):
                    hit = True
                    break
            if hit:
                break
        out[k] = hit
    return out


def trial(fleet: Fleet, replicas: list[int], rng: np.random.Generator) -> Trial:
    failures = _failures(fleet, rng)
    return Trial(losses(fleet, replicas, failures), len(set(failures)))


@dataclass(frozen=True)
class Sizing:
    loss: dict[int, Estimate]          # replicas -> P(state lost during the run)
    exhaustion: dict[int, Estimate]    # spares -> P(more failures than spares)
    replicas: int | None               # fewest replicas with P(loss) <= target (upper 95% bound); None: none tried
    spares: int | None

    def to_json(self) -> dict[str, Any]:
        def est(e: Estimate) -> dict[str, Any]:
            return {"mean": e.mean, "ci95": [e.lo, e.hi]}

        return {"loss_by_replicas": {k: est(e) for k, e in self.loss.items()},
                "exhaustion_by_spares": {k: est(e) for k, e in self.exhaustion.items()},
                "recommended_replicas": self.replicas, "recommended_spares": self.spares}


def size(fleet: Fleet, target: float, trials: int, seed: int = 0, max_replicas: int = 3) -> Sizing:
    """Monte Carlo over `trials` runs (the same failures for every replica count: common random numbers).
    Recommended: the fewest replicas / spares whose probability's upper 95% bound is within `target` (None:
    no replica count tried is; or, for spares, `trials` too few to resolve `target`)."""
    if not 0 < target < 1:
        raise ValueError(f"target must be a probability in (0, 1), got {target}")
    if trials < 1:
        raise ValueError("trials must be >= 1")
    ks = [k for k in range(max_replicas + 1) if k < fleet.nodes]
    rng = np.random.default_rng(seed)
    lost = dict.fromkeys(ks, 0)
    failures: list[int] = []
    for _ in range(trials):
        t = trial(fleet, ks, rng)
        for k, hit in t.lost.items():
            lost[k] += hit
        failures.append(t.failures)
    loss = {k: Estimate.of(lost[k], trials) for k in ks}
    exhaustion = {s: Estimate.of(sum(f > s for f in failures), trials) for s in range(max(failures) + 1)}
    return Sizing(loss, exhaustion,
                  next((k for k in ks if loss[k].hi <= target), None),
                  next((s for s in exhaustion if exhaustion[s].hi <= target), None))
