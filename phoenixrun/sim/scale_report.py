"""`phoenixrun simulate --recovery-fit FILE`: per-phase scaling fits, the recovery time extrapolated
to 10K-100K GPUs with its 95% prediction interval, and hot-swap efficiency vs scale (table, JSON, plot)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from phoenixrun.sim.recovery_fit import DEFAULT_TOTAL, PowerLaw, fit_phases, load_samples, scale_table

SIZES = [8, 64, 512, 4096, 10_000, 16_384, 32_768, 65_536, 100_000]
# one failure every ~18 min at 100K GPUs (docs/simulate.md, "Recovery time vs scale") -> per-GPU MTTF
DEFAULT_GPU_MTTF_S = 18 * 60 * 100_000


def build(path: Path, t_step_s: float, phi: float, gpu_mttf_s: float) -> dict[str, Any]:
    samples = load_samples(path)
    fits = fit_phases(samples)
    phases = tuple(p for p in DEFAULT_TOTAL if p in fits)
    rows = scale_table(fits, phases, SIZES, gpu_mttf_s, t_step_s, phi)
    return {"samples_file": str(path), "samples": len(samples), "total_of": list(phases),
            "gpu_mttf_s": gpu_mttf_s, "t_step_s": t_step_s, "phi": phi,
            "fits": {p: dataclasses.asdict(f) for p, f in fits.items()}, "scale": rows,
            "note": "sizes outside each phase's measured range are extrapolations"}


def print_report(r: dict[str, Any]) -> None:
    console = Console()
    t = Table(title="recovery phases: t(N) = a * N^b, N = GPUs (ranks)")
    for col in ("phase", "a (s)", "b", "log sd", "samples", "measured N"):
        t.add_column(col, justify="right")
    for p, f in r["fits"].items():
        t.add_row(p, f"{f['a']:.4g}", f"{f['b']:.3f}", f"{f['s']:.2f}", str(f["n"]), f"{f['n_min']:g}-{f['n_max']:g}")
    console.print(t)
    s = Table(title=f"hot swap vs scale: total = {' + '.join(r['total_of'])}; "
                    f"GPU MTTF {r['gpu_mttf_s']:.3g} s, t_step {r['t_step_s']:g} s, phi {r['phi']:g}")
    for col in ("GPUs", "job MTTF (s)", "recovery (s) [95% PI]", "eta [95% PI]", ""):
        s.add_column(col, justify="right")
    for row in r["scale"]:
        s.add_row(f"{row['gpus']:,}", f"{row['mttf_s']:.4g}",
                  f"{row['recovery_s']:.3g} [{row['recovery_lo_s']:.3g}, {row['recovery_hi_s']:.3g}]",
                  f"{row['eta']:.4f} [{row['eta_lo']:.4f}, {row['eta_hi']:.4f}]",
                  "extrapolated" if row["extrapolated"] else "measured range")
    console.print(s)


def plot(r: dict[str, Any], samples_path: Path, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = load_samples(samples_path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    grid = [2 * 1.25 ** i for i in range(60) if 2 * 1.25 ** i <= 2e5]
    for i, (p, fd) in enumerate(r["fits"].items()):
        if p not in r["total_of"]:
            continue
        f = PowerLaw(**fd)
        color = f"C{i}"
        pts = [(s["gpus"], s["phases"][p]) for s in samples if s["phases"].get(p) is not None]
        ax1.scatter([x for x, _ in pts], [max(y, 1e-4) for _, y in pts], s=12, color=color)
        ax1.plot(grid, [f.median(n) for n in grid], color=color, label=f"{p}: {f.a:.2g} N^{f.b:.2f}")
        ax1.fill_between(grid, *zip(*(f.interval(n) for n in grid)), color=color, alpha=0.12)
    ax1.set(xscale="log", yscale="log", xlabel="GPUs (ranks)", ylabel="seconds",
            title="phases: measured (dots), fit, 95% PI")
    ax1.set_ylim(1e-4, 1e3)
    ax1.legend(fontsize=7)
    rows = r["scale"]
    xs = [row["gpus"] for row in rows]
    ax2.plot(xs, [row["eta"] for row in rows], "o-", color="tab:green", label="hot swap, fitted recovery time")
    ax2.fill_between(xs, [row["eta_lo"] for row in rows], [row["eta_hi"] for row in rows], color="tab:green",
                     alpha=0.2, label="95% prediction interval")
    measured = max(fd["n_max"] for fd in r["fits"].values())
    ax2.axvspan(measured, max(xs), color="grey", alpha=0.1, label="beyond every phase's data")
    ax2.set(xscale="log", xlabel="GPUs", ylabel="eta = MTTF / (MTTF + T_hotswap + phi t_step)",
            title=f"hot-swap efficiency, GPU MTTF {r['gpu_mttf_s']:.2g} s (extrapolated)")
    ax2.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
