"""Sizing advice (phoenixrun/sim/sizing.py): closed forms against values computed by hand, the Monte Carlo
against the closed forms (within its 95% interval), and correlated faults against a hand-computed value."""
import itertools
import json
import math
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from phoenixrun.sim.cli import simulate
from phoenixrun.sim.sizing import (Estimate, Fleet, exhaustion_probability_exact, loss_probability_exact, losses,
                                   size)

P, Q = 0.1, 0.9


def near(e: Estimate, exact: float, trials: int) -> bool:
    """The Monte Carlo mean within 4.5 standard errors of the exact value (the 95% interval would miss one
    comparison in twenty; these tests make dozens)."""
    return abs(e.mean - exact) <= 4.5 * math.sqrt(exact * (1 - exact) / trials) + 1 / trials


def test_closed_form_matches_hand_computed_values():
    # 4 nodes in a ring, one replica on the next node: the state is lost in a step when two neighbours fail.
    # Cyclic strings of 4 with no two adjacent failures: none failed, one failed (4 ways), two opposite (2 ways)
    per_step = Q ** 4 + 4 * P * Q ** 3 + 2 * P ** 2 * Q ** 2           # 0.9639
    assert loss_probability_exact(Fleet(4, 20, P), 1) == pytest.approx(1 - per_step ** 20)   # 0.5207
    # no replica: any failure loses a node's private state
    assert loss_probability_exact(Fleet(4, 20, P), 0) == pytest.approx(1 - Q ** 80)
    # two replicas: three consecutive failures of the 4-cycle (4 ways for exactly three) or all four
    per_step = 1 - (4 * P ** 3 * Q + P ** 4)
    assert loss_probability_exact(Fleet(4, 20, P), 2) == pytest.approx(1 - per_step ** 20)
    # with 2 domains of 2 nodes the replica goes to the other domain: groups {0, 2} and {1, 3}, two 2-cycles
    per_pair = 1 - P ** 2
    assert loss_probability_exact(Fleet(4, 20, P, domains=2), 1) == pytest.approx(1 - per_pair ** 40)
    # spares: failures over the run are binomial(80, 0.1)
    tail = 1 - sum(math.comb(80, k) * P ** k * Q ** (80 - k) for k in range(9))
    assert exhaustion_probability_exact(Fleet(4, 20, P), 8) == pytest.approx(tail)


@pytest.mark.parametrize("fleet", [Fleet(4, 20, P), Fleet(8, 30, 0.05), Fleet(4, 20, P, domains=2)])
def test_monte_carlo_agrees_with_the_closed_form(fleet):
    r = size(fleet, target=0.01, trials=3000, seed=1, max_replicas=2)
    for k, e in r.loss.items():
        assert near(e, loss_probability_exact(fleet, k), 3000), (k, e, loss_probability_exact(fleet, k))
    for s in (2, 5, 8):
        assert near(r.exhaustion[s], exhaustion_probability_exact(fleet, s), 3000), s


def test_domain_faults_lose_state_only_when_replicas_share_the_domain():
    # only domain faults: 4 nodes, 2 domains ({0,1}, {2,3}), q per domain per step. With the replica in the
    # other domain ({0,2}, {1,3}) the state is lost only when both domains fail in one step: 1-(1-q^2)^S
    q, steps = 0.05, 40
    fleet = Fleet(4, steps, 0.0, p_domain=q, domains=2)
    r = size(fleet, target=0.5, trials=4000, seed=2, max_replicas=1)
    assert near(r.loss[1], 1 - (1 - q * q) ** steps, 4000), r.loss[1]
    # no replica: any domain fault loses state; a domain fault uses up 2 spares at once
    assert near(r.loss[0], 1 - (1 - q) ** (2 * steps), 4000), r.loss[0]
    assert r.exhaustion[0].mean == r.exhaustion[1].mean


def test_a_window_of_two_steps_catches_failures_in_neighbouring_steps():
    # node 1 fails at step 3, node 0 (its ring neighbour) at step 4: lost with window 2, not with window 1
    assert losses(Fleet(4, 10, 0.0, window=2), [1], [(3, 1), (4, 0)]) == {1: True}
    assert losses(Fleet(4, 10, 0.0, window=1), [1], [(3, 1), (4, 0)]) == {1: False}
    assert losses(Fleet(4, 10, 0.0, window=1), [1], [(4, 1), (4, 0)]) == {1: True}
    # not neighbours in the ring (0 and 2): no group of one replica holds both
    assert losses(Fleet(4, 10, 0.0, window=1), [1], [(4, 2), (4, 0)]) == {1: False}


def test_wilson_interval_at_the_edges():
    assert Estimate.of(0, 1000).lo == 0 and 0.003 < Estimate.of(0, 1000).hi < 0.004
    assert Estimate.of(1000, 1000).hi == 1


