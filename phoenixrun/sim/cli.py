"""`phoenixrun simulate`: closed-form model and Monte Carlo, checkpoint-restart vs hot swap.

The main CLI group registers this with `from phoenixrun.sim.cli import simulate`;
`python -m phoenixrun.sim.cli` runs it alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from phoenixrun.sim import curve_report, model
from phoenixrun.sim.montecarlo import (
    DEFAULT_TRIALS,
    PRESETS,
    Estimate,
    MonteCarloResult,
    StrategyStats,
    load_trace,
    run,
)
from phoenixrun.sim.recovery_curve import CurveError
from phoenixrun.sim.sizing import Estimate as SizingEstimate
from phoenixrun.sim.sizing import Fleet, exhaustion_probability_exact, loss_probability_exact, size

POSITIVE = click.FloatRange(min=0, min_open=True)
NON_NEGATIVE = click.FloatRange(min=0)

# option name -> (Scenario field, click type, help)
SCENARIO_OPTIONS: dict[str, tuple[str, click.ParamType[float], str]] = {
    "--mttf": ("mttf_s", POSITIVE, "Job (system) mean time to failure, seconds."),
    "--t-step": ("t_step_s", POSITIVE, "Seconds per training step."),
    "--steps": ("steps", click.IntRange(min=1), "Steps in the job (N)."),
    "--ckpt-every": ("ckpt_interval", click.IntRange(min=1), "Checkpoint every K steps (checkpoint-restart)."),
    "--ckpt-cost": ("ckpt_overhead_s", NON_NEGATIVE, "Seconds to write one checkpoint."),
    "--restart": ("t_restart_s", NON_NEGATIVE, "Seconds for a checkpoint-restart recovery."),
    "--hotswap": ("t_hotswap_s", NON_NEGATIVE, "Seconds for a hot-swap recovery."),
    "--phi": ("phi", click.FloatRange(0, 1, max_open=True), "Fraction of a step redone after a hot swap, in [0,1)."),
}


def _scenario_options(f: Any) -> Any:
    for opt, (field, typ, help_) in reversed(SCENARIO_OPTIONS.items()):
        f = click.option(opt, field, type=typ, default=None, help=help_ + " Overrides the preset.")(f)
    return f


def _est(e: Estimate | SizingEstimate, fmt: str) -> str:
    if e.lo == e.hi:  # one deterministic trajectory (a trace): no interval to show
        return f"{e.mean:{fmt}}"
    return f"{e.mean:{fmt}} [{e.lo:{fmt}}, {e.hi:{fmt}}]"


def _est_json(e: Estimate | None) -> dict[str, Any] | None:
    return None if e is None else {"mean": e.mean, "ci95": [e.lo, e.hi]}


def _strategy_json(st: StrategyStats) -> dict[str, Any]:
    return {"lost_s": _est_json(st.lost_s), "efficiency": _est_json(st.efficiency), "failures_per_job": st.failures,
            "checkpoint_writes_s": st.overhead_s, "recovery_s": st.recovery_s, "rework_s": st.rework_s}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf


def _report(s: model.Scenario, mc: MonteCarloResult, trace: str | None) -> dict[str, Any]:
    """Everything `--json` prints; the table shows the same figures."""
    paper, exact = model.paper_prediction(s), model.exact_prediction(s)
    def pair(c: float | None, h: float | None) -> dict[str, float | None]:
        return {"checkpoint_restart": c, "hot_swap": h}

    return {
        "scenario": dataclasses.asdict(s),
        "closed_form": {
            "paper": {"cost_per_failure_s": pair(paper.cost_ckpt_s, paper.cost_phoenix_s),
                      "efficiency": pair(paper.eta_ckpt, paper.eta_phoenix), "speedup": _finite(paper.speedup)},
            "exact": {"lost_s": pair(_finite(model.expected_lost_ckpt(s)), _finite(model.expected_lost_hotswap(s))),
                      "efficiency": pair(exact.eta_ckpt, exact.eta_phoenix), "speedup": _finite(exact.speedup)},
        },
        "monte_carlo": {
            "trials": mc.trials, "seed": mc.seed, "trace": trace,
            "checkpoint_restart": _strategy_json(mc.ckpt), "hot_swap": _strategy_json(mc.hotswap),
            "speedup": _est_json(mc.speedup),
        },
    }


def _print_table(name: str, s: model.Scenario, mc: MonteCarloResult, trace: str | None) -> None:
    paper, exact = model.paper_prediction(s), model.exact_prediction(s)
    console = Console()
    source = f"trace {trace}" if trace else f"Poisson, {mc.trials} trials, seed {mc.seed}"
    table = Table(title=f"simulate {name}: checkpoint-restart vs hot swap")
    table.add_column("")
    table.add_column("checkpoint-restart", justify="right")
    table.add_column("hot swap", justify="right")
    table.add_row("E[C]/failure, paper (s)", f"{paper.cost_ckpt_s:.1f}", f"{paper.cost_phoenix_s:.1f}")
    table.add_row("eta, paper closed form", f"{paper.eta_ckpt:.4f}", f"{paper.eta_phoenix:.4f}")
    table.add_row("eta, exact (Poisson)", f"{exact.eta_ckpt:.4f}", f"{exact.eta_phoenix:.4f}")
    table.add_row("MC lost s [95% CI]", _est(mc.ckpt.lost_s, ".0f"), _est(mc.hotswap.lost_s, ".1f"))
    table.add_row("MC eta [95% CI]", _est(mc.ckpt.efficiency, ".4f"), _est(mc.hotswap.efficiency, ".4f"))
    table.add_row("MC failures/job", f"{mc.ckpt.failures:.2f}", f"{mc.hotswap.failures:.2f}")
    table.caption = source
    console.print(
        f"MTTF {s.mttf_s:g} s, {s.steps} steps x {s.t_step_s:g} s, checkpoint every {s.ckpt_interval} "
        f"steps ({s.ckpt_overhead_s:g} s), restart {s.t_restart_s:g} s, hot swap {s.t_hotswap_s:g} s, phi {s.phi:g}")
    console.print(table)
    mc_speedup = _est(mc.speedup, ".1f") if mc.speedup else "n/a (hot swap lost nothing)"
    console.print(f"lost-time speed-up: paper {paper.speedup:.1f}x, exact {exact.speedup:.1f}x, "
                  f"Monte Carlo {mc_speedup}")


def _plot(path: str, name: str, mc: MonteCarloResult) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = ["checkpoint-restart", "hot swap"]
    ests = [mc.ckpt.lost_s, mc.hotswap.lost_s]
    means = [e.mean / 3600 for e in ests]
    errs = [[(e.mean - e.lo) / 3600 for e in ests], [(e.hi - e.mean) / 3600 for e in ests]]
    ax.bar(labels, means, yerr=errs, capsize=6, color=["tab:red", "tab:green"])
    if min(means) > 0:
        ax.set_yscale("log")  # the two differ by ~100x
        ax.set_ylim(top=max(means) * 4)  # room for the labels
    for x, m in enumerate(means):
        ax.annotate(f"{m:.3g} h", (x, m), ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    ax.set_ylabel("lost time per job (h), 95% CI")
    ax.set_title(f"{name}: Monte Carlo, {mc.trials} trials")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command("simulate")
@click.option("--example", type=click.Choice(sorted(PRESETS)), default="paper", show_default=True,
              help="Preset scenario; the options below override its fields.")
@_scenario_options
@click.option("--trials", type=click.IntRange(min=1), default=DEFAULT_TRIALS, show_default=True,
              help="Monte Carlo trajectories.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the Monte Carlo trajectories.")
@click.option("--trace", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Failure times, seconds since job start, one per line (replaces the Poisson process).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of a table.")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write a PNG of the lost time per job (needs matplotlib); with --scale-result, of the "
                   "measured recovery time and efficiency vs scale.")
@click.option("--scale-result", "scale_results", multiple=True, default=(),
              type=click.Path(dir_okay=False, path_type=Path),
              help="A `benchmarks/master_scale.py --json` result (repeat for each size): with --rank-result, the "
                   "recovery time at each measured size and the Monte Carlo of the job there, instead of one "
                   "scenario.")
@click.option("--rank-result", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --scale-result: a `benchmarks/recovery.py` or `benchmarks/detection.py --json` result, "
                   "whose node-loss trials give what real ranks add (quiesce + restore).")
@click.option("--gpu-mttf", type=POSITIVE, default=curve_report.DEFAULT_GPU_MTTF_S, show_default=True,
              help="With --scale-result: per-GPU MTTF, seconds (job MTTF = this / GPUs).")
@click.option("--sizing", is_flag=True,
              help="Instead: how many replicas and spares the job needs (probability of losing a node's private "
                   "state, of running out of spares), Monte Carlo over --trials runs of --steps steps.")
@click.option("--nodes", type=click.IntRange(min=1), default=64, show_default=True, help="With --sizing: nodes.")
@click.option("--p-fault", type=click.FloatRange(0, 1), default=None,
              help="With --sizing: probability a node fails in one step (default: --t-step / node MTTF, the node "
                   "MTTF being --mttf x --nodes).")
@click.option("--domain-fault", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="With --sizing: probability a fault domain (all its nodes) fails in one step.")
@click.option("--domains", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --sizing: fault domains, dividing --nodes evenly (0: every node its own).")
@click.option("--window", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --sizing: steps until a failed node's state is protected again.")
@click.option("--target", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.01,
              show_default=True, help="With --sizing: acceptable probability over the run.")
def simulate(example: str, trials: int, seed: int, trace: str | None, as_json: bool, plot: str | None,
             scale_results: tuple[Path, ...], rank_result: Path | None, gpu_mttf: float, sizing: bool, nodes: int,
             p_fault: float | None,
             domain_fault: float, domains: int, window: int, target: float, **overrides: Any) -> None:
    """Checkpoint-restart vs PHOENIX hot swap: closed-form efficiency and a Monte Carlo of lost time."""
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            click.echo("Error: --plot needs matplotlib: pip install 'phoenixrun[plot]'", err=True)
            raise SystemExit(2) from None
    scenario = dataclasses.replace(PRESETS[example], **{k: v for k, v in overrides.items() if v is not None})
    if scale_results or rank_result is not None:
        if not scale_results or rank_result is None:
            raise click.UsageError("the recovery curve needs both --scale-result (one or more) and --rank-result")
        _curve(scale_results, rank_result, scenario, gpu_mttf, trials, seed, as_json, plot)
        return
    if sizing:
        if p_fault is None:
            p_fault = -math.expm1(-scenario.t_step_s / (scenario.mttf_s * nodes))
        try:
            fleet = Fleet(nodes, scenario.steps, p_fault, domain_fault, domains, window)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        _sizing(fleet, target, trials, seed, as_json)
        return
    times = None
    if trace is not None:
        try:
            times = load_trace(trace)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--trace'") from None
    try:
        mc = run(scenario, trials=trials, seed=seed, trace=times)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(_report(scenario, mc, trace), indent=2))
    else:
        _print_table(example, scenario, mc, trace)
    if plot is not None:
        _plot(plot, example, mc)
        if not as_json:
            click.echo(f"plot written to {plot}")


def _sizing(fleet: Fleet, target: float, trials: int, seed: int, as_json: bool) -> None:
    r = size(fleet, target, trials, seed)
    exact = fleet.p_domain == 0 and fleet.window == 1
    report = {"fleet": dataclasses.asdict(fleet), "target": target, "trials": trials, **r.to_json()}
    if exact:
        report["exact_loss_by_replicas"] = {k: loss_probability_exact(fleet, k) for k in r.loss}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = Console()
    console.print(f"{fleet.nodes} nodes in {fleet.n_domains} fault domains, {fleet.steps} steps, "
                  f"p(node fault)/step {fleet.p_fault:.3g}, p(domain fault)/step {fleet.p_domain:.3g}, "
                  f"window {fleet.window} step(s), {trials} runs")
    t = Table("replicas", "P(state lost) [95% CI]", *(["exact"] if exact else []))
    for k, e in r.loss.items():
        t.add_row(str(k), _est(e, ".3g"), *([f"{report['exact_loss_by_replicas'][k]:.3g}"] if exact else []))
    console.print(t)
    t = Table("spares", "P(spares run out) [95% CI]", *(["exact"] if fleet.p_domain == 0 else []))
    shown = sorted(r.exhaustion)[:(r.spares if r.spares is not None else len(r.exhaustion)) + 3]
    for s in shown:
        t.add_row(str(s), _est(r.exhaustion[s], ".3g"),
                  *([f"{exhaustion_probability_exact(fleet, s):.3g}"] if fleet.p_domain == 0 else []))
    console.print(t)
    console.print(f"recommended for P <= {target:g}: --replicas "
                  f"{r.replicas if r.replicas is not None else f'more than {max(r.loss)}'}, --spares "
                  f"{r.spares if r.spares is not None else '? (more --trials needed to resolve the target)'}")


def _curve(scale: tuple[Path, ...], ranks: Path, scenario: model.Scenario, gpu_mttf: float, trials: int, seed: int,
           as_json: bool, plot: str | None) -> None:
    try:
        r = curve_report.build(scale, ranks, scenario, gpu_mttf, trials, seed)
    except CurveError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        curve_report.print_report(r)
    if plot is not None:
        curve_report.plot(r, plot)
        if not as_json:
            click.echo(f"plot written to {plot}")


if __name__ == "__main__":
    simulate()
