"""`phoenixrun simulate --scale-result FILE... --rank-result FILE`: the measured recovery curve
(sim/recovery_curve.py) at each size the control plane was measured at, and the Monte Carlo of the job at that
size with that recovery time (table, JSON, plot)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from phoenixrun.sim import model
from phoenixrun.sim.montecarlo import run
from phoenixrun.sim.recovery_curve import REBUILD_CAVEAT, compose, efficiency, load_control, load_ranks

# one failure every ~18 min at 100K GPUs (docs/simulate.md, "Recovery time vs scale") -> per-GPU MTTF
DEFAULT_GPU_MTTF_S = 18 * 60 * 100_000


def build(scale: Sequence[Path], ranks_path: Path, scenario: model.Scenario, gpu_mttf_s: float, trials: int,
          seed: int) -> dict[str, Any]:
    """The curve and, per point, the job at that size: MTTF = gpu_mttf / GPUs, hot swap = the point's total."""
    ranks = load_ranks(ranks_path)
    rows = []
    for p in compose([load_control(f) for f in scale], ranks):
        job = dataclasses.replace(scenario, mttf_s=gpu_mttf_s / p.gpus, t_hotswap_s=p.total_s)
        exact = model.exact_prediction(job)
        row: dict[str, Any] = {**dataclasses.asdict(p), "total_s": p.total_s, "mttf_s": job.mttf_s,
                               "eta_paper": efficiency(job.mttf_s, p.total_s, job.t_step_s, job.phi),
                               "eta_exact": {"hot_swap": exact.eta_phoenix, "checkpoint_restart": exact.eta_ckpt}}
        try:
            mc = run(job, trials=trials, seed=seed)
        except ValueError as e:      # checkpoint-restart would fail too often to simulate at this MTTF
            row["monte_carlo"] = {"refused": str(e)}
        else:
            row["monte_carlo"] = {
                "trials": mc.trials, "seed": mc.seed,
                "hot_swap_eta": dataclasses.asdict(mc.hotswap.efficiency),
                "hot_swap_lost_s": dataclasses.asdict(mc.hotswap.lost_s),
                "checkpoint_restart_eta": dataclasses.asdict(mc.ckpt.efficiency),
                "speedup": dataclasses.asdict(mc.speedup) if mc.speedup else None}
        rows.append(row)
    return {"ranks": dataclasses.asdict(ranks), "ranks_caveat": REBUILD_CAVEAT, "gpu_mttf_s": gpu_mttf_s,
            "scenario": dataclasses.asdict(scenario), "curve": rows,
            "note": "a point only where the control plane was measured; nothing beyond the largest size"}


def print_report(r: dict[str, Any]) -> None:
    console = Console()
    rk = r["ranks"]
    parts = ", ".join(f"{name} {rk[k]:.3f}" for name, k in (("fetch", "fetch_s"), ("rebuild", "rebuild_s"),
                                                           ("state", "state_s")) if rk[k] is not None)
    console.print(f"ranks: quiesce {rk['quiesce_s']:.3f} s + restore {rk['restore_s']:.3f} s ({parts}), medians of "
                  f"{rk['trials']} node-loss trials at {rk['gpus']} ranks ({rk['source']}); {r['ranks_caveat']}")
    s = r["scenario"]
    t = Table(title=f"hot swap vs scale, measured: GPU MTTF {r['gpu_mttf_s']:.3g} s, {s['steps']} steps x "
                    f"{s['t_step_s']:g} s, phi {s['phi']:g}; checkpoint-restart {s['t_restart_s']:g} s restart, "
                    f"every {s['ckpt_interval']} steps")
    for col in ("nodes", "GPUs", "fault", "detect", "control", "ranks", "recovery", "job MTTF", "eta, MC [95% CI]",
                "eta, exact", "ckpt eta"):
        t.add_column(col, justify="right")
    for row in r["curve"]:
        mc = row["monte_carlo"]
        eta = (f"{mc['hot_swap_eta']['mean']:.4f} [{mc['hot_swap_eta']['lo']:.4f}, {mc['hot_swap_eta']['hi']:.4f}]"
               if "refused" not in mc else "-")
        t.add_row(f"{row['nodes']:,}", f"{row['gpus']:,}", row["fault"], f"{row['detect_s']:.3f}",
                  f"{row['control_s']:.3f}", f"{row['ranks_s']:.3f}", f"{row['total_s']:.3f}",
                  f"{row['mttf_s']:.4g}", eta, f"{row['eta_exact']['hot_swap']:.4f}",
                  f"{row['eta_exact']['checkpoint_restart']:.4f}")
    t.caption = ("seconds; recovery = detect + control + ranks; eta = hot swap's efficiency (ckpt: checkpoint-"
                 "restart's), Monte Carlo where checkpoint-restart's failures are few enough to simulate ('-': not), "
                 "and exact (Poisson, sim/model.py)")
    console.print(t)
    console.print("control plane from: " + ", ".join(f"{row['nodes']}: {row['sources'][0]}" for row in r["curve"]))


def plot(r: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    faults = sorted({row["fault"] for row in r["curve"]})
    for fault, marker in zip(faults, "os^Dv"):
        rows = [row for row in r["curve"] if row["fault"] == fault]
        xs = [row["gpus"] for row in rows]
        bottom = [0.0] * len(rows)
        for key, label, color in (("detect_s", "detection", "C0"), ("control_s", "+ control plane", "C1"),
                                  ("ranks_s", "+ ranks = recovery", "C2")):
            top = [b + row[key] for b, row in zip(bottom, rows)]
            ax1.plot(xs, top, marker=marker, color=color, label=f"{label} ({fault})")
            bottom = top
        ax2.plot(xs, [row["eta_exact"]["hot_swap"] for row in rows], marker=marker, color="C2",
                 label=f"hot swap, exact ({fault})")
        ax2.plot(xs, [row["eta_exact"]["checkpoint_restart"] for row in rows], marker=marker, linestyle="--",
                 color="grey", label=f"checkpoint-restart, exact ({fault})")
        mcs = [(row["gpus"], row["monte_carlo"]) for row in rows if "refused" not in row["monte_carlo"]]
        if mcs:
            ax2.errorbar([g for g, _ in mcs], [m["hot_swap_eta"]["mean"] for _, m in mcs],
                         yerr=[[m["hot_swap_eta"]["mean"] - m["hot_swap_eta"]["lo"] for _, m in mcs],
                               [m["hot_swap_eta"]["hi"] - m["hot_swap_eta"]["mean"] for _, m in mcs]],
                         fmt="none", ecolor="k", capsize=3, label=f"hot swap, Monte Carlo 95% CI ({fault})")
    ax1.set(xscale="log", xlabel="GPUs (ranks)", ylabel="seconds, cumulative",
            title="recovery: measured sizes only")
    ax1.legend(fontsize=7)
    ax2.set(xscale="log", xlabel="GPUs", ylabel="efficiency",
            title=f"GPU MTTF {r['gpu_mttf_s']:.2g} s")
    ax2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