@pytest.mark.parametrize("args,message", [
    (["--domains", "3", "--nodes", "4"], "do not divide 4 nodes"),
    (["--p-fault", "1.5"], "1.5"),
])
def test_bad_input_is_a_clear_error(args, message):
    r = CliRunner().invoke(simulate, ["--sizing", "--trials", "10", *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_cli_recommends_replicas_and_spares():
    r = CliRunner().invoke(simulate, ["--sizing", "--nodes", "8", "--steps", "100", "--p-fault", "0.001",
                                      "--trials", "2000", "--json"])
    assert r.exit_code == 0, r.output
    import json
    j = json.loads(r.output)
    assert j["recommended_replicas"] == 1 and j["recommended_spares"] >= 2
    assert set(j["exact_loss_by_replicas"]) == {"0", "1", "2", "3"}


# --- precision (issue 32): the closed form without cancellation -------------------------------------------------

def exact_loss(fleet: Fleet, replicas: int) -> Decimal:
    """The loss probability by brute force over every failure pattern of one step, in exact rationals, then
    1 - (1 - x)^steps at 80 significant digits: the groups as `losses` defines them, no cycle algebra."""
    s, p = fleet.stride(replicas), Fraction(fleet.p_fault)
    groups = [[(o + i * s) % fleet.nodes for i in range(replicas + 1)] for o in range(fleet.nodes)]
    x = Fraction(0)
    for down in itertools.product((False, True), repeat=fleet.nodes):
        if any(all(down[m] for m in g) for g in groups):
            k = sum(down)
            x += p ** k * (1 - p) ** (fleet.nodes - k)
    with localcontext() as ctx:
        ctx.prec = 80
        xd = Decimal(x.numerator) / Decimal(x.denominator)
        return 1 - (1 - xd) ** fleet.steps


def test_the_papers_figures_at_128_nodes():
    # the paper's bound D * p^(k+1) per step, over 100K steps: 1.28e-11 with 2 replicas, 1.28e-17 with 3
    # (the old closed form printed 2.22e-11 for both: 1 - (1 - 1e-16)^n in doubles)
    fleet = Fleet(128, 100_000, 1e-6)
    assert loss_probability_exact(fleet, 2) == pytest.approx(1.28e-11, rel=1e-5)
    assert loss_probability_exact(fleet, 3) == pytest.approx(1.28e-17, rel=1e-5)
    assert loss_probability_exact(fleet, 1) == pytest.approx(1.28e-5, rel=1e-4)


def test_cli_prints_the_papers_figures():
    r = CliRunner().invoke(simulate, ["--sizing", "--nodes", "128", "--p-fault", "1e-6", "--steps", "100000",
                                      "--trials", "20", "--json"])
    assert r.exit_code == 0, r.output
    exact = json.loads(r.output)["exact_loss_by_replicas"]
    assert f"{exact['2']:.3g}" == "1.28e-11" and f"{exact['3']:.3g}" == "1.28e-17"


def test_spare_exhaustion_far_in_the_tail():
    # 1 - cdf is 0 below ~1e-16; the tail summed itself agrees with the exact binomial tail in rationals
    fleet = Fleet(4, 20, P)
    exact = sum(math.comb(80, k) * Fraction(P) ** k * (1 - Fraction(P)) ** (80 - k) for k in range(41, 81))
    assert exhaustion_probability_exact(fleet, 40) == pytest.approx(float(exact), rel=1e-9)
    assert 0 < exhaustion_probability_exact(Fleet(128, 100_000, 1e-6), 60) < 1e-20


@st.composite
def fleets(draw):
    nodes = draw(st.integers(2, 10))
    domains = draw(st.sampled_from([0] + [d for d in range(2, nodes + 1) if nodes % d == 0]))
    p = draw(st.sampled_from([1e-9, 1e-6, 3e-4, 0.01, 0.2, 0.5, 0.9]))
    steps = draw(st.sampled_from([1, 7, 1000, 10 ** 6]))
    return Fleet(nodes, steps, p, domains=domains), draw(st.integers(0, min(3, nodes - 1)))


@settings(max_examples=60, deadline=None)
@given(fleets())
def test_closed_form_agrees_with_exact_rationals(case):
    fleet, replicas = case
    got, want = loss_probability_exact(fleet, replicas), exact_loss(fleet, replicas)
    assert got == pytest.approx(float(want), rel=1e-9, abs=1e-300), (fleet, replicas, got, want)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 400), st.sampled_from([1e-9, 1e-6, 1e-3, 0.1, 0.5]), st.sampled_from([1, 100, 10 ** 5]))
def test_more_replicas_never_lose_more(nodes, p, steps):
    # every node its own domain: a run of k+2 failed neighbours holds a run of k+1, so P(loss) falls with k
    fleet = Fleet(nodes, steps, p)
    losses_by_k = [loss_probability_exact(fleet, k) for k in range(min(4, nodes))]
    assert all(a >= b for a, b in zip(losses_by_k, losses_by_k[1:])), losses_by_k
    if p <= 1e-3 and nodes > 4:       # and by about a factor p per replica where losses are rare (not saturated)
        assert all(b < a * p * 10 for a, b in zip(losses_by_k, losses_by_k[1:]) if 0 < a < 1e-2), losses_by_k
