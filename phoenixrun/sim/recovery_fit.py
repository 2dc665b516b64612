"""Recovery time vs scale: a power law per recovery phase, fitted to measured samples, and its
extrapolation (with a prediction interval) to sizes far beyond what was measured.

Samples come from the recovery benchmark (per-phase times of `recovery_done` at a few world sizes)
and from the master scale test (the control plane's own time at thousands of simulated nodes).
Each phase t(N) = a * N^b is fitted by least squares on log t vs log N; the 95% prediction
interval at N is the log-space Student-t interval, so it widens the further N lies from the data.
The total recovery time sums the phases; its interval comes from sampling each phase's
predictive distribution (independent phases). Everything beyond the measured sizes is an
extrapolation and is labelled as such.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

FLOOR_S = 1e-4        # events round phase times to 0.1 ms: a 0 means "below resolution", not zero
# two-sided 95% Student-t quantiles by degrees of freedom (beyond 30: 1.96 is close enough)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}
DEFAULT_TOTAL = ("detect_s", "quiesce_s", "restore_s", "control_s")


class FitError(ValueError):
    """Not enough (or unusable) samples to fit a phase."""


def t975(df: int) -> float:
    if df < 1:
        raise FitError("need at least 3 samples at 2 sizes for an interval")
    if df in _T975:
        return _T975[df]
    below = [d for d in _T975 if d < df]
    return _T975[max(below)] if df <= 30 else 1.96


@dataclass(frozen=True)
class PowerLaw:
    """t(N) = a * N^b; log-space residual sd `s` from n samples at sizes in [n_min, n_max]."""
    phase: str
    a: float
    b: float
    s: float
    n: int
    mean_lx: float
    sxx: float
    n_min: float
    n_max: float

    def median(self, size: float) -> float:
        growth: float = size ** self.b   # sizes are positive: a real power
        return self.a * growth

    def log_sd(self, size: float) -> float:
        """Predictive sd of log t at `size` (a new observation, not the mean)."""
        return self.s * math.sqrt(1 + 1 / self.n + (math.log(size) - self.mean_lx) ** 2 / self.sxx)

    def interval(self, size: float) -> tuple[float, float]:
        half = t975(self.n - 2) * self.log_sd(size)
        m = self.median(size)
        return m * math.exp(-half), m * math.exp(half)

    def extrapolated(self, size: float) -> bool:
        return not self.n_min <= size <= self.n_max


def fit_power_law(phase: str, points: list[tuple[float, float]]) -> PowerLaw:
    """Least squares of log t on log N. points: (size N > 0, seconds)."""
    pts = [(float(n), max(float(t), FLOOR_S)) for n, t in points]
    if any(n <= 0 for n, _ in pts):
        raise FitError(f"{phase}: sizes must be positive")
    if len(pts) < 3 or len({n for n, _ in pts}) < 2:
        raise FitError(f"{phase}: need at least 3 samples at 2 or more sizes (have {len(pts)})")
    lx = [math.log(n) for n, _ in pts]
    ly = [math.log(t) for _, t in pts]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx
    la = my - b * mx
    resid = [y - (la + b * x) for x, y in zip(lx, ly)]
    s = math.sqrt(sum(r * r for r in resid) / (len(pts) - 2))
    return PowerLaw(phase, math.exp(la), b, s, len(pts), mx, sxx, min(n for n, _ in pts), max(n for n, _ in pts))


def load_samples(path: Path) -> list[dict[str, Any]]:
    """A samples file: {"samples": [{"gpus": N, "phases": {"quiesce_s": t, ...}, "source": "..."}, ...]}."""
    try:
        data = json.loads(Path(path).read_text())
        samples: list[dict[str, Any]] = data["samples"]
        for s in samples:
            if not (isinstance(s["gpus"], (int, float)) and isinstance(s["phases"], dict)):
                raise TypeError
    except FileNotFoundError:
        raise FitError(f"{path}: no such file") from None
    except (ValueError, KeyError, TypeError):
        raise FitError(f"{path}: not a samples file (expected {{\"samples\": [{{\"gpus\": N, \"phases\": {{...}}}}]}})") \
            from None
    return samples


def fit_phases(samples: list[dict[str, Any]]) -> dict[str, PowerLaw]:
    by_phase: dict[str, list[tuple[float, float]]] = {}
    for s in samples:
        for phase, t in s["phases"].items():
            if t is not None:
                by_phase.setdefault(phase, []).append((s["gpus"], t))
    return {p: fit_power_law(p, pts) for p, pts in sorted(by_phase.items())}


@dataclass(frozen=True)
class TotalPrediction:
    gpus: float
    median_s: float
    lo_s: float
    hi_s: float
    extrapolated: bool


def predict_total(fits: dict[str, PowerLaw], phases: tuple[str, ...], gpus: float, draws: int = 4000,
                  seed: int = 0) -> TotalPrediction:
    """Sum of the phases at `gpus`: each drawn from its log-normal predictive (t approximated by a
    normal of the same 95% half-width), independent; median and 2.5/97.5 percentiles of the sum."""
    missing = [p for p in phases if p not in fits]
    if missing:
        raise FitError(f"no samples for phase(s) {', '.join(missing)}")
    rng = random.Random(seed)
    params = []
    for p in phases:
        f = fits[p]
        sd = f.log_sd(gpus) * t975(f.n - 2) / 1.96
        params.append((math.log(f.median(gpus)), sd))
    totals = sorted(sum(math.exp(rng.gauss(mu, sd)) for mu, sd in params) for _ in range(draws))
    return TotalPrediction(gpus, totals[draws // 2], totals[int(0.025 * draws)], totals[int(0.975 * draws)],
                           any(fits[p].extrapolated(gpus) for p in phases))


def efficiency(mttf_s: float, hotswap_s: float, t_step_s: float, phi: float) -> float:
    """eta = MTTF / (MTTF + T_hotswap + phi * t_step): the paper's model for hot swap."""
    return mttf_s / (mttf_s + hotswap_s + phi * t_step_s)


def scale_table(fits: dict[str, PowerLaw], phases: tuple[str, ...], sizes: Sequence[float], gpu_mttf_s: float,
                t_step_s: float, phi: float, seed: int = 0) -> list[dict[str, Any]]:
    """Per size: job MTTF (independent GPUs), predicted recovery time with its interval, efficiency."""
    rows = []
    for n in sizes:
        p = predict_total(fits, phases, n, seed=seed)
        mttf = gpu_mttf_s / n
        rows.append({"gpus": n, "mttf_s": mttf, "recovery_s": p.median_s, "recovery_lo_s": p.lo_s,
                     "recovery_hi_s": p.hi_s, "eta": efficiency(mttf, p.median_s, t_step_s, phi),
                     "eta_lo": efficiency(mttf, p.hi_s, t_step_s, phi),
                     "eta_hi": efficiency(mttf, p.lo_s, t_step_s, phi), "extrapolated": p.extrapolated})
    return rows
